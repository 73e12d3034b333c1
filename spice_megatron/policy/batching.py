"""Training sequences and their micro-batches, unshared: one padded row per sequence.

This is the learner's layout with train.shared_prefix off (policy/packing.py packs each group's
prompt once). Sorting by length and filling each micro-batch up to a token budget (longest
sequence x count) keeps padding small for RL batches, whose G answers to one question have
similar lengths.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class TrainSequence:
    prompt_ids: list[int]
    completion_ids: list[int]
    advantage: float = 0.0
    rollout_logprobs: list[float] | None = None  # the engine's log-probs of completion_ids
    role: str = ""  # challenger | reasoner, for per-role metrics
    # [[weights version, first token, end)] of the policy that sampled completion_ids (vLLM's spans)
    versions: list[list[int]] | None = None
    # mixture-of-experts: the engine's expert indices [tokens, MoE layers, top-k] of prompt and
    # completion (all but the last sampled token, which the engine never ran); routing replay
    routed_experts: Any = None

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)

    def key(self) -> tuple:
        """What identifies the sequence's log-probs under given weights: its prompt and completion ids."""
        return tuple(self.prompt_ids), tuple(self.completion_ids)


@dataclass
class MicroBatch:
    """Right-padded tensors; position t predicts tokens[t + 1]."""

    tokens: torch.Tensor  # [b, s]
    position_ids: torch.Tensor  # [b, s]
    labels: torch.Tensor  # [b, s] next tokens (0 on padding)
    loss_mask: torch.Tensor  # [b, s] 1 where labels[t] is a completion token
    advantages: torch.Tensor  # [b]
    rollout_logprobs: torch.Tensor  # [b, s] the engine's, aligned with loss_mask (0 elsewhere)
    old_logprobs: torch.Tensor | None  # [b, s] the PPO ratio's denominator; None: on-policy
    has_rollout: torch.Tensor  # [b] bool: rollout_logprobs were given
    index: list[int]  # positions of these sequences in the caller's list (-1: filler)
    roles: list[str]  # each row's role ("" for a filler)
    routing: torch.Tensor | None = None  # [b, s, decoder layers, k] the engine's experts (routing_replay.py)
    routing_valid: torch.Tensor | None = None  # [b, s] bool: routing given by the engine
    token_mask: torch.Tensor | None = None  # [b, s] bool: a real token, not padding
    # shared-prefix packing (policy/packing.py): one row [1, S]; labels are then [1, n], the tokens
    # scored at positions score_index, and the loss tensors completion-aligned [b, longest completion]
    attention_mask: torch.Tensor | None = None  # [3, S] int: the row's attention structure
    score_index: torch.Tensor | None = None  # [n] the positions whose logits are computed
    score_rows: torch.Tensor | None = None  # [n] each scored token's sequence (row of loss_mask)
    score_cols: torch.Tensor | None = None  # [n] and its place in that completion


def completion_aligned(values: list[float], x: TrainSequence, what: str, where: int) -> torch.Tensor:
    if len(values) != len(x.completion_ids):
        raise ValueError(f"sequence {where}: {len(values)} {what} for {len(x.completion_ids)} completion tokens")
    return torch.tensor(values, dtype=torch.float32)


