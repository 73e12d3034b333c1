"""Megatron learner -> Hugging Face tensors."""
from __future__ import annotations

import re
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from spice_megatron.bridge.mapping import LAYER, full_shape, gather_layout, hf_outputs, place_shard, shard_destination


def global_param_name(name: str, offset: int) -> str:
    """A parameter's name with the global layer number: each pipeline stage numbers its layers
    from 0, and its first layer is layer `offset` of the model (hf_io.layer_offset)."""
    m = LAYER.match(name)
    return f"decoder.layers.{int(m.group(1)) + offset}.{m.group(2)}" if m else name


# allocate([(hf_name, shape, dtype), ...]) -> the tensors one parameter's HF outputs are written into
Allocate = Callable[[list[tuple[str, tuple[int, ...], torch.dtype]]], list[torch.Tensor]]


def stage_hf_outputs(learner) -> Iterator[tuple[str, torch.Tensor, list[tuple[str, tuple[int, ...]]]]]:
    """Each of this stage's parameters with the HF tensors (name, full shape) it becomes; no
    communication (shapes are the TP-gathered ones)."""
    from spice_megatron.bridge.hf_io import layer_offset

    offset, tp = layer_offset(learner.model), learner.layout.tp
    for name, param in learner.model.named_parameters():
        yield name, param, hf_outputs(global_param_name(name, offset), full_shape(name, tuple(param.shape), tp),
                                      learner.spec)


def gather_stage_tensors(learner, allocate: Allocate | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) for this pipeline stage's parameters, one parameter at a time.

    Collective over the TP group: the other TP ranks send their shards to the stage's TP rank 0,
    which writes every shard straight into its place in the HF tensors (memory from `allocate`,
    e.g. a slot in a send bucket; fresh tensors by default) and yields them. Only TP rank 0
    yields anything. With tied embeddings, the last stage's copy of the embedding is skipped
    (the first stage exports it).
    """
    from megatron.core import parallel_state as ps

    tp, tp_rank, group = learner.layout.tp, learner.layout.tp_rank, ps.get_tensor_model_parallel_group()
    root = dist.get_global_rank(group, 0) if tp > 1 else dist.get_rank()
    device = next(learner.model.parameters()).device
    allocate = allocate or (lambda specs: [torch.empty(shape, dtype=dtype, device=device) for _, shape, dtype in specs])
    spare = torch.empty(0)  # receive buffer for shards that cannot land in place, reused
    for name, param, outputs in stage_hf_outputs(learner):
        local = param.detach()
        if not outputs:
            continue
        sharded = tp > 1 and gather_layout(name)[0] is not None
        if tp_rank != 0:
            if sharded:
                dist.send(local.contiguous(), dst=root, group=group)
            continue
        full = allocate([(hf_name, shape, local.dtype) for hf_name, shape in outputs])
        pending = []
        if sharded:  # post every receive first, so that all TP ranks send at once
            if spare.numel() < (tp - 1) * local.numel() or spare.dtype != local.dtype:
                spare = torch.empty((tp - 1) * local.numel(), dtype=local.dtype, device=local.device)
            for r in range(1, tp):
                into = shard_destination(name, full, r, tp)
                if into is None:
                    into = spare[(r - 1) * local.numel():r * local.numel()].view(local.shape)
                pending.append((r, into, dist.irecv(into, src=dist.get_global_rank(group, r), group=group)))
        place_shard(name, local, 0, tp, learner.spec, full)
        for r, into, work in pending:
            work.wait()
            place_shard(name, into, r, tp, learner.spec, full)
        yield from zip((hf_name for hf_name, _ in outputs), full)


def gathered_hf_state_dict(learner) -> dict[str, torch.Tensor] | None:
    """The whole model as an HF state dict on global rank 0 (None elsewhere). Collective.

    Holds the full model on rank 0: meant for small models and tests; large models stream
    bucket by bucket instead."""
    mine = {k: v.cpu() for k, v in gather_stage_tensors(learner)}
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
