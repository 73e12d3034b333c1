"""Qwen3 (dense): per-head RMSNorm on q and k, no biases."""
from __future__ import annotations

from spice_megatron.families.spec import Family, dense_spec


def tiny(common: dict, **_) -> dict:
    return {**common, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "rope_theta": 1000000.0}


FAMILY = Family("qwen3", "Qwen3ForCausalLM", "qwen3", dense_spec, tiny, qk_norm=True,
                examples="Qwen3-4B/8B/14B-Base, Qwen3-32B")
