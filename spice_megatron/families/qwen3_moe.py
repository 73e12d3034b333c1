"""Qwen3-MoE: Qwen3's attention with softmax-routed experts, no shared experts; dense MLPs where
mlp_only_layers or decoder_sparse_step say."""
from __future__ import annotations

from spice_megatron.families.spec import Family, ModelSpec, MoESpec, UnsupportedModelError, dense_spec


def experts(config: dict, num_layers: int) -> MoESpec:
    # transformers 5 writes num_local_experts; the hub's Qwen3-MoE configs say num_experts
    count = config.get("num_experts", config.get("num_local_experts"))
    if not count:
        raise UnsupportedModelError("Qwen3MoeForCausalLM: config.json names no num_experts")
    if config.get("shared_expert_intermediate_size"):
        raise UnsupportedModelError("shared experts (shared_expert_intermediate_size) are not supported")
    dense = set(config.get("mlp_only_layers") or [])
    step = int(config.get("decoder_sparse_step", 1) or 1)
    layers = tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))
    return MoESpec(num_experts=int(count), top_k=int(config["num_experts_per_tok"]),
                   expert_ffn_hidden_size=int(config["moe_intermediate_size"]),
                   norm_topk_prob=bool(config.get("norm_topk_prob", True)), moe_layers=layers)


def parse(config: dict, family: Family) -> ModelSpec:
    return dense_spec(config, family, moe=experts(config, config["num_hidden_layers"]))


def tiny(common: dict, *, num_experts: int, top_k: int, moe_intermediate_size: int,
         mlp_only_layers: tuple[int, ...] = (), **_) -> dict:
    return {**common, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "rope_theta": 1000000.0,
            "num_experts": num_experts, "num_experts_per_tok": top_k, "moe_intermediate_size": moe_intermediate_size,
            "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": list(mlp_only_layers),
            "router_aux_loss_coef": 0.001}


FAMILY = Family("qwen3_moe", "Qwen3MoeForCausalLM", "qwen3_moe", parse, tiny, qk_norm=True, experts=True,
                examples="Qwen3-30B-A3B-Base, Qwen3-235B-A22B (no shared experts)")
