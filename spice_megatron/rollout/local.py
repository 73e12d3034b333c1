"""Rollout services started on this machine (the CPU demo, tests); cluster jobs start them with
srun on rollout nodes and hand the trainer their addresses instead."""
from __future__ import annotations

import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import requests

from spice_megatron.torchrun import free_port
from spice_megatron.wire.auth import AuthError, attest, signed_request

log = logging.getLogger(__name__)


@dataclass
class LocalEngine:
    url: str
    process: subprocess.Popen
    log_path: str
    args: list[str]
    env: dict | None = None  # what start_engine added to the environment (the engine's GPUs)
    token: str = field(default="", repr=False)  # the job's secret: the engine proves it holds it

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        if self.alive():
            # the whole session: vLLM's engine-core and worker processes die with the service
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait(30)

    def stop(self, timeout: float = 30) -> None:
        if self.alive():
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()


def start_engine(model_dir: str, token: str, log_dir: str, port: int | None = None, extra: list[str] | None = None,
                 env: dict | None = None) -> LocalEngine:
    port = port or free_port()
    os.makedirs(log_dir, exist_ok=True)
    log_path = os.path.join(log_dir, f"rollout_{port}.log")
    args = [sys.executable, "-m", "spice_megatron.rollout.serve", "--model", model_dir, "--port", str(port),
            *(extra or [])]
    child_env = {**os.environ, "SPICE_ROLLOUT_TOKEN": token, **(env or {})}
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=child_env, start_new_session=True)
    return LocalEngine(f"http://127.0.0.1:{port}", proc, log_path, args, env, token)


class EngineExited(RuntimeError):
    def __init__(self, engine: LocalEngine, tail: str):
        super().__init__(f"rollout engine {engine.url} exited with code {engine.process.returncode}; log tail:\n{tail}")
        self.engine, self.tail = engine, tail


def wait_healthy(engines: list[LocalEngine], timeout: float = 600.0) -> None:
    """Until every engine answers and proves it holds the job's token. Something else answering on
    an engine's port is never trusted: our engine binds the port before loading, so it exits when
    the port is taken (start_engines then picks another) and until then this keeps waiting."""
    start = time.monotonic()
    deadline, reported = start + timeout, start
    pending = list(engines)
    impostors: dict[str, str] = {}
    log.info("starting %d rollout engine(s): vLLM loads the model and warms up (logs: %s)", len(engines),
             os.path.dirname(engines[0].log_path) if engines else "-")
    while pending:
        for e in list(pending):
            if not e.alive():
                raise EngineExited(e, open(e.log_path, errors="replace").read()[-3000:])
            try:
                attest(e.url, e.token, timeout=2)
                # the engine this run started, not a sibling's answer relayed: its signed pid
                pid = signed_request("GET", e.url, "/status", e.token, timeout=10).json().get("pid")
                if pid != e.process.pid:
                    raise AuthError(f"the engine answering at {e.url} is process {pid}, not the one started there "
                                    f"({e.process.pid}): not trusted")
                pending.remove(e)
            except requests.RequestException:
                pass
            except AuthError as err:
                if e.url not in impostors:
                    log.warning("%s", err)
                impostors[e.url] = str(err)
        if pending and time.monotonic() > deadline:
            why = "; ".join(impostors[e.url] for e in pending if e.url in impostors)
            raise RuntimeError(f"rollout engines not healthy after {timeout:.0f}s: {[e.url for e in pending]}"
                               + (f" ({why})" if why else ""))
        if pending and time.monotonic() - reported >= 20:  # engine start is minutes on a large model: say so
            reported = time.monotonic()
            log.info("rollout engines: %d of %d ready after %.0fs; %s: %s", len(engines) - len(pending), len(engines),
                     reported - start, pending[0].url, _last_line(pending[0].log_path))
        if pending:
            time.sleep(0.5)
    log.info("rollout engines ready: %d in %.0fs", len(engines), time.monotonic() - start)


