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
import re
import shutil
import time
import zlib
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from spice_megatron.config import ConfigError
from spice_megatron.policy import cpu_compat

log = logging.getLogger(__name__)

LATEST = "latest"
MANIFEST = "manifest.json"
HF_META_DIR = "hf"  # inside a checkpoint root: config.json, generation config, tokenizer files
DAMAGED_PREFIX = "damaged."  # a checkpoint a resume passed over, kept for inspection
_SHARD = re.compile(r"__(\d+)_\d+\.distcp$")  # torch_dist's files: __<global rank>_<n>.distcp
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
    _write_json(os.path.join(tmp, f".manifest.rank{rank}.json"),
                {name: _file_entry(os.path.join(tmp, name)) for name in sorted(os.listdir(tmp))
                 if _writer(name, world) == rank and not name.startswith(".manifest.rank")})
    dist.barrier()
    if rank == 0:
        lay = learner.layout
        _write_json(os.path.join(tmp, "layout.json"),
                    {"tp": lay.tp, "pp": lay.pp, "dp": lay.dp, "ep": lay.ep, "cp": lay.cp, "vpp": lay.vpp, "step": step,
                     "learner_steps": learner.steps, "model_only": model_only,
                     "distributed_optimizer": learner.optim_cfg.use_distributed_optimizer,
                     "optimizer_sharding": learner.optim_cfg.checkpoint_sharding})
        if not model_only:
            _write_json(os.path.join(tmp, "scheduler.json"), learner.scheduler.state_dict())
        _write_json(os.path.join(tmp, "trainer_state.json"), trainer_state or {})
        _write_manifest(tmp, world)
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
        _write_latest(root, _step_dir(step))
        _prune(root, keep_last)
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


def _writer(name: str, world: int) -> int:
    """The rank that wrote (and so flushes and checksums) a checkpoint file: a shard's own rank,
    rank 0 for the rest (metadata, common state)."""
    m = _SHARD.match(name)
    return int(m.group(1)) if m and int(m.group(1)) < world else 0


def _crc32c_extend():
    """google-crc32c's hardware CRC-32C (SSE4.2 / ARMv8), or None where it is not installed."""
    try:
        import google_crc32c
    except ImportError:
        return None
    return google_crc32c.extend


def _checksum(f, algorithm: str) -> int:
    """`algorithm` ("crc32c" or "crc32") of an open file from its current position to the end,
    16 MiB at a time."""
    crc, extend = 0, (_crc32c_extend() if algorithm == "crc32c" else None)
    if algorithm == "crc32c" and extend is None:
        raise ChecksumUnavailable("google-crc32c")
    while chunk := f.read(1 << 24):
        crc = extend(crc, chunk) if extend else zlib.crc32(chunk, crc)
    return crc


class ChecksumUnavailable(RuntimeError):
    """A manifest's checksum needs a package this environment lacks."""


def _file_entry(path: str) -> dict:
    """Flush a file to disk; its size and checksum: CRC-32C where google-crc32c is installed (about
    2.7x zlib's CRC-32 here, 10.6 vs 3.9 GB/s), else CRC-32; the manifest names which."""
    algorithm = "crc32c" if _crc32c_extend() is not None else "crc32"
    with open(path, "rb") as f:
        crc = _checksum(f, algorithm)
        os.fsync(f.fileno())
        return {"size": f.tell(), algorithm: crc}


def _write_json(path: str, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_manifest(tmp: str, world: int) -> None:
    """Rank 0, last before the rename: every rank's entries and rank 0's own files in one manifest."""
    files: dict[str, dict] = {}
    for r in range(world):
        part = os.path.join(tmp, f".manifest.rank{r}.json")
        with open(part) as f:
            files.update(json.load(f))
        os.remove(part)
    for name in ("layout.json", "scheduler.json", "trainer_state.json"):
        if os.path.exists(os.path.join(tmp, name)):
            files[name] = _file_entry(os.path.join(tmp, name))
    missing = sorted(set(os.listdir(tmp)) - set(files))
    if missing:  # a file no rank claimed: written by a rank this save did not expect
        raise RuntimeError(f"checkpoint {tmp}: files not in any rank's manifest: {missing}")
    _write_json(os.path.join(tmp, MANIFEST), {"files": files})
    _fsync_dir(tmp)


def _write_latest(root: str, name: str) -> None:
    tmp = os.path.join(root, f".{LATEST}.tmp")
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, LATEST))
    _fsync_dir(root)


def _prune(root: str, keep_last: int) -> None:
    done = sorted(d for d in os.listdir(root) if d.startswith("step_"))
    for d in done[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(os.path.join(root, d), ignore_errors=True)


def checkpoint_candidates(root: str) -> list[str]:
    """The renamed (complete when written) checkpoints under root, newest first."""
    if not os.path.isdir(root):
        return []
    done = sorted((d for d in os.listdir(root) if d.startswith("step_")
                   and os.path.exists(os.path.join(root, d, "layout.json"))), reverse=True)
    return [os.path.join(root, d) for d in done]


def checkpoint_root(ckpt: str) -> str:
    """The root of a checkpoint given as its root (which holds hf/) or as one step directory."""
    ckpt = ckpt.rstrip("/")
    return ckpt if os.path.isdir(os.path.join(ckpt, HF_META_DIR)) else os.path.dirname(ckpt)


def latest_checkpoint(root: str) -> str | None:
    """The newest complete checkpoint under root, or None."""
    path = os.path.join(root, LATEST)
    if os.path.exists(path):
        with open(path) as f:
            name = f.read().strip()
        # a step directory's name only: `latest` never leads out of the tree (an absolute path, ..)
        candidate = os.path.join(root, name) if name and "/" not in name and not name.startswith(".") else ""
        if not candidate:
            log.warning("%s names %r, not a checkpoint of this directory: ignored", path, name[:200])
        elif os.path.exists(os.path.join(candidate, "layout.json")):
            return candidate
    # `latest` may lag a completed rename if the process died in between: fall back to a scan.
    done = checkpoint_candidates(root)
    return done[0] if done else None


def verify_checkpoint(path: str, part: int = 0, parts: int = 1) -> str:
    """Why the checkpoint's files do not match its manifest ("" if they do), checking the files
    `part` of `parts` (so that the ranks of a resume share the reading). A checkpoint from before
    manifests existed is not checked here; its load is."""
    manifest = os.path.join(path, MANIFEST)
    if not os.path.exists(manifest):
        return ""
    try:
        with open(manifest) as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError) as e:
        return f"{manifest} is unreadable ({type(e).__name__}: {e})"
    for name in sorted(files)[part::parts]:
        want, file = files[name], os.path.join(path, name)
        if not os.path.exists(file):
            return f"{file} is missing"
        size = os.path.getsize(file)
        if size != want["size"]:
            return f"{file} has {size} bytes, its manifest says {want['size']}"
        algorithm = "crc32c" if "crc32c" in want else "crc32"  # manifests before CRC-32C say crc32
        try:
            with open(file, "rb") as f:
                crc = _checksum(f, algorithm)
        except ChecksumUnavailable:
            return f"{manifest} checksums with CRC-32C: install google-crc32c to verify {file}"
        if crc != want.get(algorithm):
            name = "CRC-32C" if algorithm == "crc32c" else "CRC-32"
            return f"{file} fails its {name} (manifest {want.get(algorithm)}, file {crc})"
    return ""


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
                _write_latest(root, os.path.basename(path))
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

    check_checkpoint_tree(path)  # right before the load: what it unpickles is ours (security review 2)
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
