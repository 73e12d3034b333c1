"""Rank 0's side of the SPICE loop (the driver): the corpus, the rollout fleet and the engines it
started, verification, rewards and the logs. `Driver.selfplay` is steps 1-4 of one iteration
(documents -> tasks -> answers -> advantages) and returns a `RolloutBatch` that the trainer
broadcasts to every learner rank."""
from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
import queue
import random
import secrets
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

from spice_megatron.bridge.dequantize import QuantizedEngineModel, check_engine_model
from spice_megatron.config import SpiceConfig
from spice_megatron.loop.interfaces import RolloutBatch
from spice_megatron.metric_names import CHALLENGER_REWARD, VALID_TASK_RATE
from spice_megatron.policy.batching import TrainSequence
from spice_megatron.rollout.fleet import FleetError, NoEngineLeft, RolloutFleet
from spice_megatron.run.audit import compact_documents
from spice_megatron.selfplay.templates import prompt_token_ids

log = logging.getLogger("spice.trainer")
# An engine on a busy CPU (or a GPU engine in a long prefill) can miss one 10 s health check; one
# that answers nothing for this long is hung and is killed and restarted.
HUNG_ENGINE_GRACE_S = 120.0


class EnginesLost(RuntimeError):
    """No rollout engine is left and none came back: the run stopped with a checkpoint."""


class IterationAbandoned(RuntimeError):
    """A STOP file (the time limit near, or a person) arrived during the rollouts: the iteration in
    progress is dropped and the run stops with the state from before it."""


class KillSwitch(RuntimeError):
    """The run stopped itself (non-finite loss, no valid tasks, reward collapse)."""