def collate(seqs: list[TrainSequence], index: list[int], pad_id: int = 0,
            old: list[list[float]] | None = None, pad_to: int = 1, num_experts: int = 0) -> MicroBatch:
    """`pad_to`: the padded length is a multiple of it (sequence parallelism splits the sequence
    over the TP ranks). `num_experts`: a mixture-of-experts model's, for the filler routing of
    positions the engine did not route."""
    s = -(-max(len(x) for x in seqs) // pad_to) * pad_to
    b = len(seqs)
    tokens = torch.full((b, s), pad_id, dtype=torch.long)
    labels = torch.zeros((b, s), dtype=torch.long)
    mask = torch.zeros((b, s), dtype=torch.float32)
    rollout = torch.zeros((b, s), dtype=torch.float32)
    old_t = torch.zeros((b, s), dtype=torch.float32) if old is not None else None
    for i, x in enumerate(seqs):
        ids = x.prompt_ids + x.completion_ids
        n, p = len(ids), len(x.prompt_ids)
        tokens[i, :n] = torch.tensor(ids)
        labels[i, :n - 1] = torch.tensor(ids[1:])
        c = len(x.completion_ids)
        mask[i, p - 1:p - 1 + c] = 1.0
        if x.rollout_logprobs is not None:
            rollout[i, p - 1:p - 1 + c] = completion_aligned(x.rollout_logprobs, x, "rollout log-probs", index[i])
        if old is not None:
            old_t[i, p - 1:p - 1 + c] = completion_aligned(old[i], x, "old log-probs", index[i])
    positions = torch.arange(s).unsqueeze(0).expand(b, s).contiguous()
    adv = torch.tensor([x.advantage for x in seqs], dtype=torch.float32)
    has_rollout = torch.tensor([x.rollout_logprobs is not None for x in seqs])
    routed = next((x.routed_experts for x in seqs if x.routed_experts is not None), None)
    routing = valid = None
    if routed is not None:
        from spice_megatron.policy.routing_replay import routing_tensor

        _, layers, top_k = torch.as_tensor(routed).shape
        routing, valid = routing_tensor(seqs, s, layers, top_k, num_experts)
    real = torch.arange(s).unsqueeze(0) < torch.tensor([len(x) for x in seqs]).unsqueeze(1)
    return MicroBatch(tokens, positions, labels, mask, adv, rollout, old_t, has_rollout, index, [x.role for x in seqs],
                      routing, valid, real)


def split_data_parallel(lengths: list[int], dp: int) -> list[list[int]]:
    """Sequence indices per data-parallel rank, balancing tokens (longest first, to the lightest rank)."""
    buckets: list[list[int]] = [[] for _ in range(dp)]
    load = [0] * dp
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(dp), key=lambda r: (load[r], r))
        buckets[r].append(i)
        load[r] += lengths[i]
    return buckets


def plan_microbatches(indices: list[int], lengths: list[int], token_budget: int) -> list[list[int]]:
    """Group sequences (longest first) so that longest x count stays within the token budget."""
    order = sorted(indices, key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    for i in order:
        if groups and lengths[groups[-1][0]] * (len(groups[-1]) + 1) <= token_budget:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _filler(pad_id: int, old: list[list[float]] | None, pad_to: int) -> MicroBatch:
    """A masked-out micro-batch of one two-token sequence: the schedule steps, nothing is learned."""
    mb = collate([TrainSequence([pad_id], [pad_id], 0.0)], [-1], pad_id, [[0.0]] if old is not None else None, pad_to)
    mb.loss_mask.zero_()
    mb.token_mask.zero_()  # nor is it load on any expert
    return mb


def make_microbatches(seqs: list[TrainSequence], dp: int, dp_rank: int, token_budget: int,
                      pad_id: int = 0, old: list[list[float]] | None = None, pad_to: int = 1,
                      equal_counts: bool = False, num_experts: int = 0, count_multiple: int = 1) -> list[MicroBatch]:
    """This data-parallel rank's micro-batches of a global batch. Every rank of a pipeline computes
    the same plan. A rank left without sequences gets one masked-out filler so that its pipeline
    still steps (its loss and gradient contributions are zero). `equal_counts`: every DP rank runs
    as many micro-batches as the one with the most (masked fillers at the end): an expert-parallel
    group spans DP replicas, and each MoE layer's all-to-all needs all of them in every forward.
    `count_multiple`: the count rounded up to a multiple of it (virtual pipeline stages: of PP)."""
    lengths = [len(x) for x in seqs]
    split = split_data_parallel(lengths, dp)
    plans = [plan_microbatches(mine, lengths, token_budget) for mine in split]
    mbs = [collate([seqs[i] for i in g], g, pad_id, [old[i] for i in g] if old is not None else None, pad_to,
                   num_experts) for g in plans[dp_rank]]
    count = max(max(len(p) for p in plans), 1) if equal_counts else max(len(plans[dp_rank]), 1)
    count = -(-count // count_multiple) * count_multiple
    return mbs + [_filler(pad_id, old, pad_to) for _ in range(count - len(mbs))]
