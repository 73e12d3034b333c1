"""The fleet client: many generation requests across R rollout engines.

Prompts are cut into chunks, as many as there are healthy engines (at most rollout.chunk_size
prompts each), so that every engine holds a near-equal share of a phase: the selection step of 128
documents, a later challenger round of a few pending documents, the reasoner's answers. Each chunk
goes to the healthy engine with the fewest requests in flight. A chunk whose engine dies, errors or
times out is retried on another engine; the first answer for a chunk is kept and any later one
dropped, so every prompt is answered exactly once.
Sampling seeds are per prompt (seed + global index), so results do not depend on which engine
or chunk served a prompt.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace

import requests

from spice_megatron.rollout.types import Completion, SamplingSpec, unpack_completions

log = logging.getLogger(__name__)


class FleetError(RuntimeError):
    pass


class NoEngineLeft(FleetError):
    """Every engine of the fleet failed: the trainer restarts the engines it started, or waits for
    a cluster's, and does the rollouts again."""


@dataclass
class EngineStats:
    url: str
    healthy: bool = True
    workers: int = 1  # vLLM workers (engine tensor parallel size): each one receives weights
    in_flight: int = 0
    requests: int = 0
    failures: int = 0
    tokens: int = 0
    busy_seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.busy_seconds if self.busy_seconds else 0.0


