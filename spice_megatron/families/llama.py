"""Llama 3 (and the models built on it: OctoThinker, SmolLM2): no q/k norms, no biases, llama3
rotary scaling or none."""
from __future__ import annotations

from spice_megatron.families.spec import Family, dense_spec


def tiny(common: dict, **_) -> dict:
    return {**common, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "rope_theta": 500000.0,
            "max_position_embeddings": 16384,
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}


FAMILY = Family("llama", "LlamaForCausalLM", "llama", dense_spec, tiny,
                examples="Llama 3.x, OctoThinker, SmolLM2 (llama3 rope scaling or none)")
