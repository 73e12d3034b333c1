"""SPICE, Algorithm 1, top to bottom.

Every learner rank runs `train` (SPMD, under torchrun or srun). Global rank 0 is also the driver
(driver.py; with run.driver=process, a process of its own beside rank 0): it owns the corpus, talks
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

With run.colocate the engines and the learner share the GPUs and take turns (colocation.py): the
engines sleep during step 5 and wake for step 6.

Streamed (run.streamed), steps 2-4 run per document, not per phase (rollout/schedule.py); with
several optimizer steps per batch the learner runs the old log-probs of step 5 for the documents
already complete while the others roll out (streamed_forward.py).

With train.max_staleness=1 (one step off policy) steps 1-4 of iteration t+1 run on the engines,
in the background on the driver, while the learner takes step 5 of iteration t; the engines get
the new weights once both are done, and iteration t+1 trains on a batch one version old.
"""
from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Future
from typing import Any, Callable

from spice_megatron.batch_delivery import BatchDelivery
from spice_megatron.colocation import Colocation, offload_learner
from spice_megatron.config import SpiceConfig
from spice_megatron.driver import Driver, EnginesLost, IterationAbandoned, KillSwitch, RolloutBatch
from spice_megatron.driver_process import DriverProcess
from spice_megatron.engine_weights import WeightSync
from spice_megatron.policy.parallel import broadcast_from_driver as _broadcast
from spice_megatron.rollout.fleet import NoEngineLeft
from spice_megatron.run_control import KILL_SWITCH_FILE, STOP_FILE, STOPPED_FILE, StopRequest, write_marker
from spice_megatron.run_lock import hold_run_dir
from spice_megatron.streamed_forward import overlaps, rollouts_with_old_logprobs

log = logging.getLogger("spice.trainer")


class Interrupted(RuntimeError):
    """Ctrl-C, SIGTERM or a STOP file: the run saved a checkpoint and stopped (after its iteration,
    or, for a STOP during the rollouts, dropping the iteration in progress)."""


def _iteration_stats(batch: RolloutBatch, steps: list, sync: dict, learner_version: int) -> dict[str, float]:
    """One iteration's metrics: the batch's rollout statistics, the learner's steps, the sync, and
    the staleness of what was trained (learner version minus the oldest version of each sequence)."""
    stats = dict(batch.stats)
    for i, m in enumerate(steps):
        stats.update({f"train/{k}" + (f"_{i}" if i else ""): v for k, v in m.as_dict().items()})
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


EvalHook = Callable[[int, Any], dict[str, float]]  # (iteration, rollout fleet) -> metrics, on the driver


