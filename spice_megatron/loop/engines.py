"""The rollout engines' life as the learner's ranks see it: the one owner of their upkeep.

In an iteration (trainer.py): colocated, the engines sleep while the learner steps (`sleep`) and
wake their weights for the sync (`wake_for_sync`), and step 6 sends them the new weights
(`update`), bringing back first any engine lost or dead meanwhile. Around the iterations: a resumed
run's weights at its start (`load`), and every engine brought back when all died during the
rollouts (`recover`). How the phases run is colocation.py's, how weights travel engine_weights.py's,
how an engine is restarted the driver's; this object decides when, so that a change to how engines
sleep, wake, sync or recover is made here. Every method runs on every learner rank; the engines'
control plane is the driver's (global rank 0). Not colocated, `sleep` and `wake_for_sync` do nothing.
"""
from __future__ import annotations

from typing import Callable

from spice_megatron.config import SpiceConfig
from spice_megatron.loop.colocation import Colocation
from spice_megatron.loop.driver import EnginesLost
from spice_megatron.loop.engine_weights import EngineWeightUpdater
from spice_megatron.loop.interfaces import RolloutDriver
from spice_megatron.policy.parallel import broadcast_from_driver


class Engines:
    def __init__(self, cfg: SpiceConfig, learner, driver: RolloutDriver | None, control,
                 save_before_stop: Callable[[int, int], None]) -> None:
        """`save_before_stop(done, held)`: the checkpoint of `done` iterations (weights `held`) that
        a run takes when no engine comes back (RunGuard.save_unless_held)."""
        self.driver, self.control, self.save_before_stop = driver, control, save_before_stop
        self.colocation = Colocation(cfg, learner, driver, control)  # wakes engines a cluster started asleep
        self.weights = EngineWeightUpdater(cfg, learner, driver, control, after_restart=self.colocation.before_sync)

    def sleep(self, iteration: int) -> None:
        """Before the learner's step of `iteration` (from 1): colocated, the engines free the GPUs."""
        self.colocation.before_step(iteration)

    def wake_for_sync(self) -> None:
        """After the step: colocated, the learner offloads and the engines wake their weights."""
        self.colocation.after_step()

    def update(self, lost: str, version: int) -> dict[str, float]:
        """Step 6: weights `version` to the engines, then (colocated) their KV cache back. Engines
        lost while the learner stepped are brought back first; one that died during the rollouts
        (the fleet served its requests elsewhere) is restarted and the sync group formed anew."""
        lost = broadcast_from_driver(lost, self.control)
        if lost:
            self.recover(lost, None, version)
        elif broadcast_from_driver(self.driver.restart_dead_engines() if self.driver else False, self.control):
            self._restarted()
        sync = self.weights.sync(version)
        self.colocation.after_sync()
        return sync

    def load(self, version: int) -> None:
        """Weights `version` to engines that hold others (a resumed run's start from the base model)."""
        self.colocation.before_sync()
        self.weights.sync(version)
        self.colocation.after_sync()

    def recover(self, why: str, done: int | None, held: int, sync: bool = False) -> None:
        """No engine is left: the driver restarts those it started (or waits for a cluster's) and the
        sync group is formed anew; with `sync` the engines then get weights `held`. If none comes
        back the run stops with EnginesLost: with `done`, after a checkpoint of the `done` iterations
        (the learner holds their weights), else from the last checkpoint; --resume continues either."""
        reason = broadcast_from_driver(self.driver.recover_engines(why) if self.driver else "", self.control)
        if reason:
            if done is not None:
                self.save_before_stop(done, held)
            at = f"a checkpoint after iteration {done}" if done is not None else "the last checkpoint"
            raise EnginesLost(f"{reason}; the run stopped: continue from {at} with --resume")
        self._restarted()
        if sync:
            self.weights.sync(held)
            self.colocation.after_sync()

    def _restarted(self) -> None:
        """Restarted engines join a fresh sync group, and start fully awake: colocated, they hold
        their weights alone again before the sync, whose end wakes their KV cache."""
        self.weights.reform()
        self.colocation.before_sync()

    def stats(self) -> dict[str, float]:
        """The iteration's colocation figures (time/engines_sleep, time/engines_wake, ...)."""
        return self.colocation.stats()