class RolloutFleet:
    def __init__(self, urls: list[str], token: str, request_timeout: float = 600.0, max_attempts: int = 3,
                 chunk_size: int = 64):
        if not urls:
            raise FleetError("rollout.engines: at least one engine address is needed")
        self.token, self.request_timeout, self.max_attempts, self.chunk_size = token, request_timeout, max_attempts, chunk_size
        self.engines = [EngineStats(u.rstrip("/")) for u in urls]
        self._lock = threading.Lock()
        # Many chunks in flight per engine: the engine merges those that wait into one submission.
        self._pool = ThreadPoolExecutor(max_workers=max(16, 8 * len(urls)), thread_name_prefix="spice-fleet")

    def _headers(self) -> dict:
        return {"Authorization": f"Bearer {self.token}"}

    # ------------------------------------------------------------------------- health

    def health(self) -> dict[str, dict | None]:
        out = {}
        for e in self.engines:
            try:
                r = requests.get(e.url + "/health", timeout=10)
                r.raise_for_status()
                out[e.url] = r.json()
                e.healthy = True
                e.workers = int(out[e.url].get("workers", 1))
            except requests.RequestException:
                out[e.url] = None
                e.healthy = False
        return out

    def wait_until_healthy(self, timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            status = self.health()
            if all(v is not None for v in status.values()):
                return
            if time.monotonic() > deadline:
                down = [u for u, v in status.items() if v is None]
                raise FleetError(f"rollout engines not healthy after {timeout:.0f}s: {down}")
            time.sleep(1.0)

    def barrier(self, version: int) -> None:
        """Every healthy engine must hold weights `version` before a phase starts."""
        for url, st in self.health().items():
            if st is not None and str(st["version"]) != str(version):
                raise FleetError(f"engine {url} holds weights version {st['version']}, expected {version}")
        if not any(e.healthy for e in self.engines):
            raise FleetError("no healthy rollout engine")

    # ------------------------------------------------------------------------- generation

    def _pick(self, exclude: set[str]) -> EngineStats | None:
        with self._lock:
            candidates = [e for e in self.engines if e.healthy and e.url not in exclude]
            if not candidates:
                candidates = [e for e in self.engines if e.healthy]
            if not candidates:
                return None
            engine = min(candidates, key=lambda e: (e.in_flight, e.requests))
            engine.in_flight += 1
            return engine

    def _post_generate(self, engine: EngineStats, prompts: list, spec: SamplingSpec) -> list[list[Completion]]:
        t0 = time.perf_counter()
        try:
            r = requests.post(engine.url + "/generate", json={"prompts": prompts, "sampling": spec.to_json(),
                                                              "packed": True},
                              headers=self._headers(), timeout=self.request_timeout)
            if r.status_code >= 400:
                raise FleetError(f"engine {engine.url}: HTTP {r.status_code}: {r.text[:300]}")
            body = r.json()
        finally:
            with self._lock:
                engine.in_flight -= 1
        dt = time.perf_counter() - t0
        out = unpack_completions(body)
        with self._lock:
            engine.requests += 1
            engine.busy_seconds += dt
            engine.latencies.append(dt)
            engine.tokens += sum(len(c.token_ids) for comps in out for c in comps)
        return out

    def generate(self, prompts: list[str | list[int]], spec: SamplingSpec) -> list[list[Completion]]:
        """For each prompt, spec.n completions, in prompt order."""
        if not prompts:
            return []
        healthy = sum(e.healthy for e in self.engines) or len(self.engines)
        size = max(1, min(self.chunk_size, math.ceil(len(prompts) / healthy)))
        chunks = [(start, prompts[start:start + size]) for start in range(0, len(prompts), size)]
        results: dict[int, list[list[Completion]]] = {}
        attempts: dict[int, int] = {start: 0 for start, _ in chunks}
        tried: dict[int, set[str]] = {start: set() for start, _ in chunks}
        running: dict[Future, tuple[int, EngineStats]] = {}

        def submit(start: int, chunk: list) -> None:
            engine = self._pick(tried[start])
            if engine is None:
                raise NoEngineLeft("no healthy rollout engine left")
            attempts[start] += 1
            tried[start].add(engine.url)
            chunk_spec = replace(spec, seed=None if spec.seed is None else spec.seed + start)
            running[self._pool.submit(self._post_generate, engine, chunk, chunk_spec)] = (start, engine)

        by_start = dict(chunks)
        for start, chunk in chunks:
            submit(start, chunk)
        while running:
            done, _ = wait(list(running), return_when=FIRST_COMPLETED)
            for fut in done:
                start, engine = running.pop(fut)
                try:
                    out = fut.result()
                except (requests.RequestException, FleetError, ValueError) as e:
                    with self._lock:
                        engine.failures += 1
                        engine.healthy = False  # until a health check says otherwise
                    log.warning("engine %s failed on prompts %d..%d (%s); retrying elsewhere",
                                engine.url, start, start + len(by_start[start]) - 1, e)
                    if attempts[start] >= self.max_attempts:
                        raise FleetError(f"prompts {start}..{start + len(by_start[start]) - 1} failed on "
                                         f"{attempts[start]} engines; last error: {e}") from e
                    submit(start, by_start[start])
                    continue
                if start not in results:  # exactly once: the first answer wins
                    if len(out) != len(by_start[start]):
                        raise FleetError(f"engine {engine.url} answered {len(out)} of {len(by_start[start])} prompts")
                    results[start] = out
        return [comps for start, _ in chunks for comps in results[start]]

    # ------------------------------------------------------------------------- weight updates

    @property
    def num_receivers(self) -> int:
        """Weight-sync receivers: every worker of every engine (as reported by /health)."""
        return sum(e.workers for e in self.engines)

    def sync_client(self) -> "FleetSyncClient":
        return FleetSyncClient(self)

    def weight_checksums(self) -> dict[str, str]:
        """vLLM's own per-parameter digests, which must agree across engines after an update;
        raises naming the first parameter that differs. Returns the first engine's."""
        futures = [(e.url, self._pool.submit(self._control, e, "/weight_checksums", None, "GET"))
                   for e in self.engines]
        (url0, first), *rest = [(url, f.result()["checksums"]) for url, f in futures]
        for url, sums in rest:
            for name in sorted(set(first) | set(sums)):
                if first.get(name) != sums.get(name):
                    raise FleetError(f"engines {url0} and {url} hold different weights: first difference {name!r}")
        return first

    def _control(self, engine: EngineStats, path: str, body: dict | None, method: str = "POST") -> dict:
        r = requests.request(method, engine.url + path, json=body, headers=self._headers(),
                             timeout=self.request_timeout)
        if r.status_code >= 400:
            raise FleetError(f"engine {engine.url}{path}: HTTP {r.status_code}: {r.text[:500]}")
        return r.json()

    def _on_every_engine(self, path: str, bodies: list[dict | None]) -> list[dict]:
        futures = [self._pool.submit(self._control, e, path, b) for e, b in zip(self.engines, bodies)]
        results, error = [], None
        for f in futures:  # every engine's answer, so that none is left mid-request
            try:
                results.append(f.result())
            except Exception as e:  # noqa: BLE001 - the first one is raised
                error = error or e
        if error is not None:
            raise error
        return results

    def stats(self) -> dict[str, dict]:
        return {e.url: {"healthy": e.healthy, "requests": e.requests, "failures": e.failures, "tokens": e.tokens,
                        "tokens_per_s": e.tokens_per_second,
                        "latency_mean_s": sum(e.latencies) / len(e.latencies) if e.latencies else 0.0}
                for e in self.engines}

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class FleetSyncClient:
    """vLLM's `VLLMWeightSyncClient` (init / start / update / finish) over every engine of the fleet,
    through each engine's HTTP service; a call returns when every engine has answered. Each engine
    is a separate vLLM instance, so the client gives each its own `rank_offset`: the one it was
    given, plus the workers of the engines before it."""

    def __init__(self, fleet: RolloutFleet):
        self.fleet = fleet
        self.version: str | None = None  # stamped on an update whose trainer engine finishes without one

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        bodies, offset = [], int(init_info.get("rank_offset", 0))
        for e in self.fleet.engines:
            bodies.append({"init_info": {**init_info, "rank_offset": offset}} if "rank_offset" in init_info
                          else {"init_info": init_info})
            offset += e.workers
        self.fleet._on_every_engine("/init_weight_transfer_engine", bodies)

    def start_weight_update(self) -> None:
        self.fleet._on_every_engine("/start_weight_update", [None] * len(self.fleet.engines))

    def update_weights(self, update_info: dict | list[dict]) -> None:
        self.fleet._on_every_engine("/update_weights", [{"update_info": update_info}] * len(self.fleet.engines))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.fleet._on_every_engine("/finish_weight_update",
                                    [{"weight_version": weight_version or self.version}] * len(self.fleet.engines))

    def shutdown_weight_transfer_engine(self) -> None:
        self.fleet._on_every_engine("/shutdown_weight_transfer_engine", [None] * len(self.fleet.engines))
