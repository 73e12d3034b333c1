"""SPICE, Algorithm 1, top to bottom.

Every learner rank runs `train` (SPMD, under torchrun or srun). Global rank 0 is also the driver
(loop/driver.py; with run.driver=process, a process of its own beside rank 0): it owns the corpus, talks
to the rollout fleet, verifies answers, computes rewards and writes the logs; the training sequences
it builds are broadcast to every learner rank.

One iteration:
  1. sample B documents from the corpus
  2. challenger: attempts per document until one is a valid task (<= N);
     its group: G attempts, valid:invalid ratio kept                      (rollout fleet)
  3. reasoner: G answers per valid task of a group, without the document  (rollout fleet)
  4. verify answers; rewards; advantages centred per document (challenger)
     and per question (reasoner, one task per document)                   (driver)
  5. DrGRPO steps on the learner, train.trajectories_per_update each     (all ranks)
  6. stream the new weights to the engines, verified by checksums       (stage senders, through
                                                                          vLLM's weight-transfer API)
  7. log metrics and the audit trail; kill switch; checkpoint every k

The engines' upkeep (asleep during step 5 when colocated, step 6, their recovery) has one owner,
loop/engines.py; checkpoints and stops are loop/run_guard.py's. With run.colocate the engines and
the learner share the GPUs and take turns (loop/colocation.py).

Streamed (run.streamed), steps 2-4 run per document, not per phase (selfplay/schedule.py); with
several optimizer steps per batch the learner runs the old log-probs of step 5 for the documents
already complete while the others roll out (loop/streamed_forward.py).

With train.max_staleness=1 (one step off policy) steps 1-4 of iteration t+1 run on the engines,
in the background on the driver, while the learner takes step 5 of iteration t; the engines get
the new weights once both are done, and iteration t+1 trains on a batch one version old.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable

from spice_megatron.config import SpiceConfig
from spice_megatron.loop.batch_delivery import BatchDelivery
from spice_megatron.loop.colocation import offload_learner
from spice_megatron.loop.driver import Driver, KillSwitch
from spice_megatron.loop.driver_process import DriverProcess
from spice_megatron.loop.engines import Engines
from spice_megatron.loop.interfaces import RolloutBatch, RolloutDriver
from spice_megatron.loop.rollout_sources import rollout_source
from spice_megatron.loop.run_guard import RunGuard
from spice_megatron.policy.parallel import broadcast_from_driver as _broadcast
from spice_megatron.run.control import KILL_SWITCH_FILE, STOP_FILE, StopRequest, kill_switch_refusal
from spice_megatron.run.lock import hold_run_dir

log = logging.getLogger("spice.trainer")


def _iteration_stats(batch: RolloutBatch, steps: list, sync: dict, learner_version: int) -> dict[str, float]:
    """One iteration's metrics: the batch's rollout statistics, the learner's steps, the sync, and
    the staleness of what was trained (learner version minus the oldest version of each sequence)."""
    stats = {**batch.stats, **_merged_steps(steps)}
    stats.update(sync)
    stats["time/train"] = sum(m.seconds for m in steps)
    for phase in ("challenger", "reasoner"):
        secs = stats.get(f"time/{phase}_rollout", 0.0)
        stats[f"tokens_per_s/{phase}"] = stats[f"tokens/{phase}"] / secs if secs else 0.0
    if steps and stats["time/train"]:
        stats["tokens_per_s/train"] = sum(m.tokens for m in steps) / stats["time/train"]
    stats["weights_version"] = learner_version + 1
    stats["rollout_version"] = batch.version
    for role in ("challenger", "reasoner"):
        lags = [learner_version - min((v for v, _, _ in x.versions or ()), default=batch.version)
                for x in batch.seqs if x.role == role]
        if lags:
            stats[f"staleness/{role}_lag_mean"] = sum(lags) / len(lags)
            stats[f"staleness/{role}_lag_max"] = float(max(lags))
    return stats


_SUMMED = ("tokens", "tokens_run", "sequences", "trained_sequences", "seconds")


def _merged_steps(steps: list) -> dict[str, float]:
    """The iteration's optimiser steps as one set of train/ metrics (the same names for one step or
    several): counts and seconds summed, maxima the largest, the learning rate the last, the rest
    the mean."""
    rows = [m.as_dict() for m in steps]
    out: dict[str, float] = {"train/steps": float(len(rows))}
    for k in dict.fromkeys(k for r in rows for k in r):
        values = [r[k] for r in rows if k in r]
        out[f"train/{k}"] = (sum(values) if k in _SUMMED else values[-1] if k == "lr" else
                             max(values) if k == "grad_norm" or "max" in k else sum(values) / len(values))
    return out


EvalHook = Callable[[int, Any], dict[str, float]]  # (iteration, rollout fleet) -> metrics, on the driver


def train(cfg: SpiceConfig, resume: bool = False, eval_hook: EvalHook | None = None,
          resume_after_kill_switch: bool = False) -> dict[str, Any]:
    """Run SPICE. `eval_hook` is called on the driver every run.eval_every iterations, at the last
    one and, on a new run, before the first (iteration 0: the base model), with the rollout fleet
    (which holds the current weights); its metrics are logged under eval/.
    A run the kill switch stopped is not resumed (a scheduler's requeue would otherwise train on
    from the collapse) unless `resume_after_kill_switch`. Rank 0 holds the run directory's lock
    for the whole run (run/lock.py): a second run on it refuses (RunDirLocked)."""
    from spice_megatron.bridge.hf_io import resolve_model_dir
    from spice_megatron.policy.parallel import control_group, init_distributed

    cfg.validate()
    cfg.run.model = resolve_model_dir(cfg.run.model)
    layout = init_distributed(cfg.parallel, seed=cfg.train.seed,
                              expandable_segments=cfg.rollout.weight_transfer != "ipc")
    control = control_group(cfg.run.driver_timeout)
    with hold_run_dir(cfg.run.output_dir, cfg.run.lock_wait_s, layout.rank == 0, control, cfg.run.group_readable):
        return _train(cfg, layout.rank == 0, control, resume, eval_hook, resume_after_kill_switch)


def _train(cfg: SpiceConfig, is_driver: bool, control, resume: bool, eval_hook: EvalHook | None,
           resume_after_kill_switch: bool) -> dict[str, Any]:
    from tqdm.auto import tqdm

    learner, driver, state, latest = _start(cfg, is_driver, control, resume, resume_after_kill_switch)
    deliver = BatchDelivery(learner, control)
    rollouts = rollout_source(cfg, driver, learner, deliver, control, state)  # on-policy, one step off, overlapped
    guard = RunGuard(cfg, learner, rollouts, state["iteration"] if latest else -1, is_driver)  # checkpoints, stops
    engines = Engines(cfg, learner, driver, control, save_before_stop=guard.save_unless_held)
    iteration, version = state["iteration"], state["version"]
    _engines_at_start(cfg, engines, driver, eval_hook, version)  # the checkpoint's weights, or the base model measured
    summary: dict[str, Any] = {}
    progress = tqdm(total=cfg.run.iterations, initial=iteration, desc="SPICE", disable=not is_driver)
    stop_request = StopRequest(guard.stop_file)
    t_start = time.perf_counter()
    try:
        while iteration < cfg.run.iterations:
            t_iter = time.perf_counter()
            # 1-4. documents -> tasks -> answers -> rewards -> advantages (on the driver)
            got = rollouts.collect(iteration, version)
            lost, abandoned = _broadcast((got.lost, got.abandoned), control)
            seqs, routing_volume = deliver(got.batch.seqs if got.batch else None)  # MoE routing where it is used
            if lost:  # every engine died: bring them back with the current weights, then roll out again
                engines.recover(lost, iteration, version, sync=True)
                continue
            if abandoned:  # STOP during the rollouts: keep what the iterations before it did
                guard.stop_requested(iteration, version,
                                     f"abandoned iteration {iteration + 1} (STOP during its rollouts)")
            # 5. DrGRPO on the learner (refusing samples older than train.max_staleness); colocated,
            # the engines sleep meanwhile
            engines.sleep(iteration + 1)
            steps = learner.train_on_batch(seqs, version=version, old_logprobs=got.old_logprobs) if seqs else []
            engines.wake_for_sync()
            version += 1
            lost, t_wait = rollouts.wait()  # one step off: the next batch, rolled out meanwhile
            # 6. the new weights to the engines (lost or dead ones brought back first)
            sync = engines.update(lost, version)
            iteration += 1
            # 7. logs; rank 0 decides for all (its kill switch, its Ctrl-C or SIGTERM); a checkpoint
            stop = ""
            if driver:
                now = time.perf_counter()
                summary = {**_iteration_stats(got.batch, steps, sync, version - 1), **routing_volume,
                           **engines.stats(), **got.stats, "time/wait_for_rollouts": t_wait,
                           "time/iteration": now - t_iter, "time/elapsed": now - t_start}
                stop = _log_iteration(cfg, driver, eval_hook, iteration, got.batch, steps, summary, progress)
            stop, interrupted = _broadcast((stop, stop_request.requested_after(iteration)) if driver else None, control)
            if not (stop or interrupted):
                rollouts.start_next(iteration + 1, version)  # one step off: they overlap the checkpoint too
            guard.end_iteration(iteration, version, stop, interrupted)
    finally:
        stop_request.restore()
        progress.close()
        if driver:
            driver.close()
    _export(cfg, learner)
    return summary


def _start(cfg: SpiceConfig, is_driver: bool, control, resume: bool, resume_after_kill_switch: bool):
    """The learner (from the base model or the newest usable checkpoint), the driver on rank 0 (in
    this process or one of its own) and the trainer state to continue from."""
    from transformers import AutoTokenizer

    from spice_megatron.selfplay.context_budget import check_context_budget_once

    tokenizer = AutoTokenizer.from_pretrained(cfg.run.model)
    check_context_budget_once(cfg, tokenizer)  # before the learner loads and the engines start (the CLI may have)
    ckpt_root = os.path.join(cfg.run.output_dir, "checkpoints")
    learner, state, latest = _load_learner(cfg, is_driver, control, resume, resume_after_kill_switch, tokenizer,
                                           ckpt_root)
    stop_file = os.path.join(cfg.run.output_dir, STOP_FILE)
    driver: RolloutDriver | None = None
    if is_driver and cfg.run.driver == "process":
        driver = DriverProcess(cfg, state.get("driver"), stop_file)
    elif is_driver:
        driver = Driver(cfg, tokenizer, state.get("driver"), abandon_when=lambda: os.path.exists(stop_file))
    kill_marker = os.path.join(cfg.run.output_dir, KILL_SWITCH_FILE)
    if is_driver and os.path.exists(kill_marker):  # from an earlier attempt, resumed past it on purpose
        os.remove(kill_marker)
    return learner, driver, state, latest


def _export(cfg: SpiceConfig, learner) -> None:
    """The final weights as a Hugging Face checkpoint (run.export_hf)."""
    from spice_megatron.bridge.convert import save_hf_checkpoint
    from spice_megatron.policy.checkpoint_files import HF_META_DIR

    if cfg.run.export_hf:
        save_hf_checkpoint(learner, os.path.join(cfg.run.output_dir, "hf_final"),
                           os.path.join(cfg.run.output_dir, "checkpoints", HF_META_DIR))


def _engines_at_start(cfg: SpiceConfig, engines: Engines, driver: RolloutDriver | None, eval_hook: EvalHook | None,
                      version: int) -> None:
    """The engines start from the base model: a resumed run brings them to its checkpoint's weights;
    a new one with evaluations measures the base model first, logged as iteration 0 (what the last
    evaluation is compared with)."""
    if version > 0:
        engines.load(version)
    elif driver and eval_hook and cfg.run.eval_every and cfg.run.eval_before:
        driver.log(0, _evaluate(eval_hook, 0, driver.fleet), [])


def _evaluate(eval_hook: EvalHook, iteration: int, fleet) -> dict[str, float]:
    t_eval = time.perf_counter()
    stats = {f"eval/{k}": v for k, v in eval_hook(iteration, fleet).items()}
    return {**stats, "time/eval": time.perf_counter() - t_eval}


def _log_iteration(cfg: SpiceConfig, driver: RolloutDriver, eval_hook: EvalHook | None, iteration: int,
                   batch: RolloutBatch, steps: list, stats: dict[str, float], progress) -> str:
    """Step 7 on the driver: the evaluation when one is due (added to `stats`), the metrics and the
    audit trail, the progress bar, the kill switch. Returns why the kill switch stops the run ("":
    it does not)."""
    if eval_hook and cfg.run.eval_every and (iteration % cfg.run.eval_every == 0 or iteration == cfg.run.iterations):
        stats.update(_evaluate(eval_hook, iteration, driver.fleet))
    driver.log(iteration, stats, batch.records)
    progress.update(1)
    progress.set_postfix(valid=f"{stats['valid_task_rate']:.2f}", pass_rate=f"{stats['reasoner/pass_rate']:.2f}",
                         loss=f"{stats.get('train/loss', 0.0):.4f}")
    try:
        driver.check_kill_switch(stats, steps[-1].loss if steps else 0.0, steps[-1].grad_norm if steps else 0.0)
    except KillSwitch as e:
        return str(e)
    return ""


def _load_learner(cfg: SpiceConfig, is_driver: bool, control, resume: bool, resume_after_kill_switch: bool,
                  tokenizer, ckpt_root: str) -> tuple[Any, dict[str, Any], str | None]:
    """The learner: the base model (HF -> Megatron), or on resume the newest checkpoint that matches
    its manifest and loads (a damaged one is named and the one before it used); a run the kill
    switch stopped is refused unless `resume_after_kill_switch`. Returns the learner, the trainer
    state to continue from and the checkpoint it came from."""
    from spice_megatron.bridge.convert import copy_hf_metadata, write_training_prompts
    from spice_megatron.bridge.hf_io import learner_from_hf
    from spice_megatron.policy.checkpoint import resumable_checkpoint
    from spice_megatron.policy.checkpoint_files import HF_META_DIR

    refusal = kill_switch_refusal(cfg.run.output_dir, is_driver) if resume and not resume_after_kill_switch else ""
    if refusal:
        raise KillSwitch(refusal)
    learner = learner_from_hf(cfg.run.model, cfg.parallel, cfg.optim, cfg.train, pad_id=tokenizer.pad_token_id or 0)
    latest, loaded = resumable_checkpoint(learner, ckpt_root, control) if resume else (None, {})
    state: dict[str, Any] = {"iteration": 0, "version": 0, **loaded}
    if resume and latest is None and is_driver:
        log.warning("--resume: no checkpoint under %s; starting from the base model", ckpt_root)
    if cfg.run.colocate:  # the learner's optimizer state leaves the GPUs before the engines start on them
        offload_learner(learner)
    if is_driver:
        copy_hf_metadata(cfg.run.model, os.path.join(ckpt_root, HF_META_DIR))
        write_training_prompts(cfg, os.path.join(ckpt_root, HF_META_DIR))
    return learner, state, latest
