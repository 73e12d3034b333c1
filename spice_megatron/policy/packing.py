"""Shared-prefix packed micro-batches: each group's prompt runs once, its completions after it.

A SPICE group is G sequences with one prompt (the challenger's G tasks of a document, the
reasoner's G answers to a question). A micro-batch here is one row of tokens laid end to end, no
padding between them: for each *unit* its prompt (the prefix), then each completion without its
last token (no position predicts from it; the engine never ran it either). Position ids restart
at 0 for each prefix and a completion's continue from its prefix, so rotary embeddings are those
of the unshared sequence. Attention (policy/shared_prefix.py): a prefix token sees the prefix
causally, a completion token its whole prefix and its own completion causally, nothing else.

Logits are computed only where a token is scored: the prefix's last position (once per
completion: it predicts each completion's first token) and every completion position. The
micro-batch's per-token tensors (loss mask, engine and old log-probs) are completion-aligned,
[sequences, longest completion], which is what the loss takes.

The row's attention structure travels as an int tensor [3, S] passed as megatron's
`attention_mask` (it reaches every core attention, through recompute too, which saves tensor
arguments only): for each position, the first and end position of its prefix and the first
position of its own segment (a prefix is its own segment).
"""
from __future__ import annotations

import torch

from spice_megatron.policy.batching import MicroBatch, TrainSequence, completion_aligned


def prefix_groups(seqs: list[TrainSequence], indices: list[int]) -> list[list[int]]:
    """`indices` grouped by identical prompt, in order of first appearance."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i in indices:
        groups.setdefault(tuple(seqs[i].prompt_ids), []).append(i)
    return list(groups.values())


def minibatch_split(seqs: list[TrainSequence], k: int) -> list[list[int]]:
    """The k mini-batches of a batch's optimiser steps: whole prompt groups, dealt in order to the
    mini-batch with the fewest sequences (round-robin for equal groups), so that every step sees
    groups of every kind and a group's prompt runs once in its step (verl's mini-batches are
    likewise prompts with all their responses). With fewer groups than steps: seqs[j::k]."""
    if k == 1:
        return [list(range(len(seqs)))]
    groups = prefix_groups(seqs, list(range(len(seqs))))
    if len(groups) < k:
        return [list(range(j, len(seqs), k)) for j in range(k)]
    parts: list[list[int]] = [[] for _ in range(k)]
    for group in groups:
        min(parts, key=len).extend(group)
    return [sorted(part) for part in parts]


def packed_length(seqs: list[TrainSequence], unit: list[int]) -> int:
    """Tokens one unit puts in a row: its prompt once, each completion but its last token."""
    return len(seqs[unit[0]].prompt_ids) + sum(len(seqs[i].completion_ids) - 1 for i in unit)


def split_units_data_parallel(seqs: list[TrainSequence], dp: int) -> list[list[int]]:
    """Sequence indices per data-parallel rank with each prompt's group kept on one rank (its
    prefix runs once), balancing packed tokens: largest group first, to the lightest rank."""
    units = prefix_groups(seqs, list(range(len(seqs))))
    buckets: list[list[int]] = [[] for _ in range(dp)]
    load = [0] * dp
    for unit in sorted(units, key=lambda u: (-packed_length(seqs, u), u[0])):
        r = min(range(dp), key=lambda r: (load[r], r))
        buckets[r].extend(unit)
        load[r] += packed_length(seqs, unit)
    return buckets


def plan_packed(seqs: list[TrainSequence], indices: list[int], token_budget: int) -> list[list[list[int]]]:
    """Micro-batches of units (first fit, largest unit first) whose rows hold at most
    `token_budget` tokens. A group too long for one row is split into several units, each with the
    prompt again and as many completions as fit (at least one)."""
    units: list[list[int]] = []
    for group in prefix_groups(seqs, indices):
        part: list[int] = []
        for i in group:
            if part and packed_length(seqs, part + [i]) > token_budget:
                units.append(part)
                part = []
            part.append(i)
        units.append(part)
    rows: list[list[list[int]]] = []
    room: list[int] = []
    for unit in sorted(units, key=lambda u: (-packed_length(seqs, u), u[0])):
        n = packed_length(seqs, unit)
        fit = next((r for r in range(len(rows)) if room[r] >= n), None)
        if fit is None:
            rows.append([])
            room.append(token_budget)
            fit = len(rows) - 1
        rows[fit].append(unit)
        room[fit] -= n
    return rows


def collate_packed(seqs: list[TrainSequence], units: list[list[int]], pad_id: int = 0,
                   old: dict[int, list[float]] | None = None, pad_to: int = 1, num_experts: int = 0) -> MicroBatch:
    """One packed row of `units` (lists of indices into `seqs` sharing a prompt); `old`: the old
    log-probs by sequence index. `pad_to`: the row's length is a multiple of it (sequence
    parallelism), padded at the end with tokens that attend to the pads only (one segment)."""
    tokens: list[int] = []
    positions: list[int] = []
    structure: list[tuple[int, int, int]] = []  # per position: prefix start, prefix end, own segment start
    scored: list[int] = []  # the position whose logits predict each scored token, in completion order
    labels: list[int] = []
    members = [i for unit in units for i in unit]
    routing_rows: list[tuple[int, int, int, int]] = []  # (row start, sequence, first token, tokens)
    for unit in units:
        prompt = seqs[unit[0]].prompt_ids
        if not prompt:
            raise ValueError(f"sequence {unit[0]}: an empty prompt (a completion needs a position to start from)")
        start, p = len(tokens), len(prompt)
        tokens += prompt
        positions += range(p)
        structure += [(start, start + p, start)] * p
        routing_rows.append((start, unit[0], 0, p))
        for i in unit:
            completion = seqs[i].completion_ids
            if not completion:
                raise ValueError(f"sequence {i}: an empty completion has nothing to train")
            own = len(tokens)
            body = completion[:-1]
            tokens += body
            positions += range(p, p + len(body))
            structure += [(start, start + p, own)] * len(body)
            scored += [start + p - 1] + list(range(own, own + len(body)))
            labels += completion
            routing_rows.append((own, i, p, len(body)))
    real = len(tokens)
    total = -(-real // pad_to) * pad_to
    for t in range(real, total):  # the pads: one segment, causal over itself (never scored, never attended)
        tokens.append(pad_id)
        positions.append(0)
        structure.append((real, total, real))
    b = len(members)
    width = max(len(seqs[i].completion_ids) for i in members)
    mask = torch.zeros((b, width), dtype=torch.float32)
    rollout = torch.zeros((b, width), dtype=torch.float32)
    old_t = torch.zeros((b, width), dtype=torch.float32) if old is not None else None
    rows, cols = [], []
    for row, i in enumerate(members):
        x = seqs[i]
        c = len(x.completion_ids)
        mask[row, :c] = 1.0
        rows += [row] * c
        cols += range(c)
        if x.rollout_logprobs is not None:
            rollout[row, :c] = completion_aligned(x.rollout_logprobs, x, "rollout log-probs", i)
        if old is not None:
            old_t[row, :c] = completion_aligned(old[i], x, "old log-probs", i)
    routing = valid = None
    if any(seqs[i].routed_experts is not None for i in members):
        routing, valid = _packed_routing(seqs, routing_rows, total, num_experts)
    return MicroBatch(
        tokens=torch.tensor([tokens]), position_ids=torch.tensor([positions]),
        labels=torch.tensor([labels]), loss_mask=mask,
        advantages=torch.tensor([seqs[i].advantage for i in members], dtype=torch.float32),
        rollout_logprobs=rollout, old_logprobs=old_t,
        has_rollout=torch.tensor([seqs[i].rollout_logprobs is not None for i in members]),
        index=members, roles=[seqs[i].role for i in members], routing=routing, routing_valid=valid,
        token_mask=(torch.arange(total) < real).unsqueeze(0),
        attention_mask=torch.tensor(structure, dtype=torch.int32).T.contiguous(),
        score_index=torch.tensor(scored), score_rows=torch.tensor(rows), score_cols=torch.tensor(cols))


def _packed_routing(seqs: list[TrainSequence], rows: list[tuple[int, int, int, int]], length: int,
                    num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's routing laid out like the row: a prefix's taken once (from its first
    sequence), each completion's own; filler routing where the engine gave none."""
    from spice_megatron.policy.routing_replay import routing_tensor

    first = next(seqs[i].routed_experts for _, i, _, _ in rows if seqs[i].routed_experts is not None)
    _, layers, top_k = torch.as_tensor(first).shape
    routing, valid = routing_tensor([TrainSequence([], [])], length, layers, top_k, num_experts)
    for start, i, first_token, n in rows:
        r = seqs[i].routed_experts
        if r is None or n == 0:
            continue
        part = torch.as_tensor(r)[first_token:first_token + n].to(torch.int16)
        routing[0, start:start + part.shape[0]] = part
        valid[0, start:start + part.shape[0]] = True
    return routing, valid


