"""Reading Hugging Face safetensors checkpoints slice by slice, and loading them into a
megatron model of any TP x PP layout (each rank reads only its own slices)."""
from __future__ import annotations

import json
import logging
import os
from typing import TYPE_CHECKING, Mapping

import torch

from spice_megatron.bridge.mapping import MappingError, ShardRanks, expected_hf_shapes, hf_tensors, megatron_shard
from spice_megatron.config import OptimConfig, ParallelConfig, PolicyTrainConfig
from spice_megatron.entry import UserError
from spice_megatron.families import ModelSpec, model_spec_from_hf
from spice_megatron.policy.model import layer_offset

if TYPE_CHECKING:
    from spice_megatron.policy.learner import Learner

log = logging.getLogger(__name__)


class CheckpointError(UserError, RuntimeError):
    pass


def resolve_model_dir(model: str) -> str:
    """A local HF directory as is; a hub id is downloaded (config, tokenizer, safetensors) into the
    HF cache, or found there when HF_HUB_OFFLINE=1. Clusters usually pass a directory."""
    if os.path.isdir(model):
        return model
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken"])
    except Exception as e:  # noqa: BLE001 - offline, unknown id, no access: all end the same way
        raise CheckpointError(f"run.model={model!r} is not a local directory and could not be fetched from the hub "
                              f"({type(e).__name__}: {e}); pass --model /path/to/hf_dir") from e


class HFCheckpointReader:
    """Tensors of an HF model directory (model.safetensors, or shards + model.safetensors.index.json)."""

    def __init__(self, model_dir: str):
        from safetensors import safe_open

        self.model_dir = model_dir
        index = os.path.join(model_dir, "model.safetensors.index.json")
        single = os.path.join(model_dir, "model.safetensors")
        if os.path.exists(index):
            with open(index) as f:
                self.weight_map: dict[str, str] = json.load(f)["weight_map"]
        elif os.path.exists(single):
            self.weight_map = {}
            with safe_open(single, "pt") as f:
                self.weight_map = {k: "model.safetensors" for k in f.keys()}
        else:
            raise CheckpointError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")
        self._files: dict[str, object] = {}
        self._safe_open = safe_open
        self._scales: dict[str, torch.Tensor] = {}  # FP8 checkpoints: each weight's block scales, read once
        config = os.path.join(model_dir, "config.json")
        self.fp8_block = None
        if os.path.exists(config):
            from spice_megatron.families import fp8_block_size

            with open(config) as f:
                self.fp8_block = fp8_block_size(json.load(f))

    def _file(self, fname: str):
        if fname not in self._files:
            path = os.path.join(self.model_dir, fname)
            if not os.path.exists(path):
                raise CheckpointError(f"{path}: shard listed in the index is missing")
            self._files[fname] = self._safe_open(path, "pt")
        return self._files[fname]

    def names(self) -> list[str]:
        return sorted(self.weight_map)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._file(self.weight_map[name]).get_slice(name).get_shape())

    def read(self, name: str, dim: int | None, start: int | None, stop: int | None) -> torch.Tensor:
        if name not in self.weight_map:
            raise MappingError(f"tensor {name!r} is missing from {self.model_dir}")
        sl = self._file(self.weight_map[name]).get_slice(name)
        if dim is None:
            out, first = sl[:], (0, 0)
        else:
            shape = sl.get_shape()
            if stop > shape[dim]:
                raise CheckpointError(f"tensor {name!r}: shape {shape} is too small for rows/cols [{start}:{stop}] "
                                      f"on dim {dim}")
            out, first = (sl[start:stop], (start, 0)) if dim == 0 else (sl[:, start:stop], (0, start))
        if out.dtype == torch.float8_e4m3fn:
            return self._dequantize(name, out, first)
        return out

    def _dequantize(self, name: str, w: torch.Tensor, first: tuple[int, int]) -> torch.Tensor:
        """An FP8 slice times its blocks' scales (the slice starts at row/column `first`), in bf16."""
        scale_name = name + "_scale_inv"
        if self.fp8_block is None or scale_name not in self.weight_map:
            raise CheckpointError(f"tensor {name!r} is float8_e4m3fn but {scale_name!r} is missing or config.json "
                                  "has no fp8 quantization_config")
        if scale_name not in self._scales:
            self._scales[scale_name] = self._file(self.weight_map[scale_name]).get_slice(scale_name)[:].float()
        scale = self._scales[scale_name]
        rows = torch.arange(first[0], first[0] + w.shape[0]) // self.fp8_block[0]
        cols = torch.arange(first[1], first[1] + w.shape[1]) // self.fp8_block[1]
        return (w.float() * scale[rows][:, cols]).to(torch.bfloat16)


class StateDictReader:
    """The same interface over an in-memory HF state dict."""

    def __init__(self, state_dict: Mapping[str, torch.Tensor]):
        self.sd = state_dict

    def names(self) -> list[str]:
        return sorted(self.sd)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.sd[name].shape)

    def read(self, name: str, dim: int | None, start: int | None, stop: int | None) -> torch.Tensor:
        if name not in self.sd:
            raise MappingError(f"tensor {name!r} is missing from the state dict")
        t = self.sd[name]
        return t if dim is None else t.narrow(dim, start, stop - start)


@torch.no_grad()
def load_hf_weights(model, spec: ModelSpec, reader, layout) -> int:
    """Copy HF weights into this rank's megatron model; returns the number of tensors loaded."""
    present = set(reader.names())
    for name, shape in expected_hf_shapes(spec).items():
        if name not in present:
            raise MappingError(f"tensor {name!r} is missing from the checkpoint")
        if reader.shape(name) != shape:
            raise CheckpointError(f"tensor {name!r}: shape {reader.shape(name)}, config.json implies {shape}")
    beyond = sorted({n.split(".")[2] for n in present if n.startswith("model.layers.")
                     and int(n.split(".")[2]) >= spec.num_layers})
    if beyond:  # DeepSeek-V3's multi-token-prediction layers: not trained, not exported
        log.info("skipping the tensors of layers %s (index >= num_hidden_layers=%d: multi-token prediction)",
                 ", ".join(beyond), spec.num_layers)
    offset, ranks = layer_offset(model), ShardRanks.of(layout)
    loaded = 0
    for name, param in hf_tensors(model):
        src = megatron_shard(name, spec, ranks, offset, reader.read)
        if tuple(src.shape) != tuple(param.shape):
            raise CheckpointError(f"megatron parameter {name!r}: HF tensors give shape {tuple(src.shape)}, "
                                  f"the model expects {tuple(param.shape)} (config.json does not match the weights?)")
        if not src.is_floating_point():
            raise CheckpointError(f"megatron parameter {name!r}: HF tensor has dtype {src.dtype}, expected floating "
                                  "point")
        param.copy_(src.to(param.dtype))
        loaded += 1
    return loaded


def learner_from_hf(hf_dir: str, parallel: ParallelConfig, optim: OptimConfig, train: PolicyTrainConfig,
                    pad_id: int = 0) -> Learner:
    """Build the learner and load an HF checkpoint, each rank reading only its slices."""
    from spice_megatron.policy.learner import Learner

    reader = HFCheckpointReader(hf_dir)
    # With tied embeddings and PP > 1 the last stage's output layer is loaded from the same HF
    # embedding tensor, so both copies start equal; megatron then reduces their grads together.
    return Learner(model_spec_from_hf(hf_dir), parallel, optim, train, pad_id,
                   load_weights=lambda lr: [load_hf_weights(c, lr.spec, reader, lr.layout) for c in lr.chunks])
