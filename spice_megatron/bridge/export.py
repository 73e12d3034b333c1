"""Megatron learner -> Hugging Face tensors."""
from __future__ import annotations

import re
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from spice_megatron.bridge.mapping import (
    LAYER,
    full_shape,
    gather_layout,
    hf_outputs,
    hf_tensors,
    is_expert,
    place_shard,
    renumber_expert,
    shard_destination,
)


def global_param_name(name: str, offset: int) -> str:
    """A parameter's name with the global layer number: each pipeline stage numbers its layers
    from 0, and its first layer is layer `offset` of the model (hf_io.layer_offset)."""
    m = LAYER.match(name)
    return f"decoder.layers.{int(m.group(1)) + offset}.{m.group(2)}" if m else name


# allocate([(hf_name, shape, dtype), ...]) -> the tensors one parameter's HF outputs are written into
Allocate = Callable[[list[tuple[str, tuple[int, ...], torch.dtype]]], list[torch.Tensor]]


def stage_hf_outputs(learner) -> Iterator[tuple[str, torch.Tensor, list[tuple[str, tuple[int, ...]]]]]:
    """Each of this stage's parameters with the HF tensors (name, full shape) it becomes; no
    communication (shapes are the TP-gathered ones). An expert parameter stands for itself on
    every expert-parallel rank: its outputs are those of local expert i of EP rank 0, 1, ...
    (global experts i, i + E/EP, ...), each gathered over the expert-tensor-parallel ranks."""
    from spice_megatron.policy.model import layer_offset

    lay, spec = learner.layout, learner.spec
    per_rank = spec.moe.num_experts // lay.ep if spec.moe is not None else 0
    # model chunks (virtual pipeline stages) each number their layers from their own first one
    for name, param, offset in ((n, p, layer_offset(chunk)) for chunk in learner.chunks for n, p in hf_tensors(chunk)):
        global_name = global_param_name(name, offset)
        if is_expert(name):
            shape = full_shape(name, tuple(param.shape), lay.etp)
            outputs = [o for r in range(lay.ep)
                       for o in hf_outputs(renumber_expert(global_name, r * per_rank), shape, spec)]
        else:
            outputs = hf_outputs(global_name, full_shape(name, tuple(param.shape), lay.tp), spec)
        yield name, param, outputs


def holds_unique_weights(layout, spec) -> bool:
    """Whether this rank holds shards that no data-parallel peer sends in its place: data-parallel
    rank 0 for the dense weights, expert-data-parallel rank 0 for the experts. Only such ranks
    take part in gather_stage_tensors."""
    return layout.first_replica or (spec.moe is not None and layout.edp_rank == 0)


def _expert_members(group) -> list[tuple[int, int]]:
    """(EP rank, ETP rank) of each member of the expert tensor x model parallel group, by group rank."""
    from megatron.core import parallel_state as ps

    members: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(members, (ps.get_expert_model_parallel_rank(), ps.get_expert_tensor_parallel_rank()),
                           group=group)
    return members


