"""Processes a test started and left behind, found by the suite's environment marker.

conftest.py puts SUITE_MARKER in the environment of the pytest process before any worker or test
starts, so every process a test starts inherits it (with PYTEST_CURRENT_TEST naming the test that
was running). At the end of the session anything still carrying the marker, other than pytest's
own processes, outlived its test."""
from __future__ import annotations

import os
import signal
import time

SUITE_MARKER = "SPICE_TEST_SUITE"
# started by a test on purpose and kept for the machine: the Slurm box's munge daemon
KEPT = ("munged",)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def marked_processes(marker: str, exclude: set[int], ignore=lambda pid: False) -> dict[int, str]:
    """pid -> "the test that started it: its command line" for every live process that carries
    `marker` in its environment (Linux's /proc; nothing elsewhere)."""
    if not os.path.isdir("/proc"):
        return {}
    wanted = f"{SUITE_MARKER}={marker}".encode()
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in exclude:
            continue
        try:
            env = _read(f"/proc/{entry}/environ").split(b"\0")
            stat = _read(f"/proc/{entry}/stat").decode(errors="replace")
            cmdline = _read(f"/proc/{entry}/cmdline").replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        comm, state = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()[0]
        if wanted not in env or state == "Z" or comm in KEPT or ignore(int(entry)):
            continue
        test = next((e.split(b"=", 1)[1].decode(errors="replace") for e in env
                     if e.startswith(b"PYTEST_CURRENT_TEST=")), "no test (the session itself)")
        found[int(entry)] = f"{test}: {cmdline[:200]}"
    return found


def wait_for_leftovers(marker: str, exclude: set[int], grace_s: float, ignore=lambda pid: False) -> dict[int, str]:
    """What is still there after `grace_s` (helpers watch their parent every few seconds)."""
    deadline = time.monotonic() + grace_s
    while True:
        left = marked_processes(marker, exclude, ignore)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(1.0)


def alive(pid: int) -> bool:
    """Running, not a zombie waiting for its parent to reap it."""
    try:
        stat = _read(f"/proc/{pid}/stat").decode(errors="replace")
    except OSError:
        return False
    return stat[stat.rindex(")") + 2:].split()[0] != "Z"


def kill(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