def packed_microbatches(seqs: list[TrainSequence], dp: int, dp_rank: int, token_budget: int, pad_id: int = 0,
                        old: list[list[float]] | None = None, pad_to: int = 1, equal_counts: bool = False,
                        num_experts: int = 0, count_multiple: int = 1) -> list[MicroBatch]:
    """This data-parallel rank's packed micro-batches of a global batch (every rank computes the
    same plan); masked fillers as batching.make_microbatches adds them."""
    split = split_units_data_parallel(seqs, dp)
    plans = [plan_packed(seqs, mine, token_budget) for mine in split]
    old_by_index = dict(enumerate(old)) if old is not None else None
    mbs = [collate_packed(seqs, units, pad_id, old_by_index, pad_to, num_experts) for units in plans[dp_rank]]
    count = max(max(len(p) for p in plans), 1) if equal_counts else max(len(plans[dp_rank]), 1)
    count = -(-count // count_multiple) * count_multiple
    return mbs + [packed_filler(pad_id, old, pad_to) for _ in range(count - len(mbs))]


def packed_filler(pad_id: int, old: list[list[float]] | None, pad_to: int) -> MicroBatch:
    """A masked-out packed micro-batch: the schedule steps, nothing is learned or counted."""
    filler = [TrainSequence([pad_id], [pad_id], 0.0)]
    mb = collate_packed(filler, [[0]], pad_id, {0: [0.0]} if old is not None else None, pad_to)
    mb.index = [-1]
    mb.roles = [""]
    mb.loss_mask.zero_()
    mb.token_mask.zero_()
    return mb
