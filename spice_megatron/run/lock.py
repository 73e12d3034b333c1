"""One writer per run directory: a lock file that the run's writer (rank 0, which is also the driver
or its parent) holds for the whole run.

`<output_dir>/RUN_LOCK` is created with O_EXCL and holds JSON naming the holder: host, pid (and its
start time, so a recycled pid is not taken for the holder), Slurm job id and restart count, start
time, and a token. While the run lives a thread refreshes the file's mtime (the heartbeat), so a
holder on another host (a shared filesystem) can be judged too. A lock is taken over, with a logged
line, when its holder is gone:
  - same host: the pid no longer runs (or runs another process);
  - another host: no heartbeat for STALE_AFTER_S, or its Slurm job (another job id) is no longer
    running according to squeue.
An earlier attempt of this same Slurm job (same job id, lower restart count: a requeue that started
before the old allocation's processes ended) is waited for, up to `wait_s`, then refused. Anything
else is refused with one line naming the holder. Readers (evaluation, `spice audit`) take no lock.

On the same host the pid test is used only when the holder ran in this PID namespace (containers
sharing a hostname do not see each other's pids): otherwise the heartbeat decides, as for another
host. A takeover renames the stale lock aside (atomic) and checks the renamed file's token: if a
concurrent takeover had already replaced it, that lock is put back and this run refuses, so two
takeovers of one stale lock cannot both hold it. The heartbeat re-reads the token: a lock that is no
longer this run's stops the run (RunLockLost) without writing more.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import threading
import time
from dataclasses import asdict, dataclass
from typing import Callable, Iterator

from spice_megatron.entry import UserError

log = logging.getLogger("spice.run_lock")

LOCK_FILE = "RUN_LOCK"
HEARTBEAT_S = 10.0
# A shared filesystem's attribute cache (NFS: acregmax 60 s) can hide a few heartbeats.
STALE_AFTER_S = 120.0


class RunDirLocked(UserError, RuntimeError):
    """Another live process writes this run directory."""


class RunLockLost(RunDirLocked):
    """While this run held its directory, another run's lock replaced this run's."""


@dataclass
class Holder:
    host: str
    pid: int
    pid_start: str  # /proc/<pid>/stat start time ("" where there is no /proc)
    slurm_job_id: str
    slurm_restart_count: int
    started: float
    token: str
    pid_ns: str = ""  # /proc/self/ns/pid ("" where unknown: lock files written before it was recorded)

    def describe(self) -> str:
        job = f", Slurm job {self.slurm_job_id} (restart {self.slurm_restart_count})" if self.slurm_job_id else ""
        return (f"pid {self.pid} on {self.host}{job}, since "
                f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(self.started))}")


def _proc_stat(pid: int) -> list[str]:
    """/proc/<pid>/stat's fields after the command name ([] where there is none)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def _pid_start(pid: int) -> str:
    fields = _proc_stat(pid)
    return fields[19] if len(fields) > 19 else ""  # field 22: start time in clock ticks since boot


def _pid_alive(pid: int, start: str) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        pass
    fields = _proc_stat(pid)
    if fields and fields[0] in ("Z", "X"):  # exited, not yet reaped by its parent
        return False
    return not start or not fields or fields[19] == start


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def this_holder() -> Holder:
    pid = os.getpid()
    return Holder(host=socket.gethostname(), pid=pid, pid_start=_pid_start(pid),
                  slurm_job_id=os.environ.get("SLURM_JOB_ID", ""),
                  slurm_restart_count=int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
                  started=time.time(), token=secrets.token_hex(8), pid_ns=_pid_namespace())


def _slurm_job_running(job_id: str) -> bool | None:
    """Whether squeue lists the job as running (None: no squeue here, or it failed)."""
    try:
        out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:  # squeue exits 1 with "Invalid job id" for a job that has left the queue
        return False if "invalid job id" in out.stderr.lower() else None
    return any(s in ("RUNNING", "COMPLETING", "CONFIGURING") for s in out.stdout.split())


