"""DrGRPO: role-specific advantages and the token-level policy-gradient loss (SPICE.md, "Update").

Advantages are centred per role and never divided by a standard deviation; the loss sums
per-token terms and divides by a constant (the maximum generation length), not by each
sequence's length, which removes GRPO's length and difficulty biases (Dr. GRPO / Oat).
"""
from __future__ import annotations

from typing import Sequence

import torch

CHALLENGER, REASONER = "challenger", "reasoner"


def center_by_group(rewards: torch.Tensor, group_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """r_i - mean_{j in group(i)} r_j."""
    groups = torch.as_tensor(group_ids, device=rewards.device)
    _, inverse = torch.unique(groups, return_inverse=True)
    n = int(inverse.max()) + 1 if inverse.numel() else 0
    sums = torch.zeros(n, dtype=rewards.dtype, device=rewards.device).index_add_(0, inverse, rewards)
    counts = torch.zeros(n, dtype=rewards.dtype, device=rewards.device).index_add_(0, inverse, torch.ones_like(rewards))
    return rewards - (sums / counts)[inverse]


def role_advantages(rewards: torch.Tensor, roles: Sequence[str], groups: Sequence[int]) -> torch.Tensor:
    """A_i = r_i - mean of r over i's group, per role: a challenger sample's group is its document
    (Algorithm 1; -1 for one group over the batch), a reasoner sample's the question it answers.
    The two roles' group ids are separate namespaces."""
    if len(roles) != rewards.numel() or len(groups) != rewards.numel():
        raise ValueError(f"rewards ({rewards.numel()}), roles ({len(roles)}) and groups ({len(groups)}) "
                         "must have the same length")
    unknown = set(roles) - {CHALLENGER, REASONER}
    if unknown:
        raise ValueError(f"roles: unknown role(s) {sorted(unknown)}")
    if any(g < 0 and r == REASONER for g, r in zip(groups, roles)):
        raise ValueError("groups: reasoner samples need the id (>= 0) of the question they answer")
    keys: dict[tuple[str, int], int] = {}
    ids = [keys.setdefault((role, int(g)), len(keys)) for role, g in zip(roles, groups)]
    return center_by_group(rewards, ids)


def tis_weights(learner_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, cap: float) -> torch.Tensor:
    """Token-level truncated importance sampling: min(pi_learner / mu_engine, cap) per sampled token,
    from the learner's log-probs before the update and the engine's own sampled-token log-probs.
    It corrects for the policy that sampled (the engine: other numerics, and at staleness 1 the
    weights of one step earlier) not being the one the gradient is taken under."""
    return torch.exp(learner_logprobs - engine_logprobs).clamp(max=cap)


def drgrpo_token_loss(logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, max_gen_len: int,
                      old_logprobs: torch.Tensor | None = None, num_sequences: int | None = None,
                      clip_low: float = 0.2, clip_high: float | None = None,
                      engine_logprobs: torch.Tensor | None = None, tis_cap: float | None = None,
                      ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The DrGRPO loss for a (micro-)batch.

    logprobs, old_logprobs, mask: [batch, tokens] over the completion positions; advantages: [batch].
    With old_logprobs None the update is on-policy (ratio 1, the plain policy gradient). The sum is
    divided by max_gen_len * num_sequences, where num_sequences is the size of the whole global batch
    so that micro-batches and data-parallel ranks add up to the same objective. With tis_cap, each
    token's term is weighted by tis_weights(old, engine_logprobs, tis_cap) (where engine_logprobs
    is 0 the caller's mask should say whether the engine gave any; see the learner).
    """
    if logprobs.shape != mask.shape:
        raise ValueError(f"mask: shape {tuple(mask.shape)} differs from logprobs {tuple(logprobs.shape)}")
    if advantages.shape != logprobs.shape[:1]:
        raise ValueError(f"advantages: shape {tuple(advantages.shape)}, expected ({logprobs.shape[0]},)")
    if max_gen_len <= 0:
        raise ValueError(f"max_gen_len: must be > 0, got {max_gen_len}")
    if tis_cap is not None and engine_logprobs is None:
        raise ValueError("tis_cap: truncated importance sampling needs the engine's log-probs")
    mask = mask.to(logprobs.dtype)
    old = logprobs.detach() if old_logprobs is None else old_logprobs.to(logprobs.dtype)
    log_ratio = logprobs - old
    ratio = torch.exp(log_ratio)
    adv = advantages.to(logprobs.dtype).unsqueeze(-1)
    high = clip_low if clip_high is None else clip_high
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    weights = None
    if tis_cap is not None:
        weights = tis_weights(old, engine_logprobs.to(logprobs.dtype), tis_cap).detach()
        per_token = per_token * weights
    denom = max_gen_len * (num_sequences if num_sequences is not None else logprobs.shape[0])
    loss = (per_token * mask).sum() / denom
    with torch.no_grad():
        n_tokens = mask.sum().clamp(min=1)
        metrics = {
            "clip_fraction": ((clipped < unclipped).to(mask.dtype) * mask).sum() / n_tokens,
            "ratio_mean": (ratio * mask).sum() / n_tokens,
            "approx_kl": (((ratio - 1) - log_ratio) * mask).sum() / n_tokens,  # k3 estimator
            "tokens": mask.sum(),
        }
        if weights is not None:
            metrics["tis_weight_mean"] = (weights * mask).sum() / n_tokens
    return loss, metrics
