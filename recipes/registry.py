"""The recipe registry: `@recipe(GROUP)` above a function returning a SpiceConfig registers it by
its name, in the order the modules define them, with the group the docs and tests list it in."""
from __future__ import annotations

from typing import Callable

from spice_megatron.config import SpiceConfig

PAPER = "paper"  # the paper's models as published
LARGE = "large"  # larger dense models, TP + PP
BASELINE = "baseline"  # the fixed strong challenger: only the reasoner trains
MOE = "moe"  # mixture of experts: expert parallel, routing replay
COLOCATED = "colocated"  # one node, learner and engines on the same GPUs
FAMILY = "family"  # base models beyond the paper's families
CPU = "cpu"  # one machine, no GPU
GROUPS = (PAPER, LARGE, BASELINE, MOE, COLOCATED, FAMILY, CPU)

RECIPES: dict[str, Callable[..., SpiceConfig]] = {}
GROUP_OF: dict[str, str] = {}


def recipe(group: str) -> Callable[[Callable[..., SpiceConfig]], Callable[..., SpiceConfig]]:
    if group not in GROUPS:
        raise ValueError(f"recipe group {group!r}: one of {', '.join(GROUPS)}")

    def register(fn: Callable[..., SpiceConfig]) -> Callable[..., SpiceConfig]:
        if fn.__name__ in RECIPES:
            raise ValueError(f"recipe {fn.__name__!r} is registered twice")
        RECIPES[fn.__name__], GROUP_OF[fn.__name__] = fn, group
        return fn

    return register


def in_group(group: str) -> tuple[str, ...]:
    return tuple(name for name, g in GROUP_OF.items() if g == group)
