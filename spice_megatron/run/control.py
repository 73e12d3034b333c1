"""How a run talks to the job script and the person at the keyboard: the STOP file and signals
that ask for a stop with a checkpoint, and the marker files that say how the run ended."""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time

log = logging.getLogger("spice.trainer")


# Files in the run directory that talk to the job script. torchrun turns every worker exit code into
# 1, and a signal to torchrun gives the workers only 30 s before SIGKILL, so neither exit codes nor
# signals reach a Slurm script reliably through it.
STOP_FILE = "STOP"  # created by the job script (time limit near) or a person: stop with a checkpoint
STOPPED_FILE = "STOPPED"  # written by rank 0 when it stopped on a request: a stop, not a failure
KILL_SWITCH_FILE = "KILL_SWITCH"  # written by rank 0 when the kill switch stops the run: do not requeue


class StopRequest:
    """The first Ctrl-C (or SIGTERM, as Slurm sends before a kill), or a STOP file in the run
    directory, asks the loop to stop after the current iteration, with a checkpoint that resumes
    exactly; a second signal aborts at once."""

    def __init__(self, stop_file: str = "") -> None:
        self.signalled = False
        self.stop_file = stop_file
        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)

    @property
    def requested(self) -> bool:
        return self.signalled or bool(self.stop_file and os.path.exists(self.stop_file))

    def requested_after(self, iteration: int) -> bool:
        """`requested`, asked at the end of an iteration (where a test's hold can keep the run)."""
        hold_if_asked(iteration, self)
        return self.requested

    def _handle(self, signum, frame) -> None:
        if self.signalled:  # a second signal of either kind
            raise KeyboardInterrupt
        self.signalled = True
        log.warning("%s: stopping after this iteration with a checkpoint (Ctrl-C again to abort without one)",
                    signal.Signals(signum).name)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


# A test's hook on the job scripts (tests/test_slurm_box.py): while the file this names exists and
# holds the number N, rank 0 waits after iteration N, before it asks the others whether to stop, until
# the file is gone or holds another number (rewrite it atomically), or a stop is requested (the job
# script's STOP at Slurm's time-limit signal). A test thereby puts the time limit, a scancel or a
# kill at a known point of a run, however fast or slow the machine. FILE.held names the iteration
# while the run waits.
HOLD_FILE_ENV = "SPICE_TEST_HOLD_FILE"


def hold_if_asked(iteration: int, stop: StopRequest) -> None:
    path = os.environ.get(HOLD_FILE_ENV)
    if not path or _hold_point(path) != iteration:
        return
    log.warning("held after iteration %d by %s (a test's hook)", iteration, path)
    with open(path + ".held", "w") as f:
        f.write(f"{iteration}\n")
    while _hold_point(path) == iteration and not stop.requested:
        time.sleep(0.5)
    with contextlib.suppress(FileNotFoundError):
        os.remove(path + ".held")


def _hold_point(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def write_marker(path: str, reason: str, is_driver: bool) -> None:
    """The driver writes `reason` to a marker file (other ranks do nothing)."""
    if is_driver:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            f.write(reason + "\n")


def kill_switch_refusal(output_dir: str, is_driver: bool) -> str:
    """Why a plain resume of this run must not train on ("" when it may): the kill switch stopped it
    at its newest checkpoint. The marker is written again for the job script (a requeue reads it)."""
    from spice_megatron.policy.checkpoint import read_trainer_state
    from spice_megatron.policy.checkpoint_files import latest_checkpoint

    newest = latest_checkpoint(os.path.join(output_dir, "checkpoints"))
    try:
        stopped = read_trainer_state(newest).get("kill_switch") if newest else None
    except (OSError, ValueError):  # a damaged checkpoint: the resume names it and passes it over
        stopped = None
    if not stopped:
        return ""
    write_marker(os.path.join(output_dir, KILL_SWITCH_FILE), stopped, is_driver)
    return (f"not resuming: the kill switch stopped this run at {os.path.basename(newest)} ({stopped}); "
            "pass --resume-after-kill-switch to continue it anyway")


class Interrupted(RuntimeError):
    """Ctrl-C, SIGTERM or a STOP file: the run saved a checkpoint and stopped (after its iteration,
    or, for a STOP during the rollouts, dropping the iteration in progress)."""
