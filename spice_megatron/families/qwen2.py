"""Qwen2 and Qwen2.5: biases on q/k/v (not on o_proj), no q/k norms, full attention only."""
from __future__ import annotations

from spice_megatron.families.spec import Family, dense_spec


def tiny(common: dict, **_) -> dict:
    return {**common, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "rope_theta": 1000000.0,
            "use_sliding_window": False}


FAMILY = Family("qwen2", "Qwen2ForCausalLM", "qwen2", dense_spec, tiny, qkv_bias=True,
                examples="Qwen2, Qwen2.5, Qwen2.5-Math, DeepSeek-R1-Distill-Qwen (no sliding window)")
