"""SPICE, Algorithm 1, top to bottom.

Every learner rank runs `train` (SPMD, under torchrun or srun). Global rank 0 is also the driver:
it owns the corpus, talks to the rollout fleet, verifies answers, computes rewards and writes the
logs; the training sequences it builds are broadcast to every learner rank.

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

With train.max_staleness=1 (one step off policy) steps 1-4 of iteration t+1 run on the engines,
in the background on the driver, while the learner takes step 5 of iteration t; the engines get
the new weights once both are done, and iteration t+1 trains on a batch one version old.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import random
import secrets
import signal
import subprocess
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from spice_megatron.config import SpiceConfig
from spice_megatron.policy.batching import TrainSequence

log = logging.getLogger("spice.trainer")


class KillSwitch(RuntimeError):
    """The run stopped itself (non-finite loss, no valid tasks, reward collapse)."""


class Interrupted(RuntimeError):
    """Ctrl-C or SIGTERM: the run finished its iteration, saved a checkpoint and stopped."""


# Files in the run directory that talk to the job script. torchrun turns every worker exit code into
# 1, and a signal to torchrun gives the workers only 30 s before SIGKILL, so neither exit codes nor
# signals reach a Slurm script reliably through it.
STOP_FILE = "STOP"  # created by the job script (time limit near): stop after this iteration, with a checkpoint
KILL_SWITCH_FILE = "KILL_SWITCH"  # written by rank 0 when the kill switch stops the run: do not requeue


class StopRequest:
    """The first Ctrl-C (or SIGTERM, as Slurm sends before a kill), or a STOP file in the run
    directory, asks the loop to stop after the current iteration, with a checkpoint that resumes
    exactly; a second signal aborts at once."""

    def __init__(self, stop_file: str = "") -> None:
        self.signalled = False
        self.stop_file = stop_file
        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)

    @property
    def requested(self) -> bool:
        return self.signalled or bool(self.stop_file and os.path.exists(self.stop_file))

    def _handle(self, signum, frame) -> None:
        if self.signalled:  # a second signal of either kind
            raise KeyboardInterrupt
        self.signalled = True
        log.warning("%s: stopping after this iteration with a checkpoint (Ctrl-C again to abort without one)",
                    signal.Signals(signum).name)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


@dataclass
class RolloutBatch:
    """One iteration's rollouts: what the learner trains on and what is logged for it. At
    staleness 1 a finished batch waits one iteration, so a checkpoint holds it (JSON)."""

    iteration: int
    version: int  # the engines' weights when its rollouts started
    stats: dict[str, float]
    records: list[dict]
    seqs: list[TrainSequence]

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "seqs": [dataclasses.asdict(x) for x in self.seqs]}

    @classmethod
    def from_json(cls, d: dict) -> "RolloutBatch":
        return cls(d["iteration"], d["version"], d["stats"], d["records"], [TrainSequence(**x) for x in d["seqs"]])


def _broadcast(obj: Any, group) -> Any:
    """Rank 0's object on every rank, over the gloo control group (see policy.parallel.control_group)."""
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