class Driver:
    """Rank 0's side of the loop: corpus, rollout fleet, verifier, logs."""

    def __init__(self, cfg: SpiceConfig, tokenizer, resume_state: dict | None,
                 abandon_when: Callable[[], bool] | None = None):
        from spice_megatron.data.corpus import Corpus, DocumentSampler
        from spice_megatron.metric_names import declared_names, run_kinds
        from spice_megatron.run.audit import written_document_hashes
        from spice_megatron.run.log import JsonlLog, MetricsLogger, read_jsonl
        from spice_megatron.selfplay.verify import AnswerVerifier

        self.cfg, self.tokenizer = cfg, tokenizer
        out = cfg.run.output_dir
        if cfg.selfplay.challenger == "tasks":  # a task file stands in for the challenger
            from spice_megatron.selfplay.task_pool import TaskPool

            self.corpus = TaskPool(cfg.selfplay.tasks_file)
        else:
            self.corpus = Corpus.build(cfg.corpus, tokenizer, cfg.run.name)
        self.sampler = DocumentSampler(self.corpus, cfg.run.seed)
        self.rng = random.Random(cfg.run.seed)
        self.engines: list = []
        token = self._job_token(cfg)
        self.token = token
        if not cfg.rollout.engines:
            check_engine_model(cfg.engine_model, "rollout.model" if cfg.rollout.model else "run.model")
        urls = list(cfg.rollout.engines) or self._start_local_engines(cfg.engine_model, cfg.rollout.local_engines)
        self.fleet = RolloutFleet(urls, token, cfg.rollout.request_timeout, chunk_size=cfg.rollout.chunk_size)
        self.fleet.wait_until_healthy(cfg.rollout.health_timeout)
        for url, health in self.fleet.health().items():
            if health and health.get("quantization"):
                raise QuantizedEngineModel(f"engine {url} serves {health.get('model')} quantized "
                                           f"({health['quantization']}): the weight sync sends bf16 tensors it cannot "
                                           "load; serve a bf16 copy (spice convert bf16)")
            if health and health.get("weight_transfer", cfg.rollout.weight_transfer) != cfg.rollout.weight_transfer:
                raise RuntimeError(f"engine {url} receives weights through {health['weight_transfer']!r}, the learner "
                                   f"sends through rollout.weight_transfer={cfg.rollout.weight_transfer!r}: start both "
                                   "with the same backend (slurm: WEIGHT_TRANSFER)")
        # selfplay.challenger=model: a fixed challenger behind its own engines, never weight-synced
        self.challenger_fleet = None
        if cfg.selfplay.challenger == "model":
            curls = list(cfg.rollout.challenger_engines)
            if not curls:
                curls = self._start_local_engines(cfg.selfplay.challenger_model, 1, challenger=True)
            self.challenger_fleet = RolloutFleet(curls, token, cfg.rollout.request_timeout,
                                                 chunk_size=cfg.rollout.chunk_size)
            self.challenger_fleet.wait_until_healthy(cfg.rollout.health_timeout)
            # its prompts are tokenised by its own tokenizer (the policy's when only engines are named:
            # the paper's strong challenger, Qwen3-32B, shares the Qwen3 policies' tokenizer)
            self.challenger_tokenizer = tokenizer
            if cfg.selfplay.challenger_model:
                from transformers import AutoTokenizer

                self.challenger_tokenizer = AutoTokenizer.from_pretrained(cfg.selfplay.challenger_model)
        self.verifier = AnswerVerifier()
        state = resume_state or {}
        if resume_state:
            self.sampler.load_state_dict(state["sampler"])
            self.rng.setstate(_tuple_state(state["rng"]))
        self.metrics = MetricsLogger(out, state.get("metrics_offset"), cfg.run.wandb_project, cfg.run.name,
                                     dataclasses.asdict(cfg), declared_names(cfg.selfplay.group_size, run_kinds(cfg)))
        self.audit = JsonlLog(os.path.join(out, "audit.jsonl"), state.get("audit_offset"))
        # the documents whose text the trail holds (audit.compact_documents): read back on resume
        self.documents_written = (written_document_hashes(read_jsonl(self.audit.path))
                                  if state.get("audit_offset") else set())
        self.low_valid_streak = state.get("low_valid_streak", 0)
        self.low_reward_streak = state.get("low_reward_streak", 0)
        self._ids: dict[str, list[int]] = {}
        self._ids_lock = threading.Lock()
        self._rollouts = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spice-rollouts")  # staleness 1
        # checked before every generation call: a long iteration (many challenger rounds of a paper
        # recipe) must not outlast the job's grace period after the time-limit STOP
        self.abandon_when = abandon_when

    @staticmethod
    def _job_token(cfg: SpiceConfig) -> str:
        """Engines started elsewhere share the job's secret (its launcher makes a fresh one per attempt);
        engines this run starts get a fresh one, which lives only in this process and theirs."""
        from spice_megatron.config import ConfigError
        from spice_megatron.wire.auth import read_token

        if not (cfg.rollout.engines or cfg.rollout.challenger_engines):
            return secrets.token_hex(16)
        token = read_token(cfg.rollout.token_file or None)
        if not token:
            raise ConfigError("rollout.engines: engines started elsewhere need the job's secret in "
                              "$SPICE_ROLLOUT_TOKEN or in the file rollout.token_file names")
        return token

    def _start_local_engines(self, model: str, count: int, challenger: bool = False) -> list[str]:
        from spice_megatron.rollout.local import engine_args, engine_devices, start_engines

        ro = self.cfg.rollout
        tp = ro.engine_tensor_parallel
        if challenger:
            import torch

            from spice_megatron.plan.planner import challenger_engine_tp, check_challenger_engine

            tp = challenger_engine_tp(self.cfg)
            if torch.cuda.is_available():  # refuse an engine that cannot hold the model, before it loads
                check_challenger_engine(self.cfg)
        colocated = self.cfg.run.colocate and not challenger
        extra = engine_args(ro.max_model_len, ro.kv_cache_gib, self.cfg.run.seed, tensor_parallel=tp,
                            gpu_memory_utilization=ro.gpu_memory_utilization, weight_transfer=ro.weight_transfer,
                            expert_parallel=ro.engine_expert_parallel and not challenger,
                            max_num_batched_tokens=ro.max_num_batched_tokens, max_num_seqs=ro.max_num_seqs)
        if colocated:
            extra.append("--enable-sleep-mode")
        # on a GPU machine the engines take the GPUs after the learner's local ranks and earlier
        # engines; colocated, the learner's own GPUs from the first
        learner_gpus = 0 if colocated else int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        reserved = learner_gpus + len(self.engines) * ro.engine_tensor_parallel
        started = start_engines(model, self.token, os.path.join(self.cfg.run.output_dir, "logs"), extra,
                                engine_devices(count, tp, reserved=reserved))
        self.engines += started
        return [e.url for e in started]

    def restart_dead_engines(self) -> bool:
        """Restart local engines that died (the fleet served their requests elsewhere meanwhile).
        Returns whether the weight-sync group must be formed again."""
        from spice_megatron.rollout.local import restart, wait_healthy

        if not self.engines:
            return self._cluster_engines_restarted()
        restarted = False
        # the local fixed challenger's engine (selfplay.challenger=model) is in its own fleet: checked
        # there, not taken for a dead policy engine
        health = {**self.fleet.health(), **(self.challenger_fleet.health() if self.challenger_fleet else {})}
        for i, e in enumerate(self.engines):
            if e.alive() and health.get(e.url) is None and not self._answers_again(e):
                log.warning("rollout engine %s has not answered for %.0fs; killing it", e.url,
                            HUNG_ENGINE_GRACE_S)
                e.kill()
            if not e.alive():
                log.warning("rollout engine %s died; restarting it", e.url)
                self.engines[i] = restart(e, self.token)
                wait_healthy([self.engines[i]])
                restarted = True
        if restarted:
            self.fleet.wait_until_healthy()
            if self.challenger_fleet:
                self.challenger_fleet.wait_until_healthy()
        return restarted

    def _answers_again(self, engine) -> bool:
        """Whether a live engine that missed a health check answers within HUNG_ENGINE_GRACE_S.
        False as soon as its process ends (it was exiting: its sockets close first)."""
        fleet = self.fleet if self.fleet.serves(engine.url) else self.challenger_fleet
        deadline = time.monotonic() + HUNG_ENGINE_GRACE_S
        while engine.alive() and time.monotonic() < deadline:
            if fleet.probe(engine.url) is not None:
                log.info("rollout engine %s answers again", engine.url)
                return True
            time.sleep(2.0)
        return False

    def kill_engines(self, urls: list[str]) -> list[str]:
        """Kill the engines at `urls` that this driver started and wait for their processes to end
        (their GPU memory is free then; restart_dead_engines brings them back). Returns the urls it
        cannot stop: a cluster's engines."""
        mine = {e.url: e for e in self.engines}
        for url in urls:
            if url in mine:
                log.warning("rollout engine %s: killing it", url)
                mine[url].kill()
        return [url for url in urls if url not in mine]

    def _cluster_engines_restarted(self) -> bool:
        """Engines a cluster started (slurm/rollout_node.sh restarts one that dies, on its port): one
        that is down is waited for (rollout.health_timeout), and one that came back holds the base
        model (weights version 0 among engines at the current one). Either way every engine must
        join a fresh sync group and take the current weights: True."""
        health = self.fleet.health()
        versions = {str(st["version"]) for st in health.values() if st is not None}
        if all(st is not None for st in health.values()) and len(versions) <= 1:
            return False
        down = [url for url, st in health.items() if st is None]
        log.warning("rollout engine(s) %s; waiting up to %.0fs for every engine, then all take the current weights",
                    f"down: {', '.join(down)}" if down else f"restarted (weights versions {sorted(versions)})",
                    self.cfg.rollout.health_timeout)
        self.fleet.wait_until_healthy(self.cfg.rollout.health_timeout)
        return True

    def recover_engines(self, why: str) -> str:
        """No healthy engine is left (`why`). The engines this driver started are restarted (with the
        base model: the trainer then sends them the current weights); a cluster's are waited for up
        to rollout.health_timeout. Returns "" when the fleet serves again, else why not."""
        log.warning("%s; %s", why, "restarting the rollout engines" if self.engines else
                    f"waiting up to {self.cfg.rollout.health_timeout:.0f}s for the rollout engines")
        if self.engines:
            self.restart_dead_engines()
        try:
            self.fleet.wait_until_healthy(self.cfg.rollout.health_timeout)
        except FleetError as e:
            return str(e)
        return ""

    def prompt_ids(self, prompt: str) -> list[int]:
        with self._ids_lock:  # a streamed iteration's documents ask from their own threads
            if prompt not in self._ids:
                self._ids[prompt] = prompt_token_ids(prompt, self.tokenizer)
            return self._ids[prompt]

    def generate(self, prompts, spec, one_engine: bool = False):
        if self.abandon_when is not None and self.abandon_when():
            raise IterationAbandoned("STOP requested during the rollouts")
        # Token ids go to the engines so that the learner trains on exactly the sampled sequence.
        return self.fleet.generate([self.prompt_ids(p) for p in prompts], spec, one_engine)

    def fixed_challenger_generate(self, prompts, spec, one_engine: bool = False):
        with self._ids_lock:
            ids = [prompt_token_ids(p, self.challenger_tokenizer) for p in prompts]
        return self.challenger_fleet.generate(ids, spec, one_engine)

    def start_streamed(self, iteration: int, version: int,
                       on_sequences: Callable[[list[TrainSequence]], None] | None = None) -> tuple[Future, queue.Queue]:
        """The rollouts of `iteration` in the background, streamed, and a queue of each complete
        document's training sequences (advantages not yet known) as it completes, then None: the
        learner's old log-probs run on them meanwhile (streamed_forward.py). `on_sequences`
        replaces the queue (the driver process sends them through its pipe)."""
        chunks: queue.Queue = queue.Queue()
        future = self._rollouts.submit(self.selfplay, iteration, version, on_sequences or chunks.put)
        future.add_done_callback(lambda _: chunks.put(None))
        return future, chunks

    def selfplay(self, iteration: int, version: int,
                 on_sequences: Callable[[list[TrainSequence]], None] | None = None) -> "RolloutBatch":
        """Steps 1-4 of `iteration` on the engines, which hold weights `version`. When no engine is
        left (NoEngineLeft) or a STOP arrives (IterationAbandoned), the sampler and RNG are put back
        as they were: the iteration is done again, or a checkpoint holds the state from before it."""
        before = self.rollout_state()
        try:
            return self._selfplay(iteration, version, on_sequences)
        except (NoEngineLeft, IterationAbandoned):
            # the rollouts will be done again, from the same documents and RNG state (exact resume)
            self.sampler.load_state_dict(before["sampler"])
            self.rng.setstate(before["rng"])
            raise

    def _train_sequence(self, role: str, prompt: str, completion, advantage: float) -> TrainSequence:
        return TrainSequence(self.prompt_ids(prompt), completion.token_ids, advantage, completion.logprobs or None,
                             role, completion.versions or None, completion.routed_experts)

    def _selfplay(self, iteration: int, version: int,
                  on_sequences: Callable[[list[TrainSequence]], None] | None = None) -> "RolloutBatch":
        from spice_megatron.selfplay.iteration import run_fixed_tasks, run_iteration

        t0 = time.perf_counter()
        docs = self.sampler.next_batch(self.cfg.selfplay.batch_docs)
        self._ids.clear()  # prompts hold this iteration's documents: do not keep them for the whole run
        seed = self.cfg.run.seed * 100_003 + iteration
        # the audit trail counts iterations from 1 as the metrics do; `iteration` (from 0) seeds the sampling
        sp = self.cfg.selfplay
        if sp.challenger == "tasks":
            result = run_fixed_tasks(docs, self.generate, self.verifier, sp, self.tokenizer, rollout_version=version,
                                     iteration=iteration + 1, seed=seed)
        else:
            # streamed: a document's request stays whole on one engine (its prompt in that engine's
            # prefix cache); the other documents' requests feed the other engines
            streamed = self.cfg.run.streamed
            generate = functools.partial(self.generate, one_engine=streamed)
            fixed = functools.partial(self.fixed_challenger_generate,
                                      one_engine=streamed) if self.challenger_fleet else None
            result = run_iteration(docs, generate, self.verifier, sp, self.rng, self.tokenizer,
                                   rollout_version=version, iteration=iteration + 1, seed=seed,
                                   challenger_generate=fixed,
                                   max_model_len=self.cfg.rollout.max_model_len, token_ids=self.prompt_ids,
                                   streamed=streamed, on_document=None if on_sequences is None else (
                                       lambda done: on_sequences([self._train_sequence(role, prompt, c, 0.0)
                                                                  for role, prompt, c in done if c.token_ids])))
        seqs = [self._train_sequence(s.role, s.prompt, s.completion, s.advantage)
                for s in result.samples if s.completion.token_ids]
        stats = {**result.stats, "time/rollouts": time.perf_counter() - t0}  # self-play wall time, all phases
        return RolloutBatch(iteration, version, stats, result.records, seqs)

    def rollout_state(self) -> dict:
        """What the next rollouts start from: the document sampler and the RNG."""
        return {"sampler": self.sampler.state_dict(), "rng": self.rng.getstate()}

    def start_selfplay(self, iteration: int, version: int) -> tuple[Future, dict]:
        """The rollouts of `iteration` in the background (staleness 1), and the sampler and RNG state
        from before they started: what a checkpoint taken while they run must hold, so that a
        resumed run starts them again from the same place."""
        snapshot = self.rollout_state()
        return self._rollouts.submit(self.selfplay, iteration, version), snapshot

    def log(self, iteration: int, stats: dict[str, float], records: list[dict]) -> None:
        """An iteration's audit records and metrics, in that order (a checkpoint holds both offsets)."""
        self.audit.write(compact_documents(records, self.documents_written))
        self.metrics.log(iteration, stats)

    def check_kill_switch(self, stats: dict[str, float], loss: float, grad_norm: float) -> None:
        run = self.cfg.run
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            raise KillSwitch(f"non-finite loss ({loss}) or gradient norm ({grad_norm})")
        self.low_valid_streak = self.low_valid_streak + 1 if stats[VALID_TASK_RATE] < run.min_valid_task_rate else 0
        if self.low_valid_streak >= run.patience:
            raise KillSwitch(f"valid-task rate below {run.min_valid_task_rate} for {run.patience} iterations")
        self.low_reward_streak = (self.low_reward_streak + 1
                                  if stats[CHALLENGER_REWARD] < run.min_challenger_reward else 0)
        if self.low_reward_streak >= run.patience:
            raise KillSwitch(f"challenger reward below {run.min_challenger_reward} for {run.patience} iterations")

    def state(self) -> dict:
        return {**self.rollout_state(),
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


def _tuple_state(state):
    """random.Random state after a JSON round trip (lists back to tuples)."""
    return tuple(_tuple_state(x) for x in state) if isinstance(state, list) else state