def _last_line(path: str) -> str:
    """The last non-empty line of an engine's log (what it is doing now), shortened."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - 4096))
            lines = [line.strip() for line in f.read().decode(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "(no log yet)"
    return (lines[-1][-160:] if lines else "(no log yet)")


def start_engines(model_dir: str, token: str, log_dir: str, extra: list[str], envs: list[dict],
                  timeout: float = 600.0, attempts: int = 3) -> list[LocalEngine]:
    """Start one engine per entry of `envs` and wait until all are healthy. A free port can be taken
    by another process between free_port() and the engine's bind (parallel test workers, other
    runs): such an engine is started again on another port."""
    engines = [start_engine(model_dir, token, log_dir, extra=extra, env=env) for env in envs]
    for attempt in range(attempts):
        try:
            wait_healthy(engines, timeout)
            return engines
        except EngineExited as e:
            if "address already in use" not in e.tail.lower() or attempt == attempts - 1:
                for other in engines:
                    other.stop()
                raise
            i = engines.index(e.engine)
            engines[i] = start_engine(model_dir, token, log_dir, extra=extra, env=e.engine.env)
    raise AssertionError("unreachable")


def restart(engine: LocalEngine, token: str) -> LocalEngine:
    """Start a dead engine again on the same port with the same arguments and GPUs."""
    engine.kill()
    port = int(engine.url.rsplit(":", 1)[1])
    model = engine.args[engine.args.index("--model") + 1]
    extra = engine.args[engine.args.index("--port") + 2:]
    return start_engine(model, token, os.path.dirname(engine.log_path), port, extra, env=engine.env)


def engine_args(max_model_len: int, kv_cache_gib: float, seed: int, on_gpu: bool | None = None,
                tensor_parallel: int = 1, gpu_memory_utilization: float = 0.85,
                weight_transfer: str = "spice", expert_parallel: bool = False, max_num_batched_tokens: int = 0,
                max_num_seqs: int = 0) -> list[str]:
    """The service's arguments for an engine that lives and dies with this process. The KV cache
    is sized by hand on CPU only; on a GPU vLLM sizes it from gpu_memory_utilization (a fixed
    1 GiB holds less than one 8,192-token sequence of Qwen3-8B, and vLLM would refuse to start)."""
    import torch

    on_gpu = torch.cuda.is_available() if on_gpu is None else on_gpu
    memory = (["--tensor-parallel-size", str(tensor_parallel), "--gpu-memory-utilization", str(gpu_memory_utilization)]
              if on_gpu else ["--kv-cache-gib", str(kv_cache_gib)])
    if on_gpu and expert_parallel:
        memory.append("--enable-expert-parallel")
    for flag, value in (("--max-num-batched-tokens", max_num_batched_tokens), ("--max-num-seqs", max_num_seqs)):
        memory += [flag, str(value)] if value else []  # 0: the engine's pinned default (rollout/step_settings.py)
    return ["--max-model-len", str(max_model_len), *memory, "--seed", str(seed), "--weight-transfer", weight_transfer,
            "--exit-with-parent", str(os.getpid())]


def engine_devices(engines: int, tensor_parallel: int, reserved: int, visible: list[str] | None = None) -> list[dict]:
    """CUDA_VISIBLE_DEVICES for each local engine: the GPUs after the first `reserved` (the
    learner's local ranks), `tensor_parallel` each. Refuses when they do not fit, rather than
    letting every engine land on the learner's GPU 0. On a machine without GPUs: no assignment."""
    import torch

    if visible is None:
        if not torch.cuda.is_available():
            return [{} for _ in range(engines)]
        env = os.environ.get("CUDA_VISIBLE_DEVICES")
        visible = env.split(",") if env else [str(i) for i in range(torch.cuda.device_count())]
    free = visible[reserved:]
    need = engines * tensor_parallel
    if len(free) < need:
        raise RuntimeError(
            f"rollout.local_engines={engines} x rollout.engine_tensor_parallel={tensor_parallel} need {need} GPU(s), "
            f"but this node has {len(visible)} and the learner uses {reserved}; lower rollout.local_engines, run the "
            "learner on fewer GPUs, or start engines elsewhere and pass rollout.engines")
    return [{"CUDA_VISIBLE_DEVICES": ",".join(free[i * tensor_parallel:(i + 1) * tensor_parallel])}
            for i in range(engines)]


@contextmanager
def local_fleet(model_dir: str, log_dir: str, max_model_len: int = 4096, kv_cache_gib: float = 1.0, seed: int = 0,
                engines: int = 1, tensor_parallel: int = 1):
    """Local rollout services on `model_dir` for the duration of a block (evaluation, analysis);
    yields a RolloutFleet over them and stops them afterwards. On a GPU machine each engine gets
    its own `tensor_parallel` GPUs (no learner runs here)."""
    from spice_megatron.rollout.fleet import RolloutFleet

    token = secrets.token_hex(16)
    extra = engine_args(max_model_len, kv_cache_gib, seed, tensor_parallel=tensor_parallel)
    started = start_engines(model_dir, token, log_dir, extra, engine_devices(engines, tensor_parallel, reserved=0))
    fleet = None
    try:
        fleet = RolloutFleet([e.url for e in started], token)
        yield fleet
    finally:
        if fleet is not None:
            fleet.close()
        for e in started:
            e.stop()
