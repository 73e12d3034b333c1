"""One rollout engine behind HTTP.

  python -m spice_megatron.rollout.serve --model DIR [--host 127.0.0.1] [--port 8100] [--token T]
                                          [--weight-transfer spice]

Why a small service of our own rather than vLLM's OpenAI-compatible server: the trainer needs
token ids, sampled-token log-probs and weight-version spans back for every completion, and vLLM
exposes its RL control routes only in its dev mode, without authentication. This service maps
the same routes (`/init_weight_transfer_engine`, `/start_weight_update`, `/update_weights`,
`/finish_weight_update`, `/pause`, `/resume`, ...) onto vLLM's own methods, behind a shared token;
generation needs the token too when the service listens beyond loopback. Bodies are plain JSON:
no pickle crosses the wire.
"""
from __future__ import annotations

import argparse
import hmac
import json
import logging
import os
import signal
import sys
import threading
import time
from typing import Any, Literal

from fastapi import Body, FastAPI, HTTPException, Request, Response
from pydantic import BaseModel, Field

from spice_megatron.rollout.engine import version_label
from spice_megatron.rollout.types import SamplingSpec, pack_completions

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
    packed: bool = False  # token ids and log-probs as packed arrays (types.pack_completions)


def build_app(engine, token: str, require_token_for_generate: bool) -> FastAPI:
    """`engine`: a VLLMEngine whose `serve_forever` runs on the thread that built it; every call
    here goes through its inbox and runs between two decoding steps."""

    app = FastAPI(title="spice rollout engine")
    state: dict[str, Any] = {"requests": 0, "tokens": 0, "busy_seconds": 0.0}

    def check_token(request: Request) -> None:
        given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), token.encode()):
            raise HTTPException(status_code=401, detail="missing or wrong token")

    def control(request: Request, fn, *args):
        check_token(request)
        try:
            return engine.call(fn, *args).result()
        except VALIDATION_ERRORS as e:
            raise HTTPException(status_code=400, detail=f"{type(e).__name__}: {e}") from e
        except Exception as e:  # noqa: BLE001 - named for the trainer, which retries or fails the run
            log.exception("%s failed", request.url.path)
            raise HTTPException(status_code=500, detail=f"{type(e).__name__}: {e}") from e

    @app.get("/health")
    def health():
        return {"status": "ok", "version": version_label(engine.version), "model": engine.model_dir,
                "workers": engine.workers, "weight_transfer": engine.weight_transfer, "paused": engine.paused,
                "updating": engine.updating, "steps": engine.steps, "admissions": engine.admissions,
                "sleeping": sorted(engine.sleeping), "sleeps": engine.sleeps, "wakes": engine.wakes,
                "requests_while_asleep": engine.requests_while_asleep, **state}

    @app.get("/weight_info")
    def weight_info():
        return {"weight_version": engine.version}

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
            (out,) = engine.submit([(body.prompts, spec)]).result()
        except VALIDATION_ERRORS as e:  # vLLM's own checks (e.g. n > 1 with greedy sampling)
            raise HTTPException(status_code=400, detail=f"{type(e).__name__}: {e}") from e
        state["requests"] += 1
        state["tokens"] += sum(len(c.token_ids) for comps in out for c in comps)
        state["busy_seconds"] += time.perf_counter() - t0
        if body.packed:  # encoded here, not by FastAPI's jsonable_encoder walking every number
            payload = {"version": version_label(engine.version), **pack_completions(out)}
            return Response(json.dumps(payload), media_type="application/json")
        return {"version": version_label(engine.version), "completions": [[c.to_json() for c in comps] for comps in out]}

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
    ap.add_argument("--weight-transfer", default="spice",
                    help="vLLM weight-transfer backend (rollout.weight_transfer): spice, nccl, ipc, nccl_m2n")
    ap.add_argument("--enable-expert-parallel", action="store_true",
                    help="vLLM's expert parallelism over this engine's GPUs (mixture-of-experts models)")
    ap.add_argument("--return-routing", choices=["auto", "on", "off"], default="auto",
                    help="completions carry the experts chosen per token (routing replay); auto: for MoE models")
    ap.add_argument("--enable-sleep-mode", action="store_true",
                    help="the engine shares its GPUs with the learner (run.colocate): vLLM's sleep mode")
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (faster start; CPU always)")
    ap.add_argument("--start-asleep", action="store_true",
                    help="sleep (level 1: weights kept in host memory) before answering /health: engines started "
                         "before a colocated learner leave it the GPU memory to build in; the trainer wakes them")
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

    started: dict = {}

    def engine_thread() -> None:  # builds the engine, then runs it: one thread for both (see VLLMEngine)
        try:
            started["engine"] = VLLMEngine(args.model, args.dtype, args.max_model_len, args.tensor_parallel_size,
                                           args.gpu_memory_utilization, args.seed, args.enforce_eager or None,
                                           args.kv_cache_gib,
                                           args.weight_transfer, args.return_routing, args.enable_expert_parallel,
                                           args.enable_sleep_mode)
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
        raise started["error"]
    if args.start_asleep:
        started["engine"].call(started["engine"].sleep, 1).result()
    app = build_app(started["engine"], args.token, exposed)
    log.info("serving %s on %s:%d (token %s)", args.model, args.host, args.port, "set" if args.token else "unset")
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
