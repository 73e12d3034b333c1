"""The driver (driver.py) in a process of its own on the learner's first node (run.driver=process).

In a thread of rank 0 the driver's work (tokenising prompts, parsing the fleet's responses, verifying
answers, building records) holds the same interpreter lock as rank 0's Megatron step, and every
TP/DP collective waits for rank 0. Here it runs in a child process: rank 0 holds a `DriverProcess`
with the `Driver`'s interface, sends it calls through a pipe and receives finished batches. The
weight sync's control plane and the evaluation hook stay on rank 0, through a fleet client of its own
(`fleet`) over the engines the driver started or was given.

Calls are answered in order, except `start_selfplay` (one step off): its sampler/RNG snapshot comes
back at once and its batch when the rollouts finish, so that rank 0 can log, checkpoint and sync
while they run; and `start_streamed`, whose complete documents' sequences come back one answer each
(marked partial) before its batch. The driver process keeps each batch's records until rank 0 logs that batch, so they
cross the pipe once (rank 0 holds them too: a checkpoint taken one step off saves the batch waiting
to be trained, records included). A checkpoint's driver state, the audit trail and the metrics are the driver's, as
in a thread, so kill -9 resume and engine restarts are exactly those of the in-thread driver. If the
driver process dies, every waiting call fails with its exit code (the run stops, as rank 0 would); if
rank 0 dies, the driver process sees its pipe close and stops its engines.
"""
from __future__ import annotations

import itertools
import logging
import multiprocessing
import os
import pickle
import queue
import signal
import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FuturesTimeout
from typing import Any

from spice_megatron.config import SpiceConfig
from spice_megatron.loop.driver import IterationAbandoned, KillSwitch
from spice_megatron.loop.interfaces import RolloutBatch
from spice_megatron.rollout.fleet import FleetError, RolloutFleet
from spice_megatron.torchrun import die_with_parent

log = logging.getLogger("spice.trainer")

_HELLO = 0  # the call id of the driver's start-up answer (its engines' addresses)


