"""One rollout engine behind HTTP.

  python -m spice_megatron.rollout.serve --model DIR [--host 127.0.0.1] [--port 8100] [--token T]

Why a small service of our own rather than vLLM's OpenAI-compatible server: the trainer needs
token ids and sampled-token log-probs back for every completion, and a weight-update path that
works on CPU (gloo) and GPU alike; vLLM's server exposes its RL weight-transfer routes for its
GPU transports only. Generation, health and version are plain JSON; the control endpoints (join
weight sync, receive weights, shutdown) need the shared token, and so does generation when the
service listens beyond loopback. No pickle crosses the wire.
"""
from __future__ import annotations

import argparse
import hmac
import logging
import os
import signal
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from pydantic import BaseModel, Field

from spice_megatron.rollout.types import SamplingSpec

log = logging.getLogger("spice.rollout.serve")
try:
    from vllm.exceptions import VLLMClientError

    VALIDATION_ERRORS: tuple = (ValueError, VLLMClientError)
except ImportError:  # older vLLM raises ValueError
    VALIDATION_ERRORS = (ValueError,)
LOOPBACK = ("127.0.0.1", "localhost", "::1")


class GenerateBody(BaseModel):
    prompts: list[str | list[int]] = Field(min_length=1)
    sampling: dict = Field(default_factory=dict)


class JoinBody(BaseModel):
    host: str
    port: int
    first_rank: int
    num_stages: int
    num_receivers: int
    backend: str = "auto"
    timeout_s: float = 600.0


class ReceiveBody(BaseModel):
    version: int


class GenerationBatcher:
    """Merges the /generate requests that wait while the engine is busy into one vLLM submission.
    The fleet sends a phase's prompts as many concurrent chunks; run one after another, each chunk
    would be its own small batch and vLLM's continuous batching would never see them together."""

    def __init__(self, engine, engine_thread: ThreadPoolExecutor):
        self.engine, self.engine_thread = engine, engine_thread
        self._pending: list[tuple[list, SamplingSpec, Future]] = []
        self._lock = threading.Lock()
        self.submissions = 0  # vLLM generate calls, for /health

    def generate(self, prompts: list, spec: SamplingSpec):
        done: Future = Future()
        with self._lock:
            self._pending.append((prompts, spec, done))
        self.engine_thread.submit(self._drain)
        return done.result()

    def _drain(self) -> None:  # on the engine thread; a later drain finds nothing left
        with self._lock:
            batch, self._pending = self._pending, []
        if not batch:
            return
        try:
            self.submissions += 1
            outs = self.engine.generate_many([(p, s) for p, s, _ in batch])
        except VALIDATION_ERRORS:  # one bad request must not fail the others: run them one by one
            for p, s, f in batch:
                try:
                    f.set_result(self.engine.generate(p, s))
                except Exception as e:  # noqa: BLE001 - handed to that request's caller
                    f.set_exception(e)
            return
        except Exception as e:  # noqa: BLE001
            for _, _, f in batch:
                f.set_exception(e)
            return
        for (_, _, f), out in zip(batch, outs):
            f.set_result(out)


def build_app(engine, token: str, require_token_for_generate: bool, engine_thread: ThreadPoolExecutor) -> FastAPI:
    """engine_thread: the one thread that built the engine and runs all its work. vLLM's CPU
    worker sets up its OpenMP threads from the thread that created it; work from other threads
    would run with a fresh, unbound thread team (measured: 15% slower)."""

    def on_engine(fn, *args):
        return engine_thread.submit(fn, *args).result()

    batcher = GenerationBatcher(engine, engine_thread)

    app = FastAPI(title="spice rollout engine")
    state: dict[str, Any] = {"requests": 0, "tokens": 0, "busy_seconds": 0.0}

    def check_token(request: Request) -> None:
        given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), token.encode()):
            raise HTTPException(status_code=401, detail="missing or wrong token")

    @app.get("/health")
    def health():
        return {"status": "ok", "version": engine.version, "model": engine.model_dir, "workers": engine.workers,
                "submissions": batcher.submissions, **state}

    @app.get("/version")
    def version():
        return {"version": engine.version}

    @app.post("/generate")
    def generate(body: GenerateBody, request: Request):
        if require_token_for_generate:
            check_token(request)
        try:
            spec = SamplingSpec.from_json(body.sampling)
        except (TypeError, ValueError) as e:
            raise HTTPException(status_code=400, detail=str(e)) from e
        t0 = time.perf_counter()
        try:
            out = batcher.generate(body.prompts, spec)
        except VALIDATION_ERRORS as e:  # vLLM's own checks (e.g. n > 1 with greedy sampling)
            raise HTTPException(status_code=400, detail=f"{type(e).__name__}: {e}") from e
        state["requests"] += 1
        state["tokens"] += sum(len(c.token_ids) for comps in out for c in comps)
        state["busy_seconds"] += time.perf_counter() - t0
        return {"version": engine.version, "completions": [[c.to_json() for c in comps] for comps in out]}

    @app.post("/weight_sync/join")
    def join(body: JoinBody, request: Request):
        check_token(request)
        return {"ranks": engine.join_weight_sync(body.host, body.port, body.first_rank, body.num_stages,
                                                 body.num_receivers, body.backend, body.timeout_s)}

    @app.post("/weight_sync/receive")
    def receive(body: ReceiveBody, request: Request):
        check_token(request)
        return on_engine(engine.receive_weights, body.version)

    @app.post("/shutdown")
    def shutdown(request: Request):
        check_token(request)
        threading.Timer(0.2, lambda: os.kill(os.getpid(), signal.SIGTERM)).start()
        return {"status": "shutting down"}

    return app


def _watch_parent(pid: int) -> None:
    def watch():
        while True:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                log.warning("parent %d is gone: exiting", pid)
                os._exit(0)
            time.sleep(2)

    threading.Thread(target=watch, daemon=True, name="spice-parent-watch").start()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="one vLLM rollout engine behind HTTP")
    ap.add_argument("--model", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8100)
    ap.add_argument("--token", default=os.environ.get("SPICE_ROLLOUT_TOKEN"),
                    help="shared secret for control endpoints (default: $SPICE_ROLLOUT_TOKEN)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--gpu-memory-utilization", type=float, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-cache-gib", type=float, default=None, help="KV cache size (default: 1 GiB on CPU)")
    ap.add_argument("--exit-with-parent", type=int, default=None, metavar="PID",
                    help="exit when process PID is gone (a trainer that started this engine and was killed)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    exposed = args.host not in LOOPBACK
    if not args.token:
        print("error: --token (or SPICE_ROLLOUT_TOKEN) is required: it guards the control endpoints", file=sys.stderr)
        return 2
    import uvicorn

    if args.exit_with_parent:
        _watch_parent(args.exit_with_parent)

    from spice_megatron.rollout.engine import VLLMEngine

    engine_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spice-engine")
    engine = engine_thread.submit(VLLMEngine, args.model, args.dtype, args.max_model_len, args.tensor_parallel_size,
                                  args.gpu_memory_utilization, args.seed, None, args.kv_cache_gib).result()
    app = build_app(engine, args.token, exposed, engine_thread)
    log.info("serving %s on %s:%d (token %s)", args.model, args.host, args.port, "set" if args.token else "unset")
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
