"""GLM-4.5 and GLM-4.5-Air: q/k/v biases (attention_bias), q/k norms where use_qk_norm, rotary on
part of each head (partial_rotary_factor), DeepSeek-V3's routing and shared experts; its
multi-token-prediction layers are skipped."""
from __future__ import annotations

from spice_megatron.families.deepseek_v3 import routed_experts
from spice_megatron.families.spec import Family, ModelSpec, dense_spec


def parse(config: dict, family: Family) -> ModelSpec:
    return dense_spec(config, family, moe=routed_experts(config, config["num_hidden_layers"]),
                      qk_norm=bool(config.get("use_qk_norm", False)),
                      qkv_bias=bool(config.get("attention_bias", False)))


def tiny(common: dict, *, num_experts: int, top_k: int, moe_intermediate_size: int, **_) -> dict:
    return {**common, "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "rope_theta": 1000000.0,
            "attention_bias": True, "use_qk_norm": True, "partial_rotary_factor": 0.5,
            "n_routed_experts": num_experts, "num_experts_per_tok": top_k,
            "moe_intermediate_size": moe_intermediate_size, "n_shared_experts": 1, "first_k_dense_replace": 1,
            "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0, "norm_topk_prob": True,
            "num_nextn_predict_layers": 0}


FAMILY = Family("glm4_moe", "Glm4MoeForCausalLM", "glm4_moe", parse, tiny, qkv_bias=True, experts=True,
                examples="GLM-4.5, GLM-4.5-Air (multi-token-prediction layers skipped)")
