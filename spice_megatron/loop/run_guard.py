"""What saves or ends a run around its iterations (trainer.py steps 6 and 7): checkpoints, a stop
someone asked for, the kill switch, and the engines' loss or death."""
from __future__ import annotations

import os

from spice_megatron.config import SpiceConfig
from spice_megatron.loop.driver import EnginesLost, KillSwitch
from spice_megatron.loop.interfaces import RolloutDriver
from spice_megatron.policy.parallel import broadcast_from_driver
from spice_megatron.run.control import KILL_SWITCH_FILE, STOP_FILE, STOPPED_FILE, Interrupted, write_marker


class RunGuard:
    def __init__(self, cfg: SpiceConfig, learner, driver: RolloutDriver | None, control, weights, colocation, rollouts,
                 saved_iteration: int, is_driver: bool) -> None:
        """`saved_iteration`: the iteration the newest checkpoint holds (-1: none)."""
        self.cfg, self.learner, self.driver, self.control = cfg, learner, driver, control
        self.weights, self.colocation, self.rollouts = weights, colocation, rollouts
        self.saved, self.is_driver = saved_iteration, is_driver
        self.ckpt_root = os.path.join(cfg.run.output_dir, "checkpoints")
        self.stop_file = os.path.join(cfg.run.output_dir, STOP_FILE)
        self.kill_marker = os.path.join(cfg.run.output_dir, KILL_SWITCH_FILE)

    def save(self, done: int, held: int, kill_switch: str = "") -> None:
        from spice_megatron.policy.checkpoint import save_checkpoint

        trainer_state = {"iteration": done, "version": held, **self.rollouts.state()}
        if kill_switch:
            trainer_state["kill_switch"] = kill_switch
        save_checkpoint(self.learner, self.ckpt_root, done, trainer_state, self.cfg.run.keep_last)  # rank 0 writes
        self.saved = done

    def stop_requested(self, done: int, held: int, why: str, raise_: bool = True) -> None:
        """Ctrl-C, SIGTERM or a STOP file: a checkpoint of the `done` iterations (unless the newest
        holds them already), the STOP file consumed (the next attempt runs on), the STOPPED marker
        that tells the job script this was no failure; then Interrupted."""
        if done > self.saved and done > 0:
            self.save(done, held)
        if self.is_driver and os.path.exists(self.stop_file):
            os.remove(self.stop_file)
        write_marker(os.path.join(self.cfg.run.output_dir, STOPPED_FILE), "stop requested", self.is_driver)
        if raise_:
            where = f"after iteration {done} with a checkpoint" if done else "before iteration 1 (nothing to save)"
            raise Interrupted(f"{why + '; ' if why else ''}stopped {where}; continue with --resume")

    def recover(self, why: str, done: int | None, held: int, sync: bool = False) -> None:
        """No rollout engine is left: the driver restarts those it started (or waits for a cluster's)
        and the sync group is formed anew (with `sync`, the engines then get weights `held`). If none
        comes back, the run stops; with `done`, after a checkpoint of the `done` iterations finished
        (the learner holds their weights), else from the last checkpoint. --resume continues either."""
        reason = broadcast_from_driver(self.driver.recover_engines(why) if self.driver else "", self.control)
        if reason:
            if done is not None and done > self.saved:
                self.save(done, held)
            at = f"a checkpoint after iteration {done}" if done is not None else "the last checkpoint"
            raise EnginesLost(f"{reason}; the run stopped: continue from {at} with --resume")
        self.weights.reform()
        self.colocation.before_sync()  # restarted engines start awake: their KV cache waits for the sync
        if sync:
            self.weights.sync(held)
            self.colocation.after_sync()

    def load_engines(self, version: int) -> None:
        """Weights `version` to engines that hold others (a resumed run's, which start from the base model)."""
        self.colocation.before_sync()
        self.weights.sync(version)
        self.colocation.after_sync()

    def sync_engines(self, lost: str, version: int) -> dict[str, float]:
        """Step 6: the new weights to the engines. Engines lost while the learner stepped are brought
        back first; one that died during the rollouts (the fleet served its requests elsewhere) is
        restarted and the sync group formed anew."""
        lost = broadcast_from_driver(lost, self.control)
        if lost:
            self.recover(lost, None, version)
        elif broadcast_from_driver(self.driver.restart_dead_engines() if self.driver else False, self.control):
            self.weights.reform()
            self.colocation.before_sync()
        sync = self.weights.sync(version)
        self.colocation.after_sync()
        return sync

    def end_iteration(self, done: int, version: int, stop: str, interrupted: bool) -> None:
        """Step 7's end: a checkpoint when one is due (every run.checkpoint_every, the last, or the run
        stopping), then the kill switch's or a requested stop."""
        if stop or interrupted or done % self.cfg.run.checkpoint_every == 0 or done == self.cfg.run.iterations:
            self.save(done, version, kill_switch=stop)
        if stop:
            write_marker(self.kill_marker, stop, self.is_driver)
            raise KillSwitch(f"stopped the run: {stop} (a checkpoint was saved)")
        if interrupted:  # after the last iteration there is nothing left to stop
            self.stop_requested(done, version, "", raise_=done < self.cfg.run.iterations)
