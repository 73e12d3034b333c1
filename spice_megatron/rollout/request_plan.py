"""How the fleet cuts a phase into /generate requests: units of near-equal size, one per healthy
engine (rollout/fleet.py sends them), whole prompts where they fit, a prompt's samples split where
they do not, with the seed offset that keeps each sample's seed whatever the split."""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Request:
    """One /generate request of a phase: prompts[first:first + count], each sampled n times. A prompt
    whose samples are split over engines sends samples offset.. of its n as a request of its own."""
    first: int
    count: int
    n: int
    offset: int = 0
    unit: int = 0  # requests of one unit go to one engine: a unit is one engine's share

    @property
    def sequences(self) -> int:
        return self.count * self.n

    def seed_offset(self, num_prompts: int) -> int:
        """Prompt i of a request samples with seed + i (the engine's rule), so the request's seed is
        seed + first; the later samples of a split prompt take seeds past every prompt's first."""
        return self.first + self.offset * num_prompts


def plan_requests(num_prompts: int, n: int, engines: int, cap: int) -> list[Request]:
    """Cut a phase of num_prompts x n sequences into units of near-equal size, one per healthy engine
    (at most `cap` sequences each: then several per engine), whole prompts where they fit and a
    prompt's samples split between units where they do not."""
    if num_prompts < 1 or n < 1 or engines < 1 or cap < 1:
        raise ValueError(f"plan_requests: num_prompts {num_prompts}, n {n}, engines {engines}, cap {cap}")
    size = max(1, min(cap, math.ceil(num_prompts * n / engines)))
    plan: list[Request] = []
    unit = fill = prompt = taken = 0  # taken: samples of `prompt` already planned
    while prompt < num_prompts:
        room = size - fill
        if taken == 0 and n <= room:
            count = min(room // n, num_prompts - prompt)
            plan.append(Request(prompt, count, n, 0, unit))
            prompt, fill = prompt + count, fill + count * n
        else:
            part = min(n - taken, room)
            plan.append(Request(prompt, 1, part, taken, unit))
            taken, fill = taken + part, fill + part
            if taken == n:
                prompt, taken = prompt + 1, 0
        if fill == size:
            unit, fill = unit + 1, 0
    return plan
