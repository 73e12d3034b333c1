"""DeepSeek-V3 (and DeepSeek-R1, Kimi-K2, Moonlight): multi-head latent attention, sigmoid routing
with a correction bias over expert groups, shared experts, dense first layers; bf16 or FP8
block-scaled checkpoints; its multi-token-prediction layers are skipped."""
from __future__ import annotations

from spice_megatron.families.spec import Family, MLASpec, ModelSpec, MoESpec, UnsupportedModelError, dense_spec


def routed_experts(config: dict, num_layers: int) -> MoESpec:
    """DeepSeek-V3's router: sigmoid scores, plus a correction bias where experts are chosen, the
    chosen scores normalised and scaled by routed_scaling_factor; group-limited top-k. megatron
    scores a group by its top num_experts_per_tok / topk_group experts, DeepSeek-V3 by its top 2:
    the same for every published config, and checked."""
    top_k, groups, group_topk = int(config["num_experts_per_tok"]), int(config.get("n_group") or 1), \
        int(config.get("topk_group") or 1)
    if config.get("scoring_func", "sigmoid") != "sigmoid":
        raise UnsupportedModelError(f"scoring_func={config['scoring_func']!r} is not supported (sigmoid)")
    if config.get("topk_method", "noaux_tc") != "noaux_tc":
        raise UnsupportedModelError(f"topk_method={config['topk_method']!r} is not supported (noaux_tc)")
    if not config.get("norm_topk_prob", True):
        raise UnsupportedModelError("norm_topk_prob=false is not supported with sigmoid routing (megatron normalises)")
    if groups > 1 and top_k // group_topk != 2:
        raise UnsupportedModelError(f"num_experts_per_tok={top_k} over topk_group={group_topk}: megatron scores a "
                                    f"group by its top {top_k // group_topk} experts, DeepSeek-V3 by its top 2")
    first_dense, freq = int(config.get("first_k_dense_replace", 0)), int(config.get("moe_layer_freq", 1) or 1)
    ffn = int(config["moe_intermediate_size"])
    return MoESpec(num_experts=int(config["n_routed_experts"]), top_k=top_k, expert_ffn_hidden_size=ffn,
                   norm_topk_prob=True, moe_layers=tuple(i >= first_dense and i % freq == 0 for i in range(num_layers)),
                   score_function="sigmoid", expert_bias=True, num_groups=groups if groups > 1 else None,
                   group_topk=group_topk if groups > 1 else None,
                   scaling_factor=float(config.get("routed_scaling_factor", 1.0)),
                   shared_expert_ffn_hidden_size=int(config.get("n_shared_experts") or 0) * ffn)


def parse(config: dict, family: Family) -> ModelSpec:
    mla = MLASpec(q_lora_rank=config.get("q_lora_rank") or None, kv_lora_rank=int(config["kv_lora_rank"]),
                  qk_nope_head_dim=int(config["qk_nope_head_dim"]), qk_rope_head_dim=int(config["qk_rope_head_dim"]),
                  v_head_dim=int(config["v_head_dim"]), rope_interleave=bool(config.get("rope_interleave", True)))
    if not mla.rope_interleave:  # megatron's latent attention de-interleaves the rotary dims, as HF's V3 does
        raise UnsupportedModelError(f"{family.architecture} with rope_interleave=false is not supported")
    # latent attention expands its keys and values to every head
    return dense_spec(config, family, mla=mla, moe=routed_experts(config, config["num_hidden_layers"]),
                      num_kv_heads=config["num_attention_heads"], head_dim=mla.qk_nope_head_dim + mla.qk_rope_head_dim)


def tiny(common: dict, *, num_heads: int, num_experts: int, top_k: int, moe_intermediate_size: int,
         engine: bool = False, **_) -> dict:
    """1 dense layer then sigmoid-routed experts and a shared one; `engine`: the latent that vLLM's
    CPU latent-attention kernel is compiled for (V3's 512 + 64) only."""
    config = {**common, "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
              "num_key_value_heads": num_heads, "head_dim": 8, "q_lora_rank": 48, "kv_lora_rank": 32,
              "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": num_experts,
              "num_experts_per_tok": top_k, "moe_intermediate_size": moe_intermediate_size, "n_shared_experts": 1,
              "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.5,
              "norm_topk_prob": True, "rope_interleave": True, "num_nextn_predict_layers": 0,
              "topk_method": "noaux_tc", "scoring_func": "sigmoid",
              "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512,
                               "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}}
    if engine:
        config.update(kv_lora_rank=512, qk_rope_head_dim=64, head_dim=64)
    return config


FAMILY = Family("deepseek_v3", "DeepseekV3ForCausalLM", "deepseek_v3", parse, tiny, experts=True, mla=True,
                examples="DeepSeek-V3(-Base), DeepSeek-R1, Kimi-K2, Moonlight (bf16 or FP8 block-scaled; "
                         "multi-token-prediction layers skipped)")
