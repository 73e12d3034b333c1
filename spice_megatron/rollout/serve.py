"""One rollout engine behind HTTP.

  SPICE_ROLLOUT_TOKEN=... python -m spice_megatron.rollout.serve --model DIR [--host 127.0.0.1] [--port 8100]
                                          [--weight-transfer spice]

Why a small service of our own rather than vLLM's OpenAI-compatible server: the trainer needs
token ids, sampled-token log-probs and weight-version spans back for every completion, and vLLM
exposes its RL control routes only in its dev mode, without authentication. This service maps
the same routes (`/init_weight_transfer_engine`, `/start_weight_update`, `/update_weights`,
`/finish_weight_update`, `/pause`, `/resume`, ...) onto vLLM's own methods. Every route but
`/health` and `/attest` needs a request signed with the job's token (wire/auth.py), which
never crosses the wire; the port is bound before the model loads, so no other process can take
it meanwhile, and `/attest` lets the trainer check that it talks to the engine it started. Bodies
are plain JSON (no pickle crosses the wire), their size and `n` and prompt count are capped.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import secrets
import signal
import socket
import sys
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import Body, FastAPI, HTTPException, Query, Request, Response
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel, Field

from spice_megatron.rollout.engine import version_label
from spice_megatron.rollout.engine_args import (
    add_engine_args,
    engine_options,
    parse_engine_args,
    span_from_args,
    watch_port,
)
from spice_megatron.rollout.signed_requests import SignedRequests
from spice_megatron.wire.auth import (
    TOKEN_ENV,
    TOKEN_FILE_ENV,
    AuthError,
    RequestVerifier,
    attest_proof,
    read_token,
)
from spice_megatron.wire.types import SamplingSpec, pack_completions

log = logging.getLogger("spice.rollout.serve")
try:
    from vllm.exceptions import VLLMClientError

    VALIDATION_ERRORS: tuple = (ValueError, VLLMClientError)
except ImportError:  # older vLLM raises ValueError
    VALIDATION_ERRORS = (ValueError,)
MAX_CONNECTIONS = 1024  # uvicorn answers 503 beyond this many connections at once


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask of the engine; beyond it the answer is one 4xx line and the engine
    keeps serving (the trainer's own requests stay far below: rollout.chunk_size sequences)."""

    max_n: int = 1024
    max_prompts: int = 4096
    max_body_bytes: int = 64 * 2**20


class GenerateBody(BaseModel):
    prompts: list[str | list[int]] = Field(min_length=1)
    sampling: dict = Field(default_factory=dict)
    packed: bool = False  # token ids and log-probs as packed arrays (types.pack_completions)
    # the client's name for this request: a request posted again under the same id (the client's read
    # timed out while this engine kept working on it) waits for the first one's answer, not a second run
    request_id: str | None = Field(default=None, max_length=64)


# answers to requests posted with an id whose client has not taken them (it timed out and posts again)
UNCLAIMED_ANSWERS = 256


def bound_host(listener: socket.socket) -> str:
    """The address a listening socket is bound to, as its attestation names it ("" for every interface)."""
    import ipaddress

    address = ipaddress.ip_address(listener.getsockname()[0].split("%")[0])
    return "" if address.is_unspecified else str(address)