def _read(path: str) -> tuple[Holder | None, float]:
    """The holder written in the lock file and the file's age in seconds (None: unreadable)."""
    try:
        age = time.time() - os.stat(path).st_mtime
        with open(path) as f:
            return Holder(**json.load(f)), age
    except FileNotFoundError:
        raise
    except (OSError, ValueError, TypeError):
        return None, age


def holder_gone(holder: Holder | None, age: float, me: Holder) -> str:
    """Why the lock's holder no longer writes the directory ("" if it may still)."""
    if holder is None:  # a create killed before its JSON was written, or a damaged file
        return "the lock file is unreadable and older than its heartbeat" if age > STALE_AFTER_S else ""
    if holder.host == me.host and holder.pid_ns and holder.pid_ns == me.pid_ns:
        return "" if _pid_alive(holder.pid, holder.pid_start) else f"pid {holder.pid} is no longer running"
    if age > STALE_AFTER_S:
        return f"no heartbeat for {age:.0f} s"
    if holder.slurm_job_id and holder.slurm_job_id != me.slurm_job_id and \
            _slurm_job_running(holder.slurm_job_id) is False:
        return f"Slurm job {holder.slurm_job_id} is no longer running"
    return ""


def _in_use(path: str, holder: Holder | None, still: str = "") -> RunDirLocked:
    """The one line a refused run prints: the directory, its holder, the lock file, the remedy."""
    return RunDirLocked(f"{os.path.dirname(path) or '.'} is in use by another run{still}: "
                        f"{holder.describe() if holder else 'holder unreadable'} (lock file {path}); "
                        "use another --output, or stop that run first")


def earlier_attempt(holder: Holder | None, me: Holder) -> bool:
    """The holder is an earlier attempt of this Slurm job (requeued since)."""
    return bool(holder and me.slurm_job_id and holder.slurm_job_id == me.slurm_job_id
                and holder.slurm_restart_count < me.slurm_restart_count)


class RunLock:
    """`with RunLock(output_dir, wait_s):` holds the directory for the block (or acquire/release)."""

    def __init__(self, output_dir: str, wait_s: float = 300.0,
                 on_lost: Callable[[str], None] | None = None) -> None:
        self.path = os.path.join(output_dir, LOCK_FILE)
        self.wait_s = wait_s
        self.me = this_holder()
        self.on_lost = on_lost  # called from the heartbeat thread with the one line, each beat once lost
        self.lost = ""
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    def acquire(self) -> None:
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        deadline = time.monotonic() + self.wait_s
        waited = False
        while True:
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                try:
                    holder, age = _read(self.path)
                except FileNotFoundError:  # released between the create and the read
                    continue
                gone = holder_gone(holder, age, self.me)
                if gone:
                    log.warning("run directory %s: taking over the lock of %s (%s)", os.path.dirname(self.path),
                                holder.describe() if holder else "an unknown holder", gone)
                    self._take_over(holder)
                    continue
                if earlier_attempt(holder, self.me) and time.monotonic() < deadline:
                    if not waited:
                        log.warning("run directory %s: waiting up to %.0f s for the earlier attempt of this job to "
                                    "end (%s)", os.path.dirname(self.path), self.wait_s, holder.describe())
                        waited = True
                    time.sleep(1.0)
                    continue
                raise _in_use(self.path, holder, f" after waiting {self.wait_s:.0f} s" if waited else "") from None
            with os.fdopen(fd, "w") as f:
                json.dump(asdict(self.me), f)
                f.flush()
                os.fsync(f.fileno())
            break
        self._beat = threading.Thread(target=self._heartbeat, name="run-lock-heartbeat", daemon=True)
        self._beat.start()

    def _take_over(self, stale: Holder | None) -> None:
        """Move the stale lock aside; if what was moved is not the lock judged stale (another
        takeover replaced it in between), put it back: its holder is live."""
        aside = f"{self.path}.stale.{self.me.token}"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return
        moved, _ = _read(aside)
        if (moved.token if moved else None) == (stale.token if stale else None):
            os.remove(aside)
            return
        try:  # link, unlike rename, never replaces a lock created meanwhile
            os.link(aside, self.path)
        except OSError as e:  # a third run created one (or no hard links here): the moved lock's heartbeat stops it
            log.warning("run directory %s: a concurrent takeover's lock could not be put back (%s)",
                        os.path.dirname(self.path), e)
        os.remove(aside)

    def _remove_if(self, holder: Holder) -> None:
        """Remove the lock file if it still names `holder` (not a lock taken meanwhile)."""
        try:
            now, _ = _read(self.path)
            if now is not None and now.token == holder.token:
                os.remove(self.path)
        except FileNotFoundError:
            pass

    def _still_mine(self) -> str:
        """"" while the lock file is this run's, else why it is not."""
        try:
            now, _ = _read(self.path)
        except FileNotFoundError:
            return "its lock file was removed"
        if now is None or now.token == self.me.token:  # unreadable: a write in progress, judged next beat
            return ""
        return f"another run took it over: {now.describe()}"

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            if not self.lost:
                lost = self._still_mine()
                if lost:
                    self.lost = (f"run directory {os.path.dirname(self.path) or '.'}: {lost}; this run stops "
                                 "without writing more (lock file " + self.path + ")")
                    log.error("%s", self.lost)
            if self.lost:  # every beat until the run has stopped: a broad `except` may have caught one
                if self.on_lost is not None:
                    self.on_lost(self.lost)
                continue
            try:
                os.utime(self.path)
            except OSError as e:  # the directory was removed under the run: nothing left to guard
                log.warning("run lock heartbeat: %s", e)

    def release(self) -> None:
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
            self._beat = None
            if not self.lost:
                self._remove_if(self.me)

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def check_unlocked(output_dir: str) -> None:
    """Refuse (RunDirLocked) if a live run other than an earlier attempt of this job holds the
    directory; a cheap check before a launcher starts anything. Takes no lock."""
    path = os.path.join(output_dir, LOCK_FILE)
    me = this_holder()
    try:
        holder, age = _read(path)
    except FileNotFoundError:
        return
    if not holder_gone(holder, age, me) and not earlier_attempt(holder, me):
        raise _in_use(path, holder)