def train(cfg: SpiceConfig, resume: bool = False, eval_hook: EvalHook | None = None,
          resume_after_kill_switch: bool = False) -> dict[str, Any]:
    """Run SPICE. `eval_hook` is called on the driver every run.eval_every iterations with the
    rollout fleet (which holds the current weights); its metrics are logged under eval/.
    A run the kill switch stopped is not resumed (a scheduler's requeue would otherwise train on
    from the collapse) unless `resume_after_kill_switch`. Rank 0 holds the run directory's lock
    for the whole run (run_lock.py): a second run on it refuses (RunDirLocked)."""
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
    from transformers import AutoTokenizer

    from spice_megatron.bridge.convert import save_hf_checkpoint
    from spice_megatron.context_budget import check_context_budget_once
    from spice_megatron.policy.checkpoint import HF_META_DIR, save_checkpoint

    ckpt_root = os.path.join(cfg.run.output_dir, "checkpoints")
    kill_marker = os.path.join(cfg.run.output_dir, KILL_SWITCH_FILE)
    tokenizer = AutoTokenizer.from_pretrained(cfg.run.model)
    check_context_budget_once(cfg, tokenizer)  # before the learner loads and the engines start (the CLI may have)
    learner, state, latest = _load_learner(cfg, is_driver, control, resume, resume_after_kill_switch, tokenizer,
                                           ckpt_root, kill_marker)
    stop_file = os.path.join(cfg.run.output_dir, STOP_FILE)
    driver: Driver | DriverProcess | None = None
    if is_driver and cfg.run.driver == "process":
        driver = DriverProcess(cfg, state.get("driver"), stop_file)
    elif is_driver:
        driver = Driver(cfg, tokenizer, state.get("driver"), abandon_when=lambda: os.path.exists(stop_file))
    colocation = Colocation(cfg, learner, driver, control)
    weights = WeightSync(cfg, learner, driver, control, after_restart=colocation.before_sync)
    deliver = BatchDelivery(learner, control)
    if state["version"] > 0:  # engines start from the base model: bring them to the checkpoint's weights
        colocation.before_sync()
        weights.sync(state["version"])
        colocation.after_sync()

    # At staleness 1 the rollouts of the next iteration run while the learner steps (step 1-4 of
    # iteration t+1 during 5 of t): `ready` is a finished batch waiting for the learner, `pending`
    # the rollouts in flight and `snapshot` the driver's sampler/RNG from before they started.
    off_policy = cfg.train.max_staleness > 0
    overlapped = overlaps(cfg)  # on-policy, disaggregated, streamed, several steps per batch
    ready = RolloutBatch.from_json(state["ready"]) if driver and state.get("ready") else None
    pending: Future | None = None
    snapshot: dict = {}

    saved = [state["iteration"] if latest else -1]  # the iteration the newest checkpoint holds

    def save(done: int, held: int, kill_switch: str = "") -> None:
        trainer_state = {"iteration": done, "version": held,
                         "driver": {**driver.state(), **snapshot} if driver else None,
                         "ready": ready.to_json() if ready else None}
        if kill_switch:
            trainer_state["kill_switch"] = kill_switch
        save_checkpoint(learner, ckpt_root, done, trainer_state, cfg.run.keep_last)  # rank 0 writes it
        saved[0] = done

    def stop_requested(done: int, held: int, why: str, raise_: bool = True) -> None:
        """Ctrl-C, SIGTERM or a STOP file: a checkpoint of the `done` iterations (unless the newest
        holds them already), the STOP file consumed (the next attempt runs on), the STOPPED marker
        that tells the job script this was no failure; then Interrupted."""
        if done > saved[0] and done > 0:
            save(done, held)
        if is_driver and os.path.exists(stop_file):
            os.remove(stop_file)
        write_marker(os.path.join(cfg.run.output_dir, STOPPED_FILE), "stop requested", is_driver)
        if raise_:
            where = f"after iteration {done} with a checkpoint" if done else "before iteration 1 (nothing to save)"
            raise Interrupted(f"{why + '; ' if why else ''}stopped {where}; continue with --resume")

    def recover(why: str, done: int | None) -> None:
        """No rollout engine is left: the driver restarts those it started (or waits for a cluster's)
        and the sync group is formed anew. If none comes back, the run stops; with `done`, after a
        checkpoint of the `done` iterations finished (the learner holds their weights), else from
        the last checkpoint. --resume continues either."""
        reason = _broadcast(driver.recover_engines(why) if driver else "", control)
        if reason:
            if done is not None and done > saved[0]:
                save(done, version)
            at = f"a checkpoint after iteration {done}" if done is not None else "the last checkpoint"
            raise EnginesLost(f"{reason}; the run stopped: continue from {at} with --resume")
        weights.reform()
        colocation.before_sync()  # restarted engines start awake: their KV cache waits for the sync

    if is_driver and os.path.exists(kill_marker):  # from an earlier attempt, resumed past it on purpose
        os.remove(kill_marker)
    summary: dict[str, Any] = {}
    iteration, version = state["iteration"], state["version"]
    progress = tqdm(total=cfg.run.iterations, initial=iteration, desc="SPICE", disable=not is_driver)
    stop_request = StopRequest(stop_file)
    t_start = time.perf_counter()
    try:
        while iteration < cfg.run.iterations:
            t_iter = time.perf_counter()
            # 1-4. documents -> tasks -> answers -> rewards -> advantages (driver only). One step off:
            # the batch finished during the last step, and the next one starts now, on these weights.
            batch, lost, abandoned, old_logprobs, overlap = None, "", False, None, {}
            if overlapped:  # every rank: the old log-probs of the documents done while the others roll out
                batch, lost, abandoned, old_logprobs, overlap = rollouts_with_old_logprobs(
                    driver, learner, deliver, control, iteration, version)
            elif driver:
                try:
                    batch = ready if off_policy and ready else driver.selfplay(iteration, version)
                except NoEngineLeft as e:
                    lost = str(e)
                except IterationAbandoned:
                    abandoned = True
                ready = None
                if batch and off_policy and pending is None and iteration + 1 < cfg.run.iterations:
                    pending, snapshot = driver.start_selfplay(iteration + 1, version)
            lost, abandoned = _broadcast((lost, abandoned), control)
            seqs, routing_volume = deliver(batch.seqs if batch else None)  # MoE routing only where it is used
            if lost:  # every engine died: bring them back with the current weights, then roll out again
                recover(lost, iteration)
                weights.sync(version)
                colocation.after_sync()
                continue
            if abandoned:  # STOP during the rollouts: keep what the iterations before it did
                stop_requested(iteration, version, f"abandoned iteration {iteration + 1} (STOP during its rollouts)")
            # 5. DrGRPO on the learner (refusing samples older than train.max_staleness); colocated,
            # the engines sleep meanwhile
            colocation.before_step(iteration + 1)
            steps = learner.train_on_batch(seqs, version=version, old_logprobs=old_logprobs) if seqs else []
            colocation.after_step()
            version += 1
            t_wait = time.perf_counter()
            lost = ""
            if pending is not None:  # the engines keep the old weights until these rollouts are done
                try:
                    ready = pending.result()
                except NoEngineLeft as e:  # the next iteration rolls out again, on-policy
                    ready, lost = None, str(e)
                except IterationAbandoned:  # the STOP is honoured after this iteration, as any stop
                    ready = None
                pending, snapshot = None, {}
            t_wait = time.perf_counter() - t_wait
            # 6. new weights to the engines; an engine that died during the rollouts (the fleet
            # served its requests elsewhere) is restarted first and the sync group formed anew
            lost = _broadcast(lost, control)
            if lost:  # they get the new weights just below
                recover(lost, None)
            elif _broadcast(driver.restart_dead_engines() if driver else False, control):
                weights.reform()
                colocation.before_sync()
            sync = weights.sync(version)
            colocation.after_sync()
            iteration += 1
            # 7. logs, kill switch, checkpoint
            stop = ""
            if driver:  # time/elapsed: since this process started training
                summary = {**_iteration_stats(batch, steps, sync, version - 1), **routing_volume, **colocation.stats(),
                           **overlap, "time/wait_for_rollouts": t_wait, "time/iteration": time.perf_counter() - t_iter,
                           "time/elapsed": time.perf_counter() - t_start}
                stop = _log_iteration(cfg, driver, eval_hook, iteration, batch, steps, summary, progress)
            # rank 0 decides for all: its kill switch, and its Ctrl-C / SIGTERM
            stop, interrupted = _broadcast((stop, stop_request.requested_after(iteration)) if driver else None, control)
            if driver and off_policy and not (stop or interrupted) and iteration + 1 < cfg.run.iterations:
                pending, snapshot = driver.start_selfplay(iteration + 1, version)  # overlaps the checkpoint too
            if stop or interrupted or iteration % cfg.run.checkpoint_every == 0 or iteration == cfg.run.iterations:
                save(iteration, version, kill_switch=stop)
            if stop:
                write_marker(kill_marker, stop, is_driver)
                raise KillSwitch(f"stopped the run: {stop} (a checkpoint was saved)")
            if interrupted:  # after the last iteration there is nothing left to stop
                stop_requested(iteration, version, "", raise_=iteration < cfg.run.iterations)
    finally:
        stop_request.restore()
        progress.close()
        if driver:
            driver.close()
    if cfg.run.export_hf:
        save_hf_checkpoint(learner, os.path.join(cfg.run.output_dir, "hf_final"), os.path.join(ckpt_root, HF_META_DIR))
    return summary