class DriverProcess:
    """Rank 0's handle on the driver process: the `Driver` methods the training loop calls."""

    def __init__(self, cfg: SpiceConfig, resume_state: dict | None, stop_file: str):
        ctx = multiprocessing.get_context("spawn")  # no copy of rank 0's torch / Megatron state
        self._conn, child = ctx.Pipe()
        self._send_lock = threading.Lock()
        self._ids = itertools.count(_HELLO + 1)
        self._waiting: dict[int, Future] = {_HELLO: Future()}
        self._partials: dict[int, queue.Queue] = {}  # a streamed batch's call id -> its documents' sequences
        # records of batches the driver process made, which it still holds: id(records) -> (records, iteration)
        self._held: dict[int, tuple[list, int]] = {}
        self.process = ctx.Process(target=_serve, name="spice-driver",
                                   args=(child, cfg, resume_state, stop_file, logging.getLogger().level, os.getpid()))
        self.process.start()
        child.close()
        self._reader = threading.Thread(target=self._read, name="spice-driver-reader", daemon=True)
        self._reader.start()
        try:
            hello = self._result(self._waiting[_HELLO])
        except BaseException:  # its error, or a Ctrl-C while it starts: it ends when the pipe closes
            self._conn.close()
            self.process.join(60)
            if self.process.is_alive():
                self.process.terminate()
            raise
        self.fleet = RolloutFleet(hello["urls"], hello["token"], cfg.rollout.request_timeout,
                                  chunk_size=cfg.rollout.chunk_size)
        self.fleet.health()  # the workers per engine: the weight sync's receivers

    # ------------------------------------------------------------------------- the Driver's interface

    def selfplay(self, iteration: int, version: int) -> RolloutBatch:
        return self._hold(self._call("selfplay", iteration, version))

    def start_selfplay(self, iteration: int, version: int) -> tuple[Future, dict]:
        call_id, batch = self._future()
        held: Future = Future()
        batch.add_done_callback(lambda f: held.set_exception(f.exception()) if f.exception()
                                else held.set_result(self._hold(f.result())))
        snapshot = self._call("start_selfplay", iteration, version, call_id)
        return held, snapshot

    def start_streamed(self, iteration: int, version: int) -> tuple[Future, queue.Queue]:
        """Driver.start_streamed: each complete document's sequences cross the pipe as they come
        (answers to the batch's call id that do not end it), then the batch; None after it."""
        call_id, batch = self._future()
        chunks: queue.Queue = queue.Queue()
        self._partials[call_id] = chunks
        held: Future = Future()

        def done(f: Future) -> None:
            self._partials.pop(call_id, None)
            held.set_exception(f.exception()) if f.exception() else held.set_result(self._hold(f.result()))
            chunks.put(None)

        batch.add_done_callback(done)
        self._call("start_streamed", iteration, version, call_id)
        return held, chunks

    def _hold(self, batch: RolloutBatch) -> RolloutBatch:
        self._held[id(batch.records)] = (batch.records, batch.iteration)
        return batch

    def restart_dead_engines(self) -> bool:
        restarted = self._call("restart_dead_engines")
        if restarted:
            self.fleet.health()
        return restarted

    def kill_engines(self, urls: list[str]) -> list[str]:
        return self._call("kill_engines", urls)

    def recover_engines(self, why: str) -> str:
        reason = self._call("recover_engines", why)
        self.fleet.health()
        return reason

    def log(self, iteration: int, stats: dict[str, float], records: list[dict]) -> None:
        held = self._held.pop(id(records), None)
        if held is not None and held[0] is records:  # the driver process has them: name the batch
            self._call("log_held", iteration, stats, held[1])
        else:  # a batch it never made (one restored from a checkpoint)
            self._call("log", iteration, stats, records)

    def check_kill_switch(self, stats: dict[str, float], loss: float, grad_norm: float) -> None:
        self._call("check_kill_switch", stats, loss, grad_norm)

    def state(self) -> dict:
        return self._call("state")

    def close(self) -> None:
        try:
            if self.process.is_alive():
                self._call("close")
        except (RuntimeError, OSError):  # it died meanwhile: nothing left to close
            pass
        self.process.join(60)
        if self.process.is_alive():
            log.warning("the driver process did not stop in 60 s; terminating it")
            self.process.terminate()
            self.process.join(30)
        self.fleet.close()
        self._conn.close()

    # ------------------------------------------------------------------------- calls

    def _future(self) -> tuple[int, Future]:
        call_id, future = next(self._ids), Future()
        self._waiting[call_id] = future
        return call_id, future

    def _call(self, name: str, *args: Any) -> Any:
        call_id, future = self._future()
        try:
            with self._send_lock:
                self._conn.send((call_id, name, args))
        except (OSError, EOFError, BrokenPipeError) as e:
            self._waiting.pop(call_id, None)
            raise self._died() from e
        return self._result(future)

    def _result(self, future: Future) -> Any:
        while True:  # the reader fails what waits when the pipe closes; a call sent after that is failed here
            try:
                return future.result(timeout=5.0)
            except FuturesTimeout:
                if not self._reader.is_alive() and not future.done():
                    raise self._died() from None

    def _read(self) -> None:
        """Answers, in whatever order they come, to the calls that wait for them."""
        while True:
            try:
                call_id, ok, value = self._conn.recv()
            except (EOFError, OSError):
                break
            if ok is None:  # part of a streamed batch (PARTIAL), before the batch itself
                chunks = self._partials.get(call_id)
                if chunks is not None:
                    chunks.put(value)
                continue
            future = self._waiting.pop(call_id, None)
            if future is not None:
                future.set_result(value) if ok else future.set_exception(value)
        error = self._died()
        for call_id in list(self._waiting):
            future = self._waiting.pop(call_id, None)
            if future is not None and not future.done():
                future.set_exception(error)

    def _died(self) -> RuntimeError:
        self.process.join(5)
        return RuntimeError(f"the driver process ended (exit code {self.process.exitcode}); its log is above")


