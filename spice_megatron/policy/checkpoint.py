"""Learner checkpoints with megatron's dist_checkpointing (torch_dist format).

Layout of a checkpoint root:
  step_00000010/        model + optimizer shards, scheduler, RNG, trainer_state.json, layout.json
  latest                the name of the newest complete checkpoint
A checkpoint is written to `.step_XXXXXXXX.tmp` and renamed only when every rank has finished,
so a kill during a save leaves the previous checkpoint loadable. The model and the
(non-distributed) optimizer reshard on load to any TP x PP layout; RNG states are restored only
when the layout is unchanged.
"""
from __future__ import annotations

import json
import logging
import os
import random
import shutil
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from spice_megatron.config import ConfigError
from spice_megatron.policy import cpu_compat

log = logging.getLogger(__name__)

LATEST = "latest"
# How megatron's distributed optimizer lays out its state in a checkpoint (optim.checkpoint_sharding).
# megatron-core 0.16.1 defaults to 'fully_sharded_model_space', which raises "ShardedTensor.flattened_range
# is not supported" at the first save. 'dp_reshardable' writes each DP rank's shard as it is, fully in
# parallel; 'fully_reshardable' all-gathers the state within each DP group first (the whole optimizer
# state in every rank's host memory: tools/bench_checkpoint.py) so that any TP x PP x DP can load it.
# Checkpoints from before the setting existed were fully_reshardable (layout.json says which).
LEGACY_OPTIMIZER_SHARDING = "fully_reshardable"


def _step_dir(step: int) -> str:
    return f"step_{step:08d}"


def _rng_state() -> dict:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
             "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def optimizer_metadata(learner, sharding: str) -> dict | None:
    """The `metadata` megatron's optimizers take in sharded_state_dict (None: not distributed)."""
    if not learner.optim_cfg.use_distributed_optimizer:
        return None
    return {"distrib_optim_sharding_type": sharding, "chained_optim_avoid_prefix": True}


def _sharded_state(learner, is_loading: bool, with_optimizer: bool, with_rng: bool, sharding: str) -> dict:
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    lay = learner.layout
    model_sd = learner.model.sharded_state_dict()
    state = {"model": model_sd}
    if with_optimizer:
        state["optimizer"] = learner.optimizer.sharded_state_dict(model_sd, is_loading=is_loading,
                                                                  metadata=optimizer_metadata(learner, sharding))
    if with_rng:
        state["rng"] = ShardedObject("rng_state", _rng_state() if not is_loading else None,
                                     (lay.pp, lay.tp, lay.dp), (lay.pp_rank, lay.tp_rank, lay.dp_rank), replica_id=0)
    return state


def save_checkpoint(learner, root: str, step: int, trainer_state: dict[str, Any] | None = None,
                    keep_last: int = 2, model_only: bool = False) -> str:
    """Collective: every learner rank calls it. Returns the checkpoint directory. A model-only
    checkpoint (a conversion from HF) holds no optimizer, scheduler or RNG state."""
    from megatron.core import dist_checkpointing

    rank = dist.get_rank()
    final = os.path.join(root, _step_dir(step))
    tmp = os.path.join(root, f".{_step_dir(step)}.tmp")
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # debris of a save that was killed
        os.makedirs(tmp)
    dist.barrier()
    with cpu_compat.cuda_to_cpu():
        dist_checkpointing.save(_sharded_state(learner, False, not model_only, not model_only,
                                               learner.optim_cfg.checkpoint_sharding), tmp)
    dist.barrier()
    if rank == 0:
        lay = learner.layout
        with open(os.path.join(tmp, "layout.json"), "w") as f:
            json.dump({"tp": lay.tp, "pp": lay.pp, "dp": lay.dp, "ep": lay.ep, "step": step,
                       "learner_steps": learner.steps, "model_only": model_only,
                       "distributed_optimizer": learner.optim_cfg.use_distributed_optimizer,
                       "optimizer_sharding": learner.optim_cfg.checkpoint_sharding}, f)
        if not model_only:
            with open(os.path.join(tmp, "scheduler.json"), "w") as f:
                json.dump(learner.scheduler.state_dict(), f)
        with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
            json.dump(trainer_state or {}, f)
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        _write_latest(root, _step_dir(step))
        _prune(root, keep_last)
        log.info("checkpoint saved: %s", final)
    dist.barrier()
    return final


