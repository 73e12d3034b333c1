"""The model families the project trains, one module each (`llama.py`, `qwen2.py`, `qwen3.py`,
`qwen3_moe.py`, `glm4_moe.py`, `deepseek_v3.py`): each declares its `Family` (the HF architecture
it reads, its config.json parse, a tiny config for tests) and is registered here by its architecture. Everything else
reads a model through `ModelSpec`'s features (experts, latent attention, q/k norms, biases), never
by a family's name; docs/checkpoints.md says how to add one.

Layer 0, shared: imports `entry.py` only."""
from __future__ import annotations

import os

from spice_megatron.entry import read_json
from spice_megatron.families import deepseek_v3, glm4_moe, llama, qwen2, qwen3, qwen3_moe
from spice_megatron.families.spec import (
    Family,
    MLASpec,
    ModelSpec,
    MoESpec,
    UnsupportedModelError,
    YarnSpec,
    fp8_block_size,
)

__all__ = ["FAMILIES", "Family", "MLASpec", "ModelSpec", "MoESpec", "UnsupportedModelError", "YarnSpec",
           "family_named", "fp8_block_size", "model_spec_from_hf", "register"]

# HF architecture name -> family, in the order the modules register (docs/checkpoints.md's table)
FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    if family.architecture in FAMILIES:
        raise ValueError(f"{family.architecture} is registered twice")
    FAMILIES[family.architecture] = family
    return family


def family_named(name: str) -> Family:
    for family in FAMILIES.values():
        if family.name == name:
            return family
    raise ValueError(f"family: unknown {name!r} ({', '.join(f.name for f in FAMILIES.values())})")


def model_spec_from_hf(config: dict | str) -> ModelSpec:
    """From a config dict, a config.json path or an HF model directory."""
    where = "config"
    if isinstance(config, str):
        where = os.path.join(config, "config.json") if os.path.isdir(config) else config
        config = read_json(where, " (an HF model directory has a config.json)")
    try:
        return _spec(config)
    except KeyError as e:
        arch = (config.get("architectures") or [config.get("model_type")])[0]
        raise UnsupportedModelError(f"{where}: field {e.args[0]!r} is missing ({arch} needs it)") from None
    except UnsupportedModelError as e:
        if where == "config":
            raise
        raise UnsupportedModelError(f"{where}: {e}") from None
    except (TypeError, ValueError) as e:
        raise UnsupportedModelError(f"{where}: a field has the wrong type ({e})") from None


def _spec(config: dict) -> ModelSpec:
    by_type = {f.model_type: f.architecture for f in FAMILIES.values()}
    arch = (config.get("architectures") or [by_type.get(config.get("model_type", ""), "")])[0]
    if arch not in FAMILIES:
        raise UnsupportedModelError(f"architecture {arch or config.get('model_type')!r} is not supported; "
                                    f"supported: {', '.join(sorted(FAMILIES))}")
    fp8_block_size(config)  # refuses what the import cannot dequantize
    family = FAMILIES[arch]
    return family.parse(config, family)


for _module in (qwen3, llama, qwen3_moe, glm4_moe, deepseek_v3, qwen2):  # the order of docs/checkpoints.md's table
    register(_module.FAMILY)


