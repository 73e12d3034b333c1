"""Learner checkpoints with megatron's dist_checkpointing (torch_dist format).

Layout of a checkpoint root:
  step_00000010/        model + optimizer shards, scheduler, RNG, trainer_state.json, layout.json
  latest                the name of the newest complete checkpoint
A checkpoint is written to `.step_XXXXXXXX.tmp` and renamed only when every rank has finished,
so a kill during a save leaves the previous checkpoint loadable. Before the rename every file is
flushed to disk (each rank its own shards) and `manifest.json`, written last, lists each file's
size and CRC-32 (computed by the rank that wrote it, from the page cache); the directories are
flushed after the rename. A resume takes the newest checkpoint whose files match their manifest
and that loads (`resumable_checkpoint`), naming each one it passes over. The model and the
(non-distributed) optimizer reshard on load to any TP x PP layout; RNG states are restored only
when the layout is unchanged.
"""
from __future__ import annotations

import json
import logging
import os
import random
import shutil
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from spice_megatron.config import ConfigError
from spice_megatron.policy import cpu_compat
from spice_megatron.policy.checkpoint_files import (
    DAMAGED_PREFIX,
    checkpoint_candidates,
    file_entry,
    fsync_dir,
    prune,
    verify_checkpoint,
    write_json,
    write_latest,
    write_manifest,
    writer_rank,
)

log = logging.getLogger(__name__)

# How megatron's distributed optimizer lays out its state in a checkpoint (optim.checkpoint_sharding).
# megatron-core 0.16.1 defaults to 'fully_sharded_model_space', which raises "ShardedTensor.flattened_range
# is not supported" at the first save. 'dp_reshardable' writes each DP rank's shard as it is, fully in
# parallel; 'fully_reshardable' all-gathers the state within each DP group first (the whole optimizer
# state in every rank's host memory: tools/bench/bench_checkpoint.py) so that any TP x PP x DP can load it.
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
    # one entry per model chunk (virtual pipeline stages) as Megatron-LM names them; the tensors'
    # keys carry global layer numbers, so a checkpoint loads at any other chunking
    model_sd = (learner.model.sharded_state_dict() if len(learner.chunks) == 1 else
                {f"model{i}": chunk.sharded_state_dict() for i, chunk in enumerate(learner.chunks)})
    state = {"model": model_sd}
    if with_optimizer:
        state["optimizer"] = learner.optimizer.sharded_state_dict(model_sd, is_loading=is_loading,
                                                                  metadata=optimizer_metadata(learner, sharding))
    if with_rng:
        state["rng"] = ShardedObject("rng_state", _rng_state() if not is_loading else None,
                                     (lay.pp, lay.tp, lay.dp * lay.cp),
                                     (lay.pp_rank, lay.tp_rank, lay.dp_rank * lay.cp + lay.cp_rank), replica_id=0)
    return state


def save_checkpoint(learner, root: str, step: int, trainer_state: dict[str, Any] | None = None,
                    keep_last: int = 2, model_only: bool = False) -> str:
    """Collective: every learner rank calls it. Returns the checkpoint directory. A model-only
    checkpoint (a conversion from HF) holds no optimizer, scheduler or RNG state."""
    from megatron.core import dist_checkpointing

    _results_queue_that_dies_with_this_rank()
    rank, world = dist.get_rank(), dist.get_world_size()
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
    write_json(os.path.join(tmp, f".manifest.rank{rank}.json"),
                {name: file_entry(os.path.join(tmp, name)) for name in sorted(os.listdir(tmp))
                 if writer_rank(name, world) == rank and not name.startswith(".manifest.rank")})
    dist.barrier()
    if rank == 0:
        lay = learner.layout
        write_json(os.path.join(tmp, "layout.json"),
                    {"tp": lay.tp, "pp": lay.pp, "dp": lay.dp, "ep": lay.ep, "cp": lay.cp, "vpp": lay.vpp, "step": step,
                     "learner_steps": learner.steps, "model_only": model_only,
                     "distributed_optimizer": learner.optim_cfg.use_distributed_optimizer,
                     "optimizer_sharding": learner.optim_cfg.checkpoint_sharding})
        if not model_only:
            write_json(os.path.join(tmp, "scheduler.json"), learner.scheduler.state_dict())
        write_json(os.path.join(tmp, "trainer_state.json"), trainer_state or {})
        write_manifest(tmp, world)
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(root)
        write_latest(root, _step_dir(step))
        prune(root, keep_last)
        log.info("checkpoint saved: %s", final)
    dist.barrier()
    return final


_queue_manager = None  # kept alive with the process: its server holds megatron's results queue