def _serve(conn, cfg: SpiceConfig, resume_state: dict | None, stop_file: str, log_level: int,
           parent_pid: int) -> None:
    """The driver process: build the Driver, then answer rank 0's calls until it closes the pipe
    (or rank 0 is killed: the driver may be mid-rollout, far from its next read of the pipe)."""
    die_with_parent(parent_pid)
    from transformers import AutoTokenizer

    from spice_megatron.loop.driver import Driver

    # Ctrl-C and Slurm's SIGTERM reach the whole process group; rank 0 answers them (an iteration
    # finished, a checkpoint that needs this process's state), then closes the pipe.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s [driver]: %(message)s")
    send_lock = threading.Lock()

    def answer(call_id: int, ok: bool, value: Any) -> None:
        with send_lock:
            try:
                conn.send((call_id, ok, value))
            except (OSError, EOFError):  # rank 0 is gone; the main loop sees it too
                pass

    try:
        driver = Driver(cfg, AutoTokenizer.from_pretrained(cfg.run.model), resume_state,
                        abandon_when=lambda: os.path.exists(stop_file))
    except Exception as e:  # noqa: BLE001 - rank 0 raises it
        log.exception("the driver could not start")
        answer(_HELLO, False, _portable(e))
        return
    answer(_HELLO, True, {"urls": [e.url for e in driver.fleet.engines], "token": driver.token})

    held: dict[int, list[dict]] = {}  # batch iteration -> its records, until rank 0 logs them

    def keep(batch: RolloutBatch) -> RolloutBatch:
        held[batch.iteration] = batch.records
        return batch

    def finished(call_id: int, future: Future) -> None:
        if not future.cancelled():
            error = future.exception()
            answer(call_id, error is None, _portable(error) if error else keep(future.result()))

    try:
        while True:
            try:
                call_id, name, args = conn.recv()
            except (EOFError, OSError):
                log.warning("rank 0 is gone; stopping the driver and its engines")
                break
            if name == "close":
                answer(call_id, True, None)
                break
            try:
                if name == "start_selfplay":
                    iteration, version, batch_id = args
                    future, snapshot = driver.start_selfplay(iteration, version)
                    future.add_done_callback(lambda f, i=batch_id: finished(i, f))
                    answer(call_id, True, snapshot)
                elif name == "start_streamed":  # each complete document's sequences, then the batch
                    iteration, version, batch_id = args
                    future, _ = driver.start_streamed(iteration, version,
                                                      lambda seqs, i=batch_id: answer(i, None, seqs))
                    future.add_done_callback(lambda f, i=batch_id: finished(i, f))
                    answer(call_id, True, None)
                elif name == "log_held":
                    iteration, stats, batch_iteration = args
                    records = held.pop(batch_iteration)
                    for old in [k for k in held if k < batch_iteration]:  # batches never logged (abandoned)
                        del held[old]
                    answer(call_id, True, driver.log(iteration, stats, records))
                elif name == "selfplay":
                    answer(call_id, True, keep(driver.selfplay(*args)))
                else:
                    answer(call_id, True, getattr(driver, name)(*args))
            except Exception as e:  # noqa: BLE001 - raised on rank 0, where the loop decides
                if not isinstance(e, (FleetError, IterationAbandoned, KillSwitch)):  # the loop's own
                    log.exception("driver call %s failed", name)
                answer(call_id, False, _portable(e))
    finally:
        driver.close()
        conn.close()


def _portable(error: BaseException) -> BaseException:
    """The exception itself when it survives pickling (rank 0 tells NoEngineLeft, KillSwitch and
    IterationAbandoned apart by type), else a RuntimeError that names it."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(error).__name__}: {error}")
