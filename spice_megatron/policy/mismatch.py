"""Learner-vs-engine mismatch metrics of a training step, per role: how far the learner's log-probs
on the sampled tokens are from the engine's (mean and max |gap|), the k3 estimate of KL(engine ||
learner), and the share of tokens truncated importance sampling caps."""
from __future__ import annotations

import math

import torch


def mismatch_rows(lp: torch.Tensor, old_lp: torch.Tensor | None, engine_lp: torch.Tensor, mask: torch.Tensor,
                   cap: float) -> torch.Tensor:
    """Per sequence: [sum |lp - engine|, max |lp - engine|, sum of k3, tokens over the TIS cap, tokens],
    over the sampled tokens the engine gave log-probs for. k3 = r - 1 - log r with r = pi / mu
    estimates KL(engine || learner) from the engine's samples."""
    diff = (lp - engine_lp) * mask
    k3 = (torch.exp(diff) - 1 - diff) * mask
    over = ((((lp if old_lp is None else old_lp) - engine_lp) > math.log(cap)).to(mask.dtype) * mask)
    return torch.stack([diff.abs().sum(-1), diff.abs().amax(-1), k3.sum(-1), over.sum(-1), mask.sum(-1)], -1)


def mismatch_by_role(rows: list[list[float]], roles: list[str]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for role, row in zip(roles, rows):
        if row[4]:
            _add_mismatch(out, role or "all", row)
    return out


def _add_mismatch(total: dict[str, list[float]], role: str, row: list[float]) -> None:
    acc = total.setdefault(role, [0.0, 0.0, 0.0, 0.0, 0.0])
    acc[0] += row[0]
    acc[1] = max(acc[1], row[1])
    acc[2] += row[2]
    acc[3] += row[3]
    acc[4] += row[4]


def mismatch_metrics(parts: list[dict[str, list[float]]]) -> dict[str, float]:
    total: dict[str, list[float]] = {}
    for part in parts:
        for role, row in part.items():
            _add_mismatch(total, role, row)
    return {f"{role}/{key}": value for role, (abs_sum, abs_max, k3, over, n) in total.items()
            for key, value in (("logprob_gap_mean", abs_sum / n), ("logprob_gap_max", abs_max),
                               ("k3_kl", k3 / n), ("tis_capped", over / n))}
