"""Where an iteration's rollouts come from (steps 1-4 of trainer.py), one class per mode:

- `OnPolicy`: the driver rolls out on the current weights, then the learner steps.
- `OneStepOff` (train.max_staleness=1): the rollouts of iteration t+1 run in the background while
  the learner takes the step of t; iteration t+1 trains on that batch, one version old.
- `Overlapped` (on-policy, streamed, several steps per batch): every learner rank runs the old
  log-probs of the documents already complete while the others roll out (streamed_forward.py).

Each gives `collect(iteration, version)` before the step, `wait()` after it (what was in flight
while the learner stepped), `start_next(iteration, version)` once the iteration is logged, and
`state()`: what a checkpoint must hold to start the rollouts again from the same place.
"""
from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from spice_megatron.config import SpiceConfig
from spice_megatron.loop.driver import IterationAbandoned
from spice_megatron.loop.interfaces import RolloutBatch, RolloutDriver
from spice_megatron.loop.streamed_forward import overlaps, rollouts_with_old_logprobs
from spice_megatron.rollout.fleet import NoEngineLeft


@dataclass
class Rollouts:
    """One iteration's rollouts as the driver got them (`batch` on the driver only)."""
    batch: RolloutBatch | None = None
    lost: str = ""  # every engine died: the run brings them back and rolls out again
    abandoned: bool = False  # a STOP arrived during the rollouts
    old_logprobs: dict | None = None  # by sequence, when computed during the rollouts (Overlapped)
    stats: dict[str, float] = field(default_factory=dict)


def _selfplay(driver: RolloutDriver | None, iteration: int, version: int) -> Rollouts:
    try:
        return Rollouts(driver.selfplay(iteration, version))
    except NoEngineLeft as e:
        return Rollouts(lost=str(e))
    except IterationAbandoned:
        return Rollouts(abandoned=True)


class OnPolicy:
    def __init__(self, driver: RolloutDriver | None) -> None:
        self.driver = driver

    def collect(self, iteration: int, version: int) -> Rollouts:
        return _selfplay(self.driver, iteration, version) if self.driver else Rollouts()

    def wait(self) -> tuple[str, float]:
        """After the step: why no engine was left for the rollouts in flight ("" when none), seconds waited."""
        return "", 0.0

    def start_next(self, iteration: int, version: int) -> None:
        pass

    def state(self) -> dict[str, Any]:
        return {"driver": self.driver.state() if self.driver else None, "ready": None}


class OneStepOff(OnPolicy):
    """`ready`: a finished batch waiting for the learner; `pending`: the rollouts in flight;
    `snapshot`: the driver's sampler and RNG from before they started (what a checkpoint holds)."""

    def __init__(self, driver: RolloutDriver | None, iterations: int, ready: dict | None) -> None:
        super().__init__(driver)
        self.iterations = iterations
        self.ready = RolloutBatch.from_json(ready) if driver and ready else None
        self.pending: Future | None = None
        self.snapshot: dict = {}

    def collect(self, iteration: int, version: int) -> Rollouts:
        if not self.driver:
            return Rollouts()
        got = Rollouts(self.ready) if self.ready else _selfplay(self.driver, iteration, version)
        self.ready = None
        if got.batch and self.pending is None:  # the next iteration's rollouts start now, on these weights
            self.start_next(iteration + 1, version)
        return got

    def wait(self) -> tuple[str, float]:
        """The engines keep the old weights until the rollouts in flight are done."""
        if self.pending is None:
            return "", 0.0
        t0, lost = time.perf_counter(), ""
        try:
            self.ready = self.pending.result()
        except NoEngineLeft as e:  # the next iteration rolls out again, on-policy
            self.ready, lost = None, str(e)
        except IterationAbandoned:  # the STOP is honoured after this iteration, as any stop
            self.ready = None
        self.pending, self.snapshot = None, {}
        return lost, time.perf_counter() - t0

    def start_next(self, iteration: int, version: int) -> None:
        """The rollouts of `iteration` (from 0) in the background; they overlap the checkpoint too."""
        if self.driver and iteration < self.iterations:
            self.pending, self.snapshot = self.driver.start_selfplay(iteration, version)

    def state(self) -> dict[str, Any]:
        return {"driver": {**self.driver.state(), **self.snapshot} if self.driver else None,
                "ready": self.ready.to_json() if self.ready else None}


class Overlapped(OnPolicy):
    def __init__(self, driver: RolloutDriver | None, learner, deliver, control) -> None:
        super().__init__(driver)
        self.learner, self.deliver, self.control = learner, deliver, control

    def collect(self, iteration: int, version: int) -> Rollouts:
        """Every rank: the old log-probs of each chunk of complete documents as it arrives."""
        batch, lost, abandoned, old, stats = rollouts_with_old_logprobs(self.driver, self.learner, self.deliver,
                                                                        self.control, iteration, version)
        return Rollouts(batch, lost, abandoned, old, stats)


def rollout_source(cfg: SpiceConfig, driver: RolloutDriver | None, learner, deliver, control, state: dict) -> OnPolicy:
    """The mode `cfg` asks for; `state` is the checkpoint's trainer state (a batch may be waiting)."""
    if cfg.train.max_staleness > 0:
        return OneStepOff(driver, cfg.run.iterations, state.get("ready"))
    if overlaps(cfg):
        return Overlapped(driver, learner, deliver, control)
    return OnPolicy(driver)
