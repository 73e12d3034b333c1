"""Rewards of the two roles (SPICE.md, "Rewards").

The challenger is rewarded for tasks at the reasoner's frontier: the variance of the reasoner's
binary outcomes peaks at a 50% pass rate. The ablation rewards of the paper's section 4.3 share
the signature so that a run can switch between them by name.
"""
from __future__ import annotations

import math
from collections import Counter
from typing import Sequence

INVALID_PENALTY = -0.1  # rho
VARIANCE_TARGET = 0.25  # the variance of a Bernoulli(0.5)
VARIANCE_WIDTH = 0.01  # sigma^2 of the Gaussian around the target


def reasoner_reward(correct: bool) -> float:
    return 1.0 if correct else 0.0


def variance_reward(outcomes: Sequence[bool]) -> float:
    """exp(-(Var(l) - 0.25)^2 / (2 * 0.01)) with the population variance p(1-p)."""
    p = sum(bool(o) for o in outcomes) / len(outcomes)
    return math.exp(-((p * (1 - p) - VARIANCE_TARGET) ** 2) / (2 * VARIANCE_WIDTH))


def absolute_zero_reward(outcomes: Sequence[bool]) -> float:
    """1 - acc for 0 < acc < 1; 0 for tasks nobody or everybody solves (as the reference code)."""
    acc = sum(bool(o) for o in outcomes) / len(outcomes)
    return 1.0 - acc if 0.0 < acc < 1.0 else 0.0


def at_frontier(outcomes: Sequence[bool]) -> bool:
    """The reasoner solves the task sometimes, not always and not never (0 < pass rate < 1)."""
    return 0 < sum(bool(o) for o in outcomes) < len(outcomes)


def threshold_reward(outcomes: Sequence[bool]) -> float:
    return 1.0 if at_frontier(outcomes) else 0.0


def r_zero_reward(answers: Sequence[str | None]) -> float:
    """1 - 2|p_mode - 0.5|: uncertainty of the reasoners' majority answer. Answers should be
    normalised (equivalent answers must compare equal); a missing answer counts as its own vote."""
    votes = Counter("\x00none" if a is None else a for a in answers)
    p_mode = votes.most_common(1)[0][1] / len(answers)
    return 1.0 - 2.0 * abs(p_mode - 0.5)


def challenger_reward(outcomes: Sequence[bool], valid: bool = True, kind: str = "variance",
                      answers: Sequence[str | None] | None = None, invalid_penalty: float = INVALID_PENALTY) -> float:
    """The challenger's reward for one task from its K reasoner outcomes.

    `answers` (the reasoners' normalised final answers) is needed by `r_zero` only.
    """
    if not valid:
        return invalid_penalty
    if kind == "r_zero":
        if not answers:
            raise ValueError("challenger_reward(kind='r_zero') needs the reasoners' answers")
        return r_zero_reward(answers)
    if not outcomes:
        raise ValueError("challenger_reward needs at least one reasoner outcome for a valid task")
    if kind == "variance":
        return variance_reward(outcomes)
    if kind == "absolute_zero":
        return absolute_zero_reward(outcomes)
    if kind == "threshold":
        return threshold_reward(outcomes)
    raise ValueError(f"kind: unknown challenger reward {kind!r} "
                     "(variance, absolute_zero, threshold, r_zero)")
