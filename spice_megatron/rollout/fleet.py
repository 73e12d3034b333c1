"""The fleet client: many generation requests across R rollout engines.

A phase's sequences (prompts x n) are cut into units of near-equal size, one per healthy engine
(at most rollout.chunk_size sequences each), so that every engine holds a near-equal share of a
phase: the selection step of 128 documents x 8, a later challenger round of a few pending documents
(their samples split over the engines), the reasoner's answers. Each unit goes to the healthy engine
with the fewest sequences in flight. A request whose engine dies, errors or times out is retried on
another engine; the first answer for a request is kept and any later one dropped, so every sample
is answered exactly once.
Sampling seeds are per prompt (seed + global index; a split prompt's later samples seeds of their
own), so results do not depend on which engine served a request; they do depend on how many
engines were healthy when a prompt's samples had to be split. With per-prompt seeds
(SamplingSpec.seeds, what self-play uses) sample k of prompt i samples with seeds[i] + k however
the samples are split or batched.
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace

import requests

from spice_megatron.rollout.fleet_sync import FleetSyncClient
from spice_megatron.rollout.request_plan import Request, plan_requests
from spice_megatron.wire.auth import AuthError, attest, signed_request
from spice_megatron.wire.types import Completion, SamplingSpec, unpack_completions

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
    attested: bool = False  # proved it holds the job's token since its last failure (nothing is sent before)
    workers: int = 1  # vLLM workers (engine tensor parallel size): each one receives weights
    in_flight: int = 0  # sequences (prompts x n) of its requests not answered yet
    posted: int = 0  # of them, those whose request has been sent (the others wait for room)
    room: int = 0  # sequences posted at a time: twice vLLM's max_num_seqs from /status (0: not known yet)
    requests: int = 0
    failures: int = 0
    tokens: int = 0
    busy_seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.busy_seconds if self.busy_seconds else 0.0


# Sequences posted to one engine at a time, where its /status does not say how many vLLM's scheduler
# runs at once (max_num_seqs: then twice that, a queue as deep as what runs, so that a slot a finished
# sequence frees is filled at once); a request beyond them waits here until answers make room. A
# request's timeout then measures the engine's work on it and one queue's worth, not its wait behind
# a whole batch: 1,408 sequences posted at once to one CPU engine under load timed out after 600 s,
# and the engine, alive, was taken for dead.
MAX_POSTED_SEQUENCES = 1024


class RolloutFleet:
    def __init__(self, urls: list[str], token: str, request_timeout: float = 600.0, max_attempts: int = 3,
                 chunk_size: int = 64, max_posted_sequences: int = MAX_POSTED_SEQUENCES):
        if not urls:
            raise FleetError("rollout.engines: at least one engine address is needed")
        self.token, self.request_timeout = token, request_timeout
        self.max_attempts, self.chunk_size = max_attempts, chunk_size
        self.engines = [EngineStats(u.rstrip("/")) for u in urls]
        self._lock = threading.Lock()
        self.max_posted_sequences = max_posted_sequences
        self.liveness_interval = 5.0  # seconds between the two looks at a slow engine's /status
        self._room = threading.Condition(self._lock)
        # Many chunks in flight per engine: the engine merges those that wait into one submission. A
        # streamed iteration has a request per document in flight (threads start only when used).
        self._pool = ThreadPoolExecutor(max_workers=max(256, 8 * len(urls)), thread_name_prefix="spice-fleet")

    # ------------------------------------------------------------------------- health

    def health(self) -> dict[str, dict | None]:
        """Each engine's /status, once it proved it holds the job's token (else None: not used)."""
        return {e.url: self._probe(e) for e in self.engines}

    def serves(self, url: str) -> bool:
        return any(e.url == url.rstrip("/") for e in self.engines)

    def probe(self, url: str) -> dict | None:
        """One engine's /status as health() reads it (None: down, busy past the timeout or not ours)."""
        return self._probe(next(e for e in self.engines if e.url == url.rstrip("/")))

    def _probe(self, e: EngineStats) -> dict | None:
        e.attested = False  # proved again at every check: a restarted engine is a new process
        try:
            status = self._control(e, "/status", None, "GET", timeout=10)
        except AuthError as err:
            log.warning("%s", err)
            status = None
        except (requests.RequestException, FleetError):
            status = None
        e.healthy = status is not None
        if status is not None:
            e.workers = int(status.get("workers", 1))
            e.room = 2 * int(status.get("max_num_seqs", 0))
        return status

    def _control(self, engine: EngineStats, path: str, body: dict | None, method: str = "POST",
                 timeout: float | None = None) -> dict:
        """One signed request's JSON answer, to an engine that has proved it holds the token (it is
        asked to first if it has not since its last failure)."""
        timeout = self.request_timeout if timeout is None else timeout
        try:
            if not engine.attested:
                attest(engine.url, self.token, timeout=min(timeout, 30))
                engine.attested = True
            r = signed_request(method, engine.url, path, self.token, body, timeout)
            if r.status_code >= 400:
                raise FleetError(f"engine {engine.url}{path.split('?')[0]}: HTTP {r.status_code}: {r.text[:500]}")
            return r.json()
        except (requests.RequestException, AuthError, FleetError, ValueError):
            engine.attested = False
            raise

    def _still_working(self, engine: EngineStats) -> bool:
        """Whether an engine that has not answered a request in time is alive and working: its
        /status answers, as the same process, and between two looks its decoding steps advance, or
        it is paused or asleep (a weight update), or it has nothing left to run (the answer waits
        for its client). Only an engine that fails this is taken for dead."""
        try:
            first = self._control(engine, "/status", None, "GET", timeout=30)
            time.sleep(self.liveness_interval)
            second = self._control(engine, "/status", None, "GET", timeout=30)
        except (requests.RequestException, AuthError, FleetError, ValueError):
            return False
        if second.get("pid") != first.get("pid"):
            return False
        return (second.get("steps", 0) > first.get("steps", 0) or bool(second.get("paused"))
                or bool(second.get("sleeping")) or second.get("running", 1) == 0)

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

    def _pick(self, exclude: set[str], sequences: int) -> EngineStats | None:
        """The healthy engine (outside `exclude` if it can be) holding the fewest sequences in flight."""
        with self._lock:
            candidates = [e for e in self.engines if e.healthy and e.url not in exclude]
            if not candidates:
                candidates = [e for e in self.engines if e.healthy]
            if not candidates:
                return None
            engine = min(candidates, key=lambda e: (e.in_flight, e.requests))
            engine.in_flight += sequences
            return engine

    def _post_generate(self, engine: EngineStats, prompts: list, spec: SamplingSpec) -> list[list[Completion]]:
        sequences = len(prompts) * spec.n
        with self._room:  # a request alone is always posted, however large
            room = engine.room or self.max_posted_sequences
            self._room.wait_for(lambda: engine.posted == 0 or engine.posted + sequences <= room)
            engine.posted += sequences
        t0 = time.perf_counter()
        body = {"prompts": prompts, "sampling": spec.to_json(), "packed": True, "request_id": uuid.uuid4().hex}
        try:
            while True:
                try:
                    out = unpack_completions(self._control(engine, "/generate", body))
                    break
                except requests.ReadTimeout:
                    if not self._still_working(engine):
                        raise
                    # posted again under its id: the engine answers with the first post's completions
                    log.warning("engine %s is still working on a request of %d sequences after %.0f s (rollout."
                                "request_timeout %.0f s): waiting for it", engine.url, sequences,
                                time.perf_counter() - t0, self.request_timeout)
        finally:
            with self._room:
                engine.posted -= sequences
                self._room.notify_all()
        dt = time.perf_counter() - t0
        with self._lock:
            engine.requests += 1
            engine.busy_seconds += dt
            engine.latencies.append(dt)
            engine.tokens += sum(len(c.token_ids) for comps in out for c in comps)
        return out

    def plan(self, num_prompts: int, n: int, engines: int) -> list[Request]:
        """A phase's requests: see `plan_requests`; a method so that a benchmark can compare policies."""
        return plan_requests(num_prompts, n, engines, self.chunk_size)

    def generate(self, prompts: list[str | list[int]], spec: SamplingSpec,
                 one_engine: bool = False) -> list[list[Completion]]:
        """For each prompt, spec.n completions, in prompt order. `one_engine`: the request is not
        spread over the engines (a streamed document's request: its prompt stays in one engine's
        prefix cache; the other engines are fed by the other documents' requests)."""
        if not prompts:
            return []
        if spec.seeds and len(spec.seeds) != len(prompts):
            raise ValueError(f"sampling.seeds: {len(spec.seeds)} seeds for {len(prompts)} prompts")
        healthy = 1 if one_engine else sum(e.healthy for e in self.engines) or len(self.engines)
        plan = self.plan(len(prompts), spec.n, healthy)
        results: dict[int, list[list[Completion]]] = {}
        attempts = [0] * len(plan)
        tried: list[set[str]] = [set() for _ in plan]
        unit_engine: dict[int, EngineStats] = {}
        running: dict[Future, tuple[int, EngineStats]] = {}

        def submit(k: int) -> None:
            req = plan[k]
            engine = unit_engine.get(req.unit) if not attempts[k] else None
            if engine is not None and engine.healthy:  # a unit's requests share its engine
                with self._lock:
                    engine.in_flight += req.sequences
            else:
                engine = self._pick(tried[k], req.sequences)
                if engine is None:
                    raise NoEngineLeft("no healthy rollout engine left")
                unit_engine.setdefault(req.unit, engine)
            attempts[k] += 1
            tried[k].add(engine.url)
            if spec.seeds:  # sample k of prompt i: seeds[i] + k, however the prompt's samples are split
                request_spec = replace(spec, n=req.n, seed=None,
                                       seeds=tuple(s + req.offset for s in spec.seeds[req.first:req.first + req.count]))
            else:
                seed = None if spec.seed is None else spec.seed + req.seed_offset(len(prompts))
                request_spec = replace(spec, n=req.n, seed=seed)
            chunk = prompts[req.first:req.first + req.count]
            running[self._pool.submit(self._post_generate, engine, chunk, request_spec)] = (k, engine)

        def describe(k: int) -> str:
            req = plan[k]
            what = f"prompts {req.first}..{req.first + req.count - 1}"
            return what if req.n == spec.n else f"{what} (samples {req.offset}..{req.offset + req.n - 1})"

        for k in range(len(plan)):
            submit(k)
        while running:
            done, _ = wait(list(running), return_when=FIRST_COMPLETED)
            for fut in done:
                k, engine = running.pop(fut)
                with self._lock:
                    engine.in_flight -= plan[k].sequences
                try:
                    out = fut.result()
                    if len(out) != plan[k].count or any(len(comps) != plan[k].n for comps in out):
                        raise FleetError(f"engine {engine.url} answered {[len(c) for c in out]} completions "
                                         f"for {describe(k)}, {plan[k].n} each asked")
                except (requests.RequestException, FleetError, AuthError, ValueError) as e:
                    with self._lock:
                        engine.failures += 1
                        engine.healthy = False  # until a health check says otherwise
                    log.warning("engine %s failed on %s (%s); retrying elsewhere", engine.url, describe(k), e)
                    if attempts[k] >= self.max_attempts:
                        raise FleetError(f"{describe(k)} failed on {attempts[k]} engines; last error: {e}") from e
                    submit(k)
                    continue
                results.setdefault(k, out)  # exactly once: the first answer wins
        answers: list[list[Completion]] = [[] for _ in prompts]
        for k, req in enumerate(plan):  # in plan order: a prompt's samples in offset order
            for i, comps in enumerate(results[k]):
                answers[req.first + i].extend(comps)
        return answers

    # ------------------------------------------------------------------------- weight updates

    @property
    def num_receivers(self) -> int:
        """Weight-sync receivers: every worker of every engine (as reported by /status)."""
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

    def on_every_engine(self, path: str, bodies: list[dict | None]) -> list[dict]:
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

    # ------------------------------------------------------------------------- sleep mode (run.colocate)

    def sleep(self, level: int) -> dict[str, float]:
        """Every healthy engine sleeps (vLLM's sleep mode). An engine that does not answer is marked
        unhealthy and left to the restart before the next sync. Returns the slowest engine's
        seconds, the device memory freed (GiB) and the generate calls that reached an engine while
        it slept (colocation sends none), summed over engines, and the engines that did not sleep."""
        return self._sleep_or_wake("/sleep", {"level": level}, "freed_gib")

    def wake_up(self, tags: list[str] | None = None) -> dict[str, float]:
        """Every healthy engine wakes `tags` (vLLM's: "weights", then "kv_cache"; None: both)."""
        return self._sleep_or_wake("/wake_up", {"tags": tags}, "taken_gib")

    def _sleep_or_wake(self, path: str, body: dict, memory: str) -> dict[str, float]:
        engines = [e for e in self.engines if e.healthy]
        futures = [(e, self._pool.submit(self._control, e, path, body)) for e in engines]
        seconds, gib, early, failed = 0.0, 0.0, 0, []
        for e, f in futures:
            try:
                answer = f.result()
            except (requests.RequestException, FleetError) as err:
                with self._lock:
                    e.healthy, e.failures = False, e.failures + 1
                log.warning("engine %s failed %s (%s); it is restarted before the next weight sync", e.url, path, err)
                failed.append(e.url)
                continue
            seconds, gib = max(seconds, float(answer.get("seconds", 0.0))), gib + float(answer.get(memory, 0.0))
            early += int(answer.get("requests_while_asleep", 0))
        return {"seconds": seconds, memory: gib, "requests_while_asleep": early,
                "not_asleep" if path == "/sleep" else "not_awake": failed}

    def stats(self) -> dict[str, dict]:
        return {e.url: {"healthy": e.healthy, "requests": e.requests, "failures": e.failures, "tokens": e.tokens,
                        "tokens_per_s": e.tokens_per_second,
                        "latency_mean_s": sum(e.latencies) / len(e.latencies) if e.latencies else 0.0}
                for e in self.engines}

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