def _log_iteration(cfg: SpiceConfig, driver, eval_hook: EvalHook | None, iteration: int, batch: RolloutBatch,
                   steps: list, stats: dict[str, float], progress) -> str:
    """Step 7 on the driver: the evaluation when one is due (added to `stats`), the metrics and the
    audit trail, the progress bar, the kill switch. Returns why the kill switch stops the run ("":
    it does not)."""
    if eval_hook and cfg.run.eval_every and iteration % cfg.run.eval_every == 0:
        t_eval = time.perf_counter()
        stats.update({f"eval/{k}": v for k, v in eval_hook(iteration, driver.fleet).items()})
        stats["time/eval"] = time.perf_counter() - t_eval
    driver.log(iteration, stats, batch.records)
    progress.update(1)
    progress.set_postfix(valid=f"{stats['valid_task_rate']:.2f}", pass_rate=f"{stats['reasoner_pass_rate']:.2f}",
                         loss=f"{stats.get('train/loss', 0.0):.4f}")
    try:
        driver.check_kill_switch(stats, steps[-1].loss if steps else 0.0, steps[-1].grad_norm if steps else 0.0)
    except KillSwitch as e:
        return str(e)
    return ""


def _load_learner(cfg: SpiceConfig, is_driver: bool, control, resume: bool, resume_after_kill_switch: bool,
                  tokenizer, ckpt_root: str, kill_marker: str) -> tuple[Any, dict[str, Any], str | None]:
    """The learner: the base model (HF -> Megatron), or on resume the newest checkpoint that matches
    its manifest and loads (a damaged one is named and the one before it used); a run the kill
    switch stopped is refused unless `resume_after_kill_switch`. Returns the learner, the trainer
    state to continue from and the checkpoint it came from."""
    from spice_megatron.bridge.convert import copy_hf_metadata, write_training_prompts
    from spice_megatron.policy.checkpoint import HF_META_DIR, latest_checkpoint, read_trainer_state, resumable_checkpoint
    from spice_megatron.policy.learner import Learner

    newest = latest_checkpoint(ckpt_root) if resume else None
    try:
        stopped = read_trainer_state(newest).get("kill_switch") if newest else None
    except (OSError, ValueError):  # a damaged checkpoint: the resume below names it and passes it over
        stopped = None
    if stopped and not resume_after_kill_switch:
        write_marker(kill_marker, stopped, is_driver)
        raise KillSwitch(f"not resuming: the kill switch stopped this run at {os.path.basename(newest)} ({stopped}); "
                         "pass --resume-after-kill-switch to continue it anyway")
    learner = Learner.from_hf(cfg.run.model, cfg.parallel, cfg.optim, cfg.train, pad_id=tokenizer.pad_token_id or 0)
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
