"""Megatron learner -> Hugging Face tensors."""
from __future__ import annotations

import re
from typing import Iterator

import torch
import torch.distributed as dist

from spice_megatron.bridge.mapping import LAYER, gather_layout, join_shards, to_hf


def _global_name(name: str, offset: int) -> str:
    m = LAYER.match(name)
    return f"decoder.layers.{int(m.group(1)) + offset}.{m.group(2)}" if m else name


def gather_stage_tensors(learner) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) for this pipeline stage's parameters, gathered across TP.

    Collective over the TP group; every TP rank yields the same tensors, one parameter at a time.
    With tied embeddings, the last stage's copy of the embedding is skipped (the first stage
    exports it).
    """
    from megatron.core import parallel_state as ps

    from spice_megatron.bridge.hf_io import layer_offset

    offset = layer_offset(learner.model)
    tp, group = learner.layout.tp, ps.get_tensor_model_parallel_group()
    for name, param in learner.model.named_parameters():
        if name == "output_layer.weight" and learner.spec.tied_embeddings:
            continue
        local = param.detach()
        dim, glu = gather_layout(name)
        if tp > 1 and dim is not None:
            stacked = torch.empty((tp * local.shape[0], *local.shape[1:]), dtype=local.dtype, device=local.device)
            dist.all_gather_into_tensor(stacked, local.contiguous(), group=group)
            # dim-0 shards back to back are the full tensor already; the others need one reorder
            full = stacked if dim == 0 and not glu else join_shards(name, list(stacked.view(tp, *local.shape)))
        else:
            full = local
        yield from to_hf(_global_name(name, offset), full, learner.spec)


def gathered_hf_state_dict(learner) -> dict[str, torch.Tensor] | None:
    """The whole model as an HF state dict on global rank 0 (None elsewhere). Collective.

    Holds the full model on rank 0: meant for small models and tests; large models stream
    bucket by bucket instead."""
    mine = {k: v.cpu().clone() for k, v in gather_stage_tensors(learner)}
    keep = mine if (learner.layout.tp_rank == 0 and learner.layout.dp_rank == 0) else {}
    parts: list = [None] * learner.layout.world_size
    dist.all_gather_object(parts, keep)
    if dist.get_rank() != 0:
        return None
    out: dict[str, torch.Tensor] = {}
    for p in parts:
        out.update(p)
    return dict(sorted(out.items(), key=lambda kv: _hf_sort_key(kv[0])))


def _hf_sort_key(name: str) -> tuple:
    m = re.match(r"model\.layers\.(\d+)\.(.+)", name)
    return (1, int(m.group(1)), m.group(2)) if m else (0 if "embed" in name else 2, 0, name)