class Driver:
    """Rank 0's side of the loop: corpus, rollout fleet, verifier, logs."""

    def __init__(self, cfg: SpiceConfig, tokenizer, resume_state: dict | None):
        from spice_megatron.corpus import Corpus, DocumentSampler
        from spice_megatron.rollout.fleet import RolloutFleet
        from spice_megatron.run_log import JsonlLog, MetricsLogger
        from spice_megatron.verify import AnswerVerifier

        self.cfg, self.tokenizer = cfg, tokenizer
        out = cfg.run.output_dir
        if cfg.selfplay.challenger == "tasks":  # a task file stands in for the challenger
            from spice_megatron.task_pool import TaskPool

            self.corpus = TaskPool(cfg.selfplay.tasks_file)
        else:
            self.corpus = Corpus.build(cfg.corpus, tokenizer, cfg.run.name)
        self.sampler = DocumentSampler(self.corpus, cfg.run.seed)
        self.rng = random.Random(cfg.run.seed)
        self.engines: list = []
        token = cfg.rollout.token or os.environ.get("SPICE_ROLLOUT_TOKEN") or secrets.token_hex(16)
        self.token = token
        urls = list(cfg.rollout.engines) or self._start_local_engines(cfg.run.model, cfg.rollout.local_engines)
        self.fleet = RolloutFleet(urls, token, cfg.rollout.request_timeout, chunk_size=cfg.rollout.chunk_size)
        self.fleet.wait_until_healthy(cfg.rollout.health_timeout)
        for url, health in self.fleet.health().items():
            if health and health.get("weight_transfer", cfg.rollout.weight_transfer) != cfg.rollout.weight_transfer:
                raise RuntimeError(f"engine {url} receives weights through {health['weight_transfer']!r}, the learner "
                                   f"sends through rollout.weight_transfer={cfg.rollout.weight_transfer!r}: start both "
                                   "with the same backend (slurm: WEIGHT_TRANSFER)")
        # selfplay.challenger=model: a fixed challenger behind its own engines, never weight-synced
        self.challenger_fleet = None
        if cfg.selfplay.challenger == "model":
            curls = list(cfg.rollout.challenger_engines) or self._start_local_engines(cfg.selfplay.challenger_model, 1)
            self.challenger_fleet = RolloutFleet(curls, token, cfg.rollout.request_timeout,
                                                 chunk_size=cfg.rollout.chunk_size)
            self.challenger_fleet.wait_until_healthy(cfg.rollout.health_timeout)
        self.verifier = AnswerVerifier()
        state = resume_state or {}
        if resume_state:
            self.sampler.load_state_dict(state["sampler"])
            self.rng.setstate(_tuple_state(state["rng"]))
        self.metrics = MetricsLogger(out, state.get("metrics_offset"), cfg.run.wandb_project, cfg.run.name,
                                     dataclasses.asdict(cfg))
        self.audit = JsonlLog(os.path.join(out, "audit.jsonl"), state.get("audit_offset"))
        self.low_valid_streak = state.get("low_valid_streak", 0)
        self.low_reward_streak = state.get("low_reward_streak", 0)
        self._ids: dict[str, list[int]] = {}
        self._rollouts = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spice-rollouts")  # staleness 1

    def _start_local_engines(self, model: str, count: int) -> list[str]:
        from spice_megatron.rollout.local import engine_args, engine_devices, start_engines

        ro = self.cfg.rollout
        extra = engine_args(ro.max_model_len, ro.kv_cache_gib, self.cfg.run.seed, tensor_parallel=ro.engine_tensor_parallel,
                            gpu_memory_utilization=ro.gpu_memory_utilization, weight_transfer=ro.weight_transfer)
        # on a GPU machine the engines take the GPUs after the learner's local ranks and earlier engines
        reserved = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) + len(self.engines) * ro.engine_tensor_parallel
        started = start_engines(model, self.token, os.path.join(self.cfg.run.output_dir, "logs"), extra,
                                engine_devices(count, ro.engine_tensor_parallel, reserved=reserved))
        self.engines += started
        return [e.url for e in started]

    def restart_dead_engines(self) -> bool:
        """Restart local engines that died (the fleet served their requests elsewhere meanwhile).
        Returns whether the weight-sync group must be formed again."""
        from spice_megatron.rollout.local import restart, wait_healthy

        restarted = False
        health = self.fleet.health() if self.engines else {}
        for i, e in enumerate(self.engines):
            if e.alive() and health.get(e.url) is None:  # exiting (its sockets closed first) or hung
                try:
                    e.process.wait(10)
                except subprocess.TimeoutExpired:
                    log.warning("rollout engine %s does not answer; killing it", e.url)
                    e.kill()
            if not e.alive():
                log.warning("rollout engine %s died; restarting it", e.url)
                self.engines[i] = restart(e, self.token)
                wait_healthy([self.engines[i]])
                restarted = True
        if restarted:
            self.fleet.wait_until_healthy()
        return restarted

    def prompt_ids(self, prompt: str) -> list[int]:
        if prompt not in self._ids:
            self._ids[prompt] = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        return self._ids[prompt]

    def generate(self, prompts, spec):
        # Token ids go to the engines so that the learner trains on exactly the sampled sequence.
        return self.fleet.generate([self.prompt_ids(p) for p in prompts], spec)

    def selfplay(self, iteration: int, version: int) -> "RolloutBatch":
        from spice_megatron.selfplay import run_fixed_tasks, run_iteration

        t0 = time.perf_counter()
        docs = self.sampler.next_batch(self.cfg.selfplay.batch_docs)
        self._ids.clear()  # prompts hold this iteration's documents: do not keep them for the whole run
        seed = self.cfg.run.seed * 100_003 + iteration
        sp = self.cfg.selfplay
        if sp.challenger == "tasks":
            result = run_fixed_tasks(docs, self.generate, self.verifier, sp, self.tokenizer, weights_version=version,
                                     iteration=iteration, seed=seed)
        else:
            # the fixed challenger reads text prompts: its tokenizer may differ from the policy's
            fixed = self.challenger_fleet.generate if self.challenger_fleet else None
            result = run_iteration(docs, self.generate, self.verifier, sp, self.rng, self.tokenizer,
                                   weights_version=version, iteration=iteration, seed=seed, challenger_generate=fixed)
        seqs = [TrainSequence(self.prompt_ids(s.prompt), s.completion.token_ids, s.advantage,
                              s.completion.logprobs or None, s.role, s.completion.versions or None)
                for s in result.samples if s.completion.token_ids]
        stats = {**result.stats, "time/rollouts": time.perf_counter() - t0}  # self-play wall time, all phases
        return RolloutBatch(iteration, version, stats, result.records, seqs)

    def start_selfplay(self, iteration: int, version: int) -> tuple[Future, dict]:
        """The rollouts of `iteration` in the background (staleness 1), and the sampler and RNG state
        from before they started: what a checkpoint taken while they run must hold, so that a
        resumed run starts them again from the same place."""
        snapshot = {"sampler": self.sampler.state_dict(), "rng": self.rng.getstate()}
        return self._rollouts.submit(self.selfplay, iteration, version), snapshot

    def check_kill_switch(self, stats: dict[str, float], loss: float, grad_norm: float) -> None:
        run = self.cfg.run
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            raise KillSwitch(f"non-finite loss ({loss}) or gradient norm ({grad_norm})")
        self.low_valid_streak = self.low_valid_streak + 1 if stats["valid_task_rate"] < run.min_valid_task_rate else 0
        if self.low_valid_streak >= run.patience:
            raise KillSwitch(f"valid-task rate below {run.min_valid_task_rate} for {run.patience} iterations")
        self.low_reward_streak = (self.low_reward_streak + 1
                                  if stats["challenger/reward_mean"] < run.min_challenger_reward else 0)
        if self.low_reward_streak >= run.patience:
            raise KillSwitch(f"challenger reward below {run.min_challenger_reward} for {run.patience} iterations")

    def state(self) -> dict:
        return {"sampler": self.sampler.state_dict(), "rng": self.rng.getstate(),
                "metrics_offset": self.metrics.jsonl.offset(), "audit_offset": self.audit.offset(),
                "low_valid_streak": self.low_valid_streak, "low_reward_streak": self.low_reward_streak}

    def close(self) -> None:
        self._rollouts.shutdown(wait=False, cancel_futures=True)
        self.metrics.close()
        self.audit.close()
        self.fleet.close()
        if self.challenger_fleet:
            self.challenger_fleet.close()
        self.verifier.close()
        for e in self.engines:
            e.stop()