def _write_latest(root: str, name: str) -> None:
    tmp = os.path.join(root, f".{LATEST}.tmp")
    with open(tmp, "w") as f:
        f.write(name + "\n")
    os.replace(tmp, os.path.join(root, LATEST))


def _prune(root: str, keep_last: int) -> None:
    done = sorted(d for d in os.listdir(root) if d.startswith("step_"))
    for d in done[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(os.path.join(root, d), ignore_errors=True)


def latest_checkpoint(root: str) -> str | None:
    """The newest complete checkpoint under root, or None."""
    path = os.path.join(root, LATEST)
    if os.path.exists(path):
        with open(path) as f:
            candidate = os.path.join(root, f.read().strip())
        if os.path.exists(os.path.join(candidate, "layout.json")):
            return candidate
    # `latest` may lag a completed rename if the process died in between: fall back to a scan.
    done = sorted(d for d in os.listdir(root) if d.startswith("step_")
                  and os.path.exists(os.path.join(root, d, "layout.json"))) if os.path.isdir(root) else []
    return os.path.join(root, done[-1]) if done else None


def load_checkpoint(learner, path: str, model_only: bool = False) -> dict[str, Any]:
    """Collective. Restores the model, and unless model_only (or the checkpoint has none) the
    optimizer, scheduler and, when the layout matches, RNG states; returns the trainer state."""
    from megatron.core import dist_checkpointing

    with open(os.path.join(path, "layout.json")) as f:
        saved = json.load(f)
    lay = learner.layout
    same_layout = (saved["tp"], saved["pp"], saved["dp"]) == (lay.tp, lay.pp, lay.dp)
    with_optimizer = not (model_only or saved.get("model_only", False))
    sharding = saved.get("optimizer_sharding", LEGACY_OPTIMIZER_SHARDING)
    if with_optimizer:
        check_optimizer_resharding(path, saved, lay, learner.optim_cfg.use_distributed_optimizer)
    if not same_layout and with_optimizer and dist.get_rank() == 0:
        log.warning("checkpoint %s was saved at TP=%d PP=%d DP=%d; resharding to TP=%d PP=%d DP=%d "
                    "(RNG states are not restored)", path, saved["tp"], saved["pp"], saved["dp"], lay.tp, lay.pp, lay.dp)
    with cpu_compat.cuda_to_cpu():
        state = dist_checkpointing.load(
            _sharded_state(learner, True, with_optimizer, with_optimizer and same_layout, sharding), path)
        learner.model.load_state_dict(state["model"])
        if with_optimizer:
            learner.optimizer.load_state_dict(state["optimizer"])
        else:  # a bf16 optimizer's fp32 main weights would otherwise overwrite the loaded ones at the next step
            learner.optimizer.reload_model_params()
    if not with_optimizer:
        return {}
    if same_layout:
        _set_rng_state(state["rng"])
    with open(os.path.join(path, "scheduler.json")) as f:
        learner.scheduler.load_state_dict(json.load(f))
    learner.steps = saved.get("learner_steps", 0)
    return read_trainer_state(path)


def check_optimizer_resharding(path: str, saved: dict, layout, distributed: bool) -> None:
    """A dp_reshardable optimizer state loads only where each DP shard means the same parameters:
    the same TP x PP x EP (any DP) and the distributed optimizer on both sides."""
    if saved.get("optimizer_sharding", LEGACY_OPTIMIZER_SHARDING) != "dp_reshardable" or not (
            saved.get("distributed_optimizer") or distributed):
        return
    was = (saved["tp"], saved["pp"], saved.get("ep", 1), bool(saved.get("distributed_optimizer")))
    now = (layout.tp, layout.pp, layout.ep, distributed)
    if was != now:
        raise ConfigError(
            f"checkpoint {path}: its optimizer state was saved per data-parallel shard (optim.checkpoint_sharding="
            f"dp_reshardable) at TP={was[0]} PP={was[1]} EP={was[2]}, distributed optimizer {was[3]}; this run is "
            f"TP={now[0]} PP={now[1]} EP={now[2]}, distributed optimizer {now[3]}. Resume at the saved layout (with "
            "optim.checkpoint_sharding=fully_reshardable for one checkpoint, which any layout loads), or take the "
            "weights alone (tools/convert_to_hf.py) and start a fresh optimizer")


def read_trainer_state(path: str) -> dict[str, Any]:
    """The trainer's state saved with a checkpoint (iteration, weights version, driver state)."""
    with open(os.path.join(path, "trainer_state.json")) as f:
        return json.load(f)