def _results_queue_that_dies_with_this_rank() -> None:
    """megatron's torch_dist writer keeps its results in a queue served by a multiprocessing
    Manager it spawns at the first save (filesystem_async._get_write_results_queue), whose server
    outlives a rank killed with kill -9 (found left behind by the suite). Put one there first whose
    server takes the parent-death signal. Once per process, from the thread that saves (the main one)."""
    global _queue_manager
    import multiprocessing as mp
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if _queue_manager is not None or getattr(filesystem_async, "_results_queue", "absent") is not None:
        return  # done, megatron made its own already, or a megatron without that queue
    from spice_megatron.torchrun import die_with_parent

    _queue_manager = SyncManager(ctx=mp.get_context("spawn"))
    _queue_manager.start(initializer=die_with_parent, initargs=(os.getpid(),))
    filesystem_async._results_queue = _queue_manager.Queue()


class NoUsableCheckpoint(RuntimeError):
    """Checkpoints exist, and none of them matches its manifest and loads."""


def resumable_checkpoint(learner, root: str, group) -> tuple[str | None, dict[str, Any]]:
    """Collective over the learner ranks (`group`: the gloo control group). Loads the newest
    checkpoint under root whose files match its manifest and that loads on every rank; each one
    passed over is named in one line and, once an older one has loaded, renamed `damaged.<name>`
    (kept for inspection, out of the pruning's way), and `latest` points at the one used. Returns
    (its path, its trainer state); (None, {}) when there is no checkpoint; NoUsableCheckpoint
    when none of them is usable (all are left in place). Every load restores the whole learner
    state, so a failed attempt leaves nothing behind."""
    rank, world = dist.get_rank(), dist.get_world_size()
    box = [checkpoint_candidates(root) if rank == 0 else None]  # one list for all, whatever each rank's view
    dist.broadcast_object_list(box, src=0, group=group)
    passed_over: list[tuple[str, str]] = []
    for path in box[0]:
        t0 = time.perf_counter()
        problems: list[str] = [""] * world
        dist.all_gather_object(problems, verify_checkpoint(path, rank, world), group=group)
        why = next((p for p in problems if p), "")
        if not why:
            try:
                state, error = load_checkpoint(learner, path), ""
            except ConfigError:  # the checkpoint is fine; this run's settings cannot take it
                raise
            except Exception as e:  # noqa: BLE001 - torch's checkpoint reader raises many kinds
                state, error = {}, f"its load failed: {type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
            dist.all_gather_object(problems, error, group=group)
            why = next((p for p in problems if p), "")
        if why:
            if rank == 0:
                log.error("checkpoint %s is damaged and is not used: %s", path, why)
            passed_over.append((path, why))
            continue
        if rank == 0:
            for bad, _ in passed_over:
                aside = os.path.join(root, DAMAGED_PREFIX + os.path.basename(bad))
                shutil.rmtree(aside, ignore_errors=True)
                os.replace(bad, aside)
                log.warning("moved the damaged checkpoint %s to %s", bad, aside)
            if passed_over:
                write_latest(root, os.path.basename(path))
            log.info("resuming from %s (verified and loaded in %.1f s)", path, time.perf_counter() - t0)
        dist.barrier(group=group)
        return path, state
    if passed_over:
        raise NoUsableCheckpoint(f"no checkpoint under {root} can be resumed: " +
                                 "; ".join(f"{os.path.basename(p)}: {why}" for p, why in passed_over))
    return None, {}


def load_checkpoint(learner, path: str, model_only: bool = False) -> dict[str, Any]:
    """Collective. Restores the model, and unless model_only (or the checkpoint has none) the
    optimizer, scheduler and, when the layout matches, RNG states; returns the trainer state."""
    from megatron.core import dist_checkpointing

    from spice_megatron.run_dir import check_checkpoint_tree

    # right before the load: what it unpickles is ours (docs/cluster.md, "A run directory nobody else writes")
    check_checkpoint_tree(path)
    with open(os.path.join(path, "layout.json")) as f:
        saved = json.load(f)
    lay = learner.layout
    same_layout = ((saved["tp"], saved["pp"], saved["dp"], saved.get("cp", 1), saved.get("vpp", 1))
                   == (lay.tp, lay.pp, lay.dp, lay.cp, lay.vpp))
    with_optimizer = not (model_only or saved.get("model_only", False))
    sharding = saved.get("optimizer_sharding", LEGACY_OPTIMIZER_SHARDING)
    if with_optimizer:
        check_optimizer_resharding(path, saved, lay, learner.optim_cfg.use_distributed_optimizer)
    if not same_layout and with_optimizer and dist.get_rank() == 0:
        log.warning("checkpoint %s was saved at TP=%d PP=%d CP=%d DP=%d; resharding to TP=%d PP=%d CP=%d DP=%d "
                    "(RNG states are not restored)", path, saved["tp"], saved["pp"], saved.get("cp", 1), saved["dp"],
                    lay.tp, lay.pp, lay.cp, lay.dp)
    with cpu_compat.cuda_to_cpu():
        state = dist_checkpointing.load(
            _sharded_state(learner, True, with_optimizer, with_optimizer and same_layout, sharding), path)
        if len(learner.chunks) == 1:
            learner.model.load_state_dict(state["model"])
        for i, chunk in enumerate(learner.chunks if len(learner.chunks) > 1 else []):
            chunk.load_state_dict(state["model"][f"model{i}"])
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