def _write_marker(path: str, reason: str, is_driver: bool) -> None:
    if is_driver:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            f.write(reason + "\n")


def _tuple_state(state):
    """random.Random state after a JSON round trip (lists back to tuples)."""
    return tuple(_tuple_state(x) for x in state) if isinstance(state, list) else state


def _sync_host(cfg: SpiceConfig) -> str:
    """The address the engines dial to join the weight-sync group (rank 0 hosts its store)."""
    import socket
    from urllib.parse import urlparse

    if cfg.rollout.sync_host:
        return cfg.rollout.sync_host
    loopback = ("127.0.0.1", "localhost", "::1", "")
    if all(urlparse(u).hostname in loopback for u in cfg.rollout.engines):
        return "127.0.0.1"
    master = os.environ.get("MASTER_ADDR", "")  # torchrun --standalone sets a loopback one
    return master if master not in loopback else socket.gethostbyname(socket.getfqdn())


class WeightSync:
    """The learner side of the engines' weight updates, through vLLM's weight-transfer interface:
    a `WeightSource` over the learner (bridge/transfer.py), the trainer engine of the backend
    `rollout.weight_transfer`, and the fleet's HTTP client for vLLM's control plane (driver only)."""

    def __init__(self, cfg: SpiceConfig, learner, driver: Driver | None, control):
        from spice_megatron.bridge.transfer import MegatronStageSource

        self.cfg, self.learner, self.driver, self.control = cfg, learner, driver, control
        self.source = MegatronStageSource(learner, control)
        self.host = _broadcast(_sync_host(cfg) if driver else "", control)
        self.transfer = None  # the trainer engine, until the group must be formed again
        self.client = None  # the fleet's control-plane client (driver only)
        self.bytes = 0.0

    def reform(self) -> None:
        """After an engine restart every member joins a fresh group on a new port."""
        if self.transfer is not None:
            self.transfer.shutdown()
            self.transfer = None

    def sync(self, version: int) -> dict:
        """Stream the learner's weights to every engine. If an engine dies during the sync, the
        engines the trainer started are restarted, everyone joins a fresh group and the sync is
        tried once more; an engine that cannot be restarted (a cluster's) fails the run."""
        t0 = time.perf_counter()
        for attempt in (1, 2):
            error = self._attempt(version)
            if not _any_rank(bool(error), self.control):
                return {"weight_sync/seconds": time.perf_counter() - t0, "weight_sync/bytes": self.bytes,
                        "weight_sync/retries": float(attempt - 1)}
            if attempt == 2:
                raise RuntimeError(f"weight sync of version {version} failed twice: {error or 'on another rank'}")
            if self.driver:
                log.warning("weight sync of version %d failed (%s); restarting dead engines and retrying",
                            version, error or "on another learner rank")
            _broadcast(self.driver.restart_dead_engines() if self.driver else None, self.control)
            self.reform()
        raise AssertionError("unreachable")

    def _init_transfer(self):
        from spice_megatron.bridge.transfer import SpiceTrainerInitInfo, SpiceTrainerTransfer
        from spice_megatron.launch import free_port

        ro = self.cfg.rollout
        port = _broadcast((ro.sync_port or free_port()) if self.driver else 0, self.control)
        receivers = _broadcast(self.driver.fleet.num_receivers if self.driver else 0, self.control)
        self.client = self.driver.fleet.sync_client() if self.driver else None
        if ro.weight_transfer == "nccl":
            return _nccl_transfer(self.host, port, receivers, self.client, self.source)
        info = SpiceTrainerInitInfo(self.host, port, self.learner.layout.pp, receivers, timeout_s=ro.sync_timeout,
                                    bucket_bytes=ro.bucket_mb * 2**20, rank=dist.get_rank())
        return SpiceTrainerTransfer.trainer_init(info, client=self.client, source=self.source)

    def _attempt(self, version: int) -> str:
        """One sync; returns this rank's error message ("" when it went through)."""
        try:
            if self.transfer is None:
                self.transfer = self._init_transfer()
            if self.cfg.rollout.weight_transfer == "spice":
                sent = self.transfer.send_weights(version)["bytes"]
            else:  # vLLM's engine finishes without a version: the client stamps it
                if self.client:
                    self.client.version = str(version)
                self.transfer.send_weights()
                sent = self.source.nbytes if dist.get_rank() == 0 else 0
            # the driver reports one copy of the model: what every stage sent, together
            t = torch.tensor([float(sent)], dtype=torch.float64)
            dist.all_reduce(t, group=self.control)
            self.bytes = float(t.item())
            return ""
        except Exception as e:  # noqa: BLE001 - a dead peer surfaces as gloo/NCCL, HTTP or protocol errors
            if self.transfer is not None:
                self.transfer.shutdown()
            self.transfer = None
            return f"{type(e).__name__}: {e}"