def build_app(engine, token: str, port: int, limits: RequestLimits = RequestLimits(), host: str = "") -> FastAPI:
    """`engine`: a VLLMEngine whose `serve_forever` runs on the thread that built it; every call
    here goes through its inbox and runs between two decoding steps. `port` and `host`: what this
    engine's socket is bound to, which its attestation names (host "": every interface, where only the
    port is bound into the proof)."""
    instance = secrets.token_hex(16)  # this engine process: signed requests name it
    verifier = RequestVerifier(token, instance)
    # no /docs, /redoc or /openapi.json: they would describe the engine to anyone who asks
    app = FastAPI(title="spice rollout engine", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(SignedRequests, verifier=verifier, token=token, max_bytes=limits.max_body_bytes)
    state: dict[str, Any] = {"requests": 0, "tokens": 0, "busy_seconds": 0.0}
    by_request_id: OrderedDict[str, Future] = OrderedDict()  # in flight, or answered but not taken

    def control(request: Request, fn, *args):
        try:
            return engine.call(fn, *args).result()
        except VALIDATION_ERRORS as e:
            raise HTTPException(status_code=400, detail=f"{type(e).__name__}: {e}") from e
        except Exception as e:  # noqa: BLE001 - named for the trainer, which retries or fails the run
            log.exception("%s failed", request.url.path)
            raise HTTPException(status_code=500, detail=f"{type(e).__name__}: {e}") from e

    @app.get("/health")
    def health():  # open: says only that something answers here; /attest says whether it is ours
        return {"status": "ok"}

    @app.get("/attest")
    def attest(nonce: str = Query(min_length=16, max_length=128)):
        return {"proof": attest_proof(token, nonce, port, instance, host), "instance": instance, "host": host}

    @app.get("/status")
    def status():
        return {"status": "ok", "pid": os.getpid(), "version": version_label(engine.version), "model": engine.model_dir,
                "workers": engine.workers, "max_num_seqs": engine.max_num_seqs, "quantization": engine.quantization,
                "weight_transfer": engine.weight_transfer, "paused": engine.paused,
                "updating": engine.updating, "steps": engine.steps, "admissions": engine.admissions,
                "running": engine.running,
                "sleeping": sorted(engine.sleeping), "sleeps": engine.sleeps, "wakes": engine.wakes,
                "requests_while_asleep": engine.requests_while_asleep, **state}

    @app.get("/weight_info")
    def weight_info():
        return {"weight_version": engine.version}

    # async: a request waits on the engine's future without holding a thread of the server's pool
    # (40 threads), so that many requests in flight (a streamed iteration's, one per document) never
    # keep /status and the control routes waiting behind them
    @app.post("/generate")
    async def generate(body: GenerateBody, request: Request):
        try:
            spec = SamplingSpec.from_json(body.sampling)
        except (TypeError, ValueError) as e:
            raise HTTPException(status_code=400, detail=str(e)) from e
        if spec.n > limits.max_n or len(body.prompts) > limits.max_prompts:
            raise HTTPException(status_code=413, detail=f"{len(body.prompts)} prompts x n={spec.n}: this engine takes "
                                f"at most {limits.max_prompts} prompts and n <= {limits.max_n} per request")
        t0 = time.perf_counter()
        key = body.request_id
        try:
            future = by_request_id.get(key) if key else None
            if future is None:
                future = engine.submit([(body.prompts, spec)])
                if key:
                    by_request_id[key] = future
                    while len(by_request_id) > UNCLAIMED_ANSWERS:
                        by_request_id.popitem(last=False)
            (out,) = await asyncio.wrap_future(future)
        except VALIDATION_ERRORS as e:  # vLLM's own checks (e.g. n > 1 with greedy sampling)
            raise HTTPException(status_code=400, detail=f"{type(e).__name__}: {e}") from e
        if key and not await request.is_disconnected():  # answered to its client: nobody asks again
            by_request_id.pop(key, None)
        state["requests"] += 1
        state["tokens"] += sum(len(c.token_ids) for comps in out for c in comps)
        state["busy_seconds"] += time.perf_counter() - t0
        version = version_label(engine.version)
        if body.packed:  # encoded here (off the event loop), not by FastAPI's jsonable_encoder walking every number
            text = await run_in_threadpool(lambda: json.dumps({"version": version, **pack_completions(out)}))
            return Response(text, media_type="application/json")
        return {"version": version, "completions": [[c.to_json() for c in comps] for comps in out]}

    # vLLM's RL control plane, under its own route names and bodies
    @app.post("/init_weight_transfer_engine")
    def init_weight_transfer_engine(request: Request, init_info: dict = Body(embed=True)):
        return control(request, engine.init_weight_transfer, init_info) or {"status": "ok"}

    @app.post("/start_weight_update")
    def start_weight_update(request: Request):
        return control(request, engine.start_weight_update) or {"status": "ok"}

    @app.post("/update_weights")
    def update_weights(request: Request, update_info: dict | list[dict] = Body(embed=True)):
        return control(request, engine.update_weights, update_info) or {"status": "ok"}

    @app.post("/finish_weight_update")
    def finish_weight_update(request: Request, weight_version: str | None = Body(default=None, embed=True)):
        control(request, engine.finish_weight_update, weight_version)
        return {"status": "ok", "version": version_label(engine.version)}

    @app.post("/shutdown_weight_transfer_engine")
    def shutdown_weight_transfer_engine(request: Request):
        return control(request, engine.shutdown_weight_transfer) or {"status": "ok"}

    @app.post("/pause")
    def pause(request: Request, mode: Literal["keep"] = "keep"):  # "abort" would throw rollouts away
        return control(request, engine.pause) or {"status": "paused"}

    @app.post("/resume")
    def resume(request: Request):
        return control(request, engine.resume) or {"status": "resumed"}

    # vLLM's sleep mode (run.colocate): the learner steps on the engine's GPUs while it sleeps
    @app.post("/sleep")
    def sleep(request: Request, level: int = Body(default=1, embed=True)):
        return {"status": "asleep", **control(request, engine.sleep, level)}

    @app.post("/wake_up")
    def wake_up(request: Request, tags: list[str] | None = Body(default=None, embed=True)):
        return {"status": "awake" if not engine.sleeping else "partly awake", **control(request, engine.wake_up, tags)}

    @app.get("/is_sleeping")
    def is_sleeping():
        return {"is_sleeping": bool(engine.sleeping), "tags": sorted(engine.sleeping)}

    @app.get("/weight_checksums")
    def weight_checksums(request: Request):
        return {"version": version_label(engine.version), "checksums": control(request, engine.weight_checksums)}

    @app.post("/shutdown")
    def shutdown(request: Request):
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
    ap = argparse.ArgumentParser(description="one vLLM rollout engine behind HTTP", allow_abbrev=False)  # no --token
    add_engine_args(ap)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8100)
    ap.add_argument("--token-file", default=None,
                    help="a file (mode 600) holding the job's shared secret; default: $SPICE_ROLLOUT_TOKEN, or the "
                         "file named by $SPICE_ROLLOUT_TOKEN_FILE (never a flag: a command line is visible to all)")
    ap.add_argument("--max-n", type=int, default=RequestLimits.max_n, help="samples per prompt a request may ask")
    ap.add_argument("--max-prompts", type=int, default=RequestLimits.max_prompts, help="prompts per request")
    ap.add_argument("--max-body-mb", type=float, default=RequestLimits.max_body_bytes / 2**20,
                    help="request body size (MiB)")
    ap.add_argument("--start-asleep", action="store_true",
                    help="sleep (level 1: weights kept in host memory) before answering /health: engines started "
                         "before a colocated learner leave it the GPU memory to build in; the trainer wakes them")
    ap.add_argument("--exit-with-parent", type=int, default=None, metavar="PID",
                    help="exit when process PID is gone (a trainer that started this engine and was killed)")
    args = parse_engine_args(ap, argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from spice_megatron.rollout.node_watch import DIE_WITH_PARENT_ENV, trusted_network_refusal

    os.environ.pop(DIE_WITH_PARENT_ENV, None)  # only an engine across nodes arms it, with its own pid (below)
    if args.nnodes > 1:
        if refusal := trusted_network_refusal():
            print(f"error: --nnodes {args.nnodes}: {refusal}", file=sys.stderr)
            return 2
    try:
        token = read_token(args.token_file)
    except AuthError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not token:
        print("error: SPICE_ROLLOUT_TOKEN (or a --token-file) is required: it signs every request", file=sys.stderr)
        return 2
    # vLLM's side of the weight transfer (rollout/engine_transfer.py, in this process and vLLM's workers)
    # reads the token from the environment: from a file too, or it would receive unsigned weights
    os.environ.pop(TOKEN_FILE_ENV, None)
    os.environ[TOKEN_ENV] = token
    try:  # bound before the model loads (minutes on a large model): no other process can take the port meanwhile
        listener = _bind(args.host, args.port)
    except OSError as e:
        print(f"error: cannot listen on {args.host}:{args.port}: {e.strerror or e}", file=sys.stderr)
        return 2
    import uvicorn

    if args.exit_with_parent:
        _watch_parent(args.exit_with_parent)

    from spice_megatron.rollout.engine import VLLMEngine

    started: dict = {}
    if args.nnodes > 1:  # its followers on the other nodes: the engine lives and dies whole
        from spice_megatron.rollout.node_watch import watch_followers, workers_die_with_this_process
        from spice_megatron.torchrun import free_port

        watching = watch_port(args)
        if args.master_port == 0:  # vLLM's store: a port of this start's, told only to proven followers
            args.master_port = free_port()
        workers_die_with_this_process()  # and its own workers with it (they are built on the engine thread,
        watch_followers(args.master_addr, watching, args.nnodes - 1, token=token,  # which lives as long as this)
                        master_port=args.master_port)

    def engine_thread() -> None:  # builds the engine, then runs it: one thread for both (see VLLMEngine)
        try:
            started["engine"] = VLLMEngine(**engine_options(args), span=span_from_args(args, 0))
        except BaseException as e:  # noqa: BLE001
            started["error"] = e
        finally:
            ready.set()
        if "engine" in started:
            try:
                started["engine"].serve_forever()
            except BaseException:  # noqa: BLE001 - a broken engine must not keep a port open
                log.exception("the engine loop failed: exiting")
                os._exit(1)

    ready = threading.Event()
    threading.Thread(target=engine_thread, daemon=True, name="spice-engine").start()
    ready.wait()
    if "error" in started:
        from spice_megatron.rollout.step_settings import EngineSettingsError

        if isinstance(started["error"], EngineSettingsError):
            print(f"error: {started['error']}", file=sys.stderr)
            return 2
        raise started["error"]
    if args.start_asleep:
        started["engine"].call(started["engine"].sleep, 1).result()
    limits = RequestLimits(args.max_n, args.max_prompts, int(args.max_body_mb * 2**20))
    app = build_app(started["engine"], token, listener.getsockname()[1], limits, bound_host(listener))
    log.info("serving %s on %s:%d (signed requests only)", args.model, args.host, args.port)
    uvicorn.Server(uvicorn.Config(app, log_level="warning", limit_concurrency=MAX_CONNECTIONS)).run(sockets=[listener])
    return 0


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart on the port of a dead engine
    try:
        sock.bind((host, port))
        # listening at once: Linux lets another socket with SO_REUSEADDR bind a port that is bound
        # but not listening (docs/cluster.md, "Engines cannot be impersonated"); connections that come
        # while the model loads wait in the backlog
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(False)
    return sock


if __name__ == "__main__":
    sys.exit(main())
