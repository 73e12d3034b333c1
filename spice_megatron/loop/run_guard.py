"""What saves or ends a run around its iterations (trainer.py step 7): checkpoints, a stop someone
asked for, and the kill switch. (When no engine comes back, engines.py asks it for the checkpoint.)"""
from __future__ import annotations

import os

from spice_megatron.config import SpiceConfig
from spice_megatron.loop.driver import KillSwitch
from spice_megatron.run.control import KILL_SWITCH_FILE, STOP_FILE, STOPPED_FILE, Interrupted, write_marker


class RunGuard:
    def __init__(self, cfg: SpiceConfig, learner, rollouts, saved_iteration: int, is_driver: bool) -> None:
        """`saved_iteration`: the iteration the newest checkpoint holds (-1: none); `rollouts`: the
        loop's rollout source, whose state() a checkpoint holds."""
        self.cfg, self.learner, self.rollouts = cfg, learner, rollouts
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

    def save_unless_held(self, done: int, held: int) -> None:
        """A checkpoint of the `done` iterations before the run stops, unless the newest holds them."""
        if done > self.saved:
            self.save(done, held)

    def stop_requested(self, done: int, held: int, why: str, raise_: bool = True) -> None:
        """Ctrl-C, SIGTERM or a STOP file: a checkpoint of the `done` iterations (unless the newest
        holds them already), the STOP file consumed (the next attempt runs on), the STOPPED marker
        that tells the job script this was no failure; then Interrupted."""
        if done > 0:
            self.save_unless_held(done, held)
        if self.is_driver and os.path.exists(self.stop_file):
            os.remove(self.stop_file)
        write_marker(os.path.join(self.cfg.run.output_dir, STOPPED_FILE), "stop requested", self.is_driver)
        if raise_:
            where = f"after iteration {done} with a checkpoint" if done else "before iteration 1 (nothing to save)"
            raise Interrupted(f"{why + '; ' if why else ''}stopped {where}; continue with --resume")

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