def _nccl_transfer(host: str, port: int, receivers: int, client, source):
    """vLLM's built-in `nccl` trainer engine over the Megatron source (one sender: trainer rank 0,
    so pipeline parallelism 1; config.validate refuses the rest). GPU only, and vLLM must be
    importable on the learner; never run here (no GPU)."""
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo
    except ImportError as e:
        raise RuntimeError("rollout.weight_transfer=nccl: its trainer engine is vLLM's, and vLLM is not importable "
                           "in the learner's environment (the learner image has none); use spice") from e
    info = NCCLTrainerInitInfo(master_address=host, master_port=port, world_size=1 + receivers, rank=dist.get_rank())
    return WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)


def _any_rank(flag: bool, group) -> bool:
    t = torch.tensor([int(flag)])  # a CPU tensor: the control group is gloo
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())


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
    from the collapse) unless `resume_after_kill_switch`."""
    from tqdm.auto import tqdm
    from transformers import AutoTokenizer

    from spice_megatron.bridge.convert import HF_META_DIR, copy_hf_metadata, save_hf_checkpoint
    from spice_megatron.bridge.hf_io import resolve_model_dir
    from spice_megatron.policy.checkpoint import latest_checkpoint, load_checkpoint, read_trainer_state, save_checkpoint
    from spice_megatron.policy.learner import Learner
    from spice_megatron.policy.parallel import control_group, init_distributed

    cfg.validate()
    cfg.run.model = resolve_model_dir(cfg.run.model)
    layout = init_distributed(cfg.parallel, seed=cfg.train.seed)
    is_driver = layout.rank == 0
    control = control_group(cfg.run.driver_timeout)
    ckpt_root = os.path.join(cfg.run.output_dir, "checkpoints")
    tokenizer = AutoTokenizer.from_pretrained(cfg.run.model)

    # --- The learner: the base model (HF -> Megatron), or the last checkpoint on resume.
    latest = latest_checkpoint(ckpt_root) if resume else None
    stopped = read_trainer_state(latest).get("kill_switch") if latest else None
    kill_marker = os.path.join(cfg.run.output_dir, KILL_SWITCH_FILE)
    if stopped and not resume_after_kill_switch:
        _write_marker(kill_marker, stopped, is_driver)
        raise KillSwitch(f"not resuming: the kill switch stopped this run at {os.path.basename(latest)} ({stopped}); "
                         "pass --resume-after-kill-switch to continue it anyway")
    learner = Learner.from_hf(cfg.run.model, cfg.parallel, cfg.optim, cfg.train, pad_id=tokenizer.pad_token_id or 0)
    state: dict[str, Any] = {"iteration": 0, "version": 0}
    if resume and latest is None and is_driver:
        log.warning("--resume: no checkpoint under %s; starting from the base model", ckpt_root)
    if latest:
        state = load_checkpoint(learner, latest)
    if is_driver:
        copy_hf_metadata(cfg.run.model, os.path.join(ckpt_root, HF_META_DIR))
    driver = Driver(cfg, tokenizer, state.get("driver")) if is_driver else None
    weights = WeightSync(cfg, learner, driver, control)
    if state["version"] > 0:  # engines start from the base model: bring them to the checkpoint's weights
        weights.sync(state["version"])

    # At staleness 1 the rollouts of the next iteration run while the learner steps (step 1-4 of
    # iteration t+1 during 5 of t): `ready` is a finished batch waiting for the learner, `pending`
    # the rollouts in flight and `snapshot` the driver's sampler/RNG from before they started.
    off_policy = cfg.train.max_staleness > 0
    ready = RolloutBatch.from_json(state["ready"]) if driver and state.get("ready") else None
    pending: Future | None = None
    snapshot: dict = {}

    def checkpoint(iteration: int, version: int, kill_switch: str = "") -> None:
        trainer_state = {"iteration": iteration, "version": version,
                         "driver": {**driver.state(), **snapshot} if driver else None,
                         "ready": ready.to_json() if ready else None}
        if kill_switch:
            trainer_state["kill_switch"] = kill_switch
        save_checkpoint(learner, ckpt_root, iteration, trainer_state, cfg.run.keep_last)  # rank 0 writes it

    stop_file = os.path.join(cfg.run.output_dir, STOP_FILE)
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
            batch = None
            if driver:
                batch = ready if off_policy and ready else driver.selfplay(iteration, version)
                ready = None
                if off_policy and pending is None and iteration + 1 < cfg.run.iterations:
                    pending, snapshot = driver.start_selfplay(iteration + 1, version)
            seqs = _broadcast(batch.seqs if batch else None, control)
            # 5. DrGRPO on the learner (refusing samples older than train.max_staleness)
            steps = learner.train_on_batch(seqs, version=version) if seqs else []
            version += 1
            t_wait = time.perf_counter()
            if pending is not None:  # the engines keep the old weights until these rollouts are done
                ready, pending, snapshot = pending.result(), None, {}
            t_wait = time.perf_counter() - t_wait
            # 6. new weights to the engines; an engine that died during the rollouts (the fleet
            # served its requests elsewhere) is restarted first and the sync group formed anew
            if _broadcast(driver.restart_dead_engines() if driver else False, control):
                weights.reform()
            sync = weights.sync(version)
            iteration += 1
            # 7. logs, kill switch, checkpoint
            stop = ""
            if driver:
                stats = _iteration_stats(batch, steps, sync, version - 1)
                stats["time/wait_for_rollouts"] = t_wait
                stats["time/iteration"] = time.perf_counter() - t_iter
                stats["time/elapsed"] = time.perf_counter() - t_start  # since this process started training
                if eval_hook and cfg.run.eval_every and iteration % cfg.run.eval_every == 0:
                    t_eval = time.perf_counter()
                    stats.update({f"eval/{k}": v for k, v in eval_hook(iteration, driver.fleet).items()})
                    stats["time/eval"] = time.perf_counter() - t_eval
                driver.audit.write(batch.records)
                driver.metrics.log(iteration, stats)
                progress.update(1)
                progress.set_postfix(valid=f"{stats['valid_task_rate']:.2f}", pass_rate=f"{stats['reasoner_pass_rate']:.2f}",
                                     loss=f"{stats.get('train/loss', 0.0):.4f}")
                summary = stats
                try:
                    driver.check_kill_switch(stats, steps[-1].loss if steps else 0.0,
                                             steps[-1].grad_norm if steps else 0.0)
                except KillSwitch as e:
                    stop = str(e)
            # rank 0 decides for all: its kill switch, and its Ctrl-C / SIGTERM
            stop, interrupted = _broadcast((stop, stop_request.requested) if driver else None, control)
            if driver and off_policy and not (stop or interrupted) and iteration + 1 < cfg.run.iterations:
                pending, snapshot = driver.start_selfplay(iteration + 1, version)  # overlaps the checkpoint too
            if stop or interrupted or iteration % cfg.run.checkpoint_every == 0 or iteration == cfg.run.iterations:
                checkpoint(iteration, version, kill_switch=stop)
            if stop:
                _write_marker(kill_marker, stop, is_driver)
                raise KillSwitch(f"stopped the run: {stop} (a checkpoint was saved)")
            if interrupted and is_driver and os.path.exists(stop_file):
                os.remove(stop_file)  # honoured: the next attempt runs on
            if interrupted and iteration < cfg.run.iterations:
                raise Interrupted(f"stopped after iteration {iteration} with a checkpoint; continue with --resume")
    finally:
        stop_request.restore()
        progress.close()
        if driver:
            driver.close()
    if cfg.run.export_hf:
        save_hf_checkpoint(learner, os.path.join(cfg.run.output_dir, "hf_final"), os.path.join(ckpt_root, HF_META_DIR))
    return summary