def gather_stage_tensors(learner, allocate: Allocate | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) for this pipeline stage's parameters, one parameter at a time.
    See gather_stage_params."""
    for _, outputs, full in gather_stage_params(learner, allocate):
        if full is not None:
            yield from zip((hf_name for hf_name, _ in outputs), full)


def gather_stage_params(learner, allocate: Allocate | None = None
                        ) -> Iterator[tuple[str, list[tuple[str, tuple[int, ...]]], list[torch.Tensor] | None]]:
    """Per parameter of this stage with HF outputs: (name, outputs, the full HF tensors on the
    stage's sender, None on every other rank). Every rank of the stage yields once per such
    parameter, so that its callers can act in lockstep after each one (bridge/trainer_transfer.py).

    Collective: dense parameters over the TP group of data-parallel rank 0, expert parameters over
    the expert tensor x model parallel group of expert-data-parallel rank 0; the other members
    send their shards to the group's rank 0, the stage's sender (TP rank 0 of DP rank 0, which
    megatron's rank order makes rank 0 of its expert group too), which writes every shard
    straight into its place in the HF tensors (memory from `allocate`, e.g. a slot in a send
    bucket; fresh tensors by default). Only the sender gets tensors. Ranks
    holding only replicas return at once. With tied embeddings, the last stage's copy of the
    embedding is skipped (the first stage exports it).
    """
    from megatron.core import parallel_state as ps

    lay, spec = learner.layout, learner.spec
    tp_group = ps.get_tensor_model_parallel_group()
    expert_group, members = None, []
    if spec.moe is not None and lay.edp_rank == 0:
        expert_group = ps.get_expert_tensor_and_model_parallel_group()
        members = _expert_members(expert_group)
        if lay.tp_rank == 0 and lay.first_replica and dist.get_rank(expert_group) != 0:
            raise RuntimeError("the stage's sender (TP rank 0 of DP rank 0) is not rank 0 of its expert group: "
                               "a rank order other than megatron's default tp-ep-dp-pp?")
    device = next(learner.model.parameters()).device
    allocate = allocate or (lambda specs: [torch.empty(shape, dtype=dtype, device=device) for _, shape, dtype in specs])
    spare = torch.empty(0)  # receive buffer for shards that cannot land in place, reused
    for name, param, outputs in stage_hf_outputs(learner):
        local = param.detach()
        if not outputs:
            continue
        if is_expert(name):
            if expert_group is None:
                yield name, outputs, None
                continue
            group, k = expert_group, len(outputs) // lay.ep
            # member g's shard: ETP slice etp_r of the outputs of its EP rank's expert
            pieces = [(slice(ep_r * k, (ep_r + 1) * k), etp_r, lay.etp) for ep_r, etp_r in members]
        else:
            if not lay.first_replica:
                yield name, outputs, None
                continue
            sharded = lay.tp > 1 and gather_layout(name)[0] is not None
            if lay.tp_rank != 0 and not sharded:  # a replica: the stage's TP rank 0 has the same
                yield name, outputs, None
                continue
            group = tp_group if sharded else None
            pieces = [(slice(None), r, lay.tp) for r in range(lay.tp if sharded else 1)]
        me = dist.get_rank(group) if group is not None else 0
        if me != 0:
            dist.send(local.contiguous(), dst=dist.get_global_rank(group, 0), group=group)
            yield name, outputs, None
            continue
        full = allocate([(hf_name, shape, local.dtype) for hf_name, shape in outputs])
        pending = []
        if len(pieces) > 1:  # post every receive first, so that all members send at once
            if spare.numel() < (len(pieces) - 1) * local.numel() or spare.dtype != local.dtype:
                spare = torch.empty((len(pieces) - 1) * local.numel(), dtype=local.dtype, device=local.device)
            for g, (part, r, n) in enumerate(pieces[1:], 1):
                into = shard_destination(name, full[part], r, n)
                if into is None:
                    into = spare[(g - 1) * local.numel():g * local.numel()].view(local.shape)
                pending.append((part, r, n, into, dist.irecv(into, src=dist.get_global_rank(group, g), group=group)))
        part, r, n = pieces[0]
        place_shard(name, local, r, n, spec, full[part])
        for part, r, n, into, work in pending:
            work.wait()
            place_shard(name, into, r, n, spec, full[part])
        yield name, outputs, full


def gathered_hf_state_dict(learner) -> dict[str, torch.Tensor] | None:
    """The whole model as an HF state dict on global rank 0 (None elsewhere). Collective.

    Holds the full model on rank 0: meant for small models and tests; large models stream
    bucket by bucket instead."""
    mine = {k: v.cpu() for k, v in gather_stage_tensors(learner)}
    keep = mine if (learner.layout.tp_rank == 0 and learner.layout.first_replica) else {}
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
