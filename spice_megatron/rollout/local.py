"""Rollout services started on this machine (the CPU demo, tests); cluster jobs start them with
srun on rollout nodes and hand the trainer their addresses instead."""
from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass

import requests

from spice_megatron.launch import free_port


@dataclass
class LocalEngine:
    url: str
    process: subprocess.Popen
    log_path: str
    args: list[str]

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        if self.alive():
            self.process.send_signal(signal.SIGKILL)
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
    return LocalEngine(f"http://127.0.0.1:{port}", proc, log_path, args)


def wait_healthy(engines: list[LocalEngine], timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    pending = list(engines)
    while pending:
        for e in list(pending):
            if not e.alive():
                tail = open(e.log_path, errors="replace").read()[-3000:]
                raise RuntimeError(f"rollout engine {e.url} exited with code {e.process.returncode}; log tail:\n{tail}")
            try:
                if requests.get(e.url + "/health", timeout=2).ok:
                    pending.remove(e)
            except requests.RequestException:
                pass
        if pending and time.monotonic() > deadline:
            raise RuntimeError(f"rollout engines not healthy after {timeout:.0f}s: {[e.url for e in pending]}")
        if pending:
            time.sleep(0.5)


def restart(engine: LocalEngine, token: str) -> LocalEngine:
    """Start a dead engine again on the same port with the same arguments."""
    engine.kill()
    port = int(engine.url.rsplit(":", 1)[1])
    model = engine.args[engine.args.index("--model") + 1]
    extra = engine.args[engine.args.index("--port") + 2:]
    return start_engine(model, token, os.path.dirname(engine.log_path), port, extra)


def engine_args(max_model_len: int, kv_cache_gib: float, seed: int) -> list[str]:
    """The service's arguments for an engine that lives and dies with this process."""
    return ["--max-model-len", str(max_model_len), "--kv-cache-gib", str(kv_cache_gib), "--seed", str(seed),
            "--exit-with-parent", str(os.getpid())]


@contextmanager
def local_fleet(model_dir: str, log_dir: str, max_model_len: int = 4096, kv_cache_gib: float = 1.0, seed: int = 0,
                engines: int = 1):
    """Local rollout services on `model_dir` for the duration of a block (evaluation, analysis);
    yields a RolloutFleet over them and stops them afterwards."""
    from spice_megatron.rollout.fleet import RolloutFleet

    token = secrets.token_hex(16)
    extra = engine_args(max_model_len, kv_cache_gib, seed)
    started = [start_engine(model_dir, token, log_dir, extra=extra) for _ in range(engines)]
    fleet = None
    try:
        wait_healthy(started)
        fleet = RolloutFleet([e.url for e in started], token)
        yield fleet
    finally:
        if fleet is not None:
            fleet.close()
        for e in started:
            e.stop()