@contextlib.contextmanager
def hold_run_dir(output_dir: str, wait_s: float, is_writer: bool, group,
                 group_readable: bool = False) -> Iterator[None]:
    """Collective over the learner ranks: every rank writes under the run's umask; the writer (rank
    0) makes sure the directory is private (run_dir.py) and holds its lock for the block; if it
    cannot, every rank raises the same error."""
    from spice_megatron.policy.parallel import broadcast_from_driver
    from spice_megatron.run_dir import UnsafeRunDir, prepare_run_dir, run_umask

    os.umask(run_umask(group_readable))
    lock = RunLock(output_dir, wait_s, on_lost=_signal_main) if is_writer else None
    error: tuple[str, str] | None = None
    if lock is not None:
        try:
            prepare_run_dir(output_dir, group_readable)
            lock.acquire()
        except (RunDirLocked, UnsafeRunDir) as e:
            error = (type(e).__name__, str(e))
    error = broadcast_from_driver(error, group)
    if error:
        raise (UnsafeRunDir if error[0] == "UnsafeRunDir" else RunDirLocked)(error[1])
    stops_main = lock is not None and threading.current_thread() is threading.main_thread()
    if stops_main:
        previous = signal.getsignal(LOST_SIGNAL)
        signal.signal(LOST_SIGNAL, _raise_lost(lock, previous))
    try:
        yield
    finally:
        if lock is not None:
            lock.release()
        if stops_main:
            signal.signal(LOST_SIGNAL, previous if previous is not None else signal.SIG_DFL)


# the heartbeat thread stops the run by raising RunLockLost in the main thread (rank 0; the other
# ranks then fail as on any rank-0 error), through a signal only this block handles
LOST_SIGNAL = signal.SIGUSR2


def _signal_main(_line: str) -> None:
    # to the main thread itself, so a blocking call there returns (EINTR) and the handler runs
    if signal.getsignal(LOST_SIGNAL) not in (signal.SIG_DFL, signal.SIG_IGN, None):
        signal.pthread_kill(threading.main_thread().ident, LOST_SIGNAL)


def _raise_lost(lock: RunLock, previous):
    def handler(signum, frame):
        if lock.lost:
            raise RunLockLost(lock.lost)
        if callable(previous):
            previous(signum, frame)
    return handler
