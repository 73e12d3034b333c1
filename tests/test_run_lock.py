"""One writer per run directory: the lock, its holder's description, takeover of a lock whose holder
is gone, and the wait of a requeued Slurm job for its earlier attempt (spice_megatron/run/lock.py)."""
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, replace

import pytest

from spice_megatron.run import lock as run_lock
from spice_megatron.run.lock import LOCK_FILE, RunDirLocked, RunLock, RunLockLost, check_unlocked, this_holder


@pytest.fixture
def no_slurm(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)


def _sleeper(seconds: float = 60) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds})"])


def _write_lock(run_dir, **fields) -> dict:
    holder = {**asdict(this_holder()), **fields}
    (run_dir / LOCK_FILE).write_text(json.dumps(holder))
    return holder


def test_the_lock_is_held_for_the_block_and_names_its_holder(tmp_path, no_slurm):
    with RunLock(str(tmp_path), wait_s=0):
        holder = json.loads((tmp_path / LOCK_FILE).read_text())
        assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
        with pytest.raises(RunDirLocked, match=f"pid {os.getpid()} on {socket.gethostname()}"):
            RunLock(str(tmp_path), wait_s=0).acquire()  # a second writer, even in the same process
    assert not (tmp_path / LOCK_FILE).exists()
    check_unlocked(str(tmp_path))  # released: nothing to refuse


def test_a_live_holder_is_refused_and_a_dead_one_taken_over(tmp_path, no_slurm, caplog):
    proc = _sleeper()
    try:
        _write_lock(tmp_path, pid=proc.pid, pid_start=run_lock._pid_start(proc.pid), slurm_job_id="")
        with pytest.raises(RunDirLocked) as e:
            check_unlocked(str(tmp_path))
        assert f"pid {proc.pid}" in str(e.value) and "--output" in str(e.value)
        with pytest.raises(RunDirLocked):
            RunLock(str(tmp_path), wait_s=0).acquire()
    finally:
        proc.kill()
        proc.wait()
    with caplog.at_level(logging.WARNING, logger="spice.run_lock"):  # kill -9 left the lock behind
        with RunLock(str(tmp_path), wait_s=0):
            assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert f"taking over the lock of pid {proc.pid}" in caplog.text and "no longer running" in caplog.text


def test_a_recycled_pid_is_not_the_holder(tmp_path, no_slurm):
    proc = _sleeper()
    try:  # the lock names this pid but another process start time: the pid was given to a new process
        _write_lock(tmp_path, pid=proc.pid, pid_start="1")
        check_unlocked(str(tmp_path))
    finally:
        proc.kill()
        proc.wait()


def test_holders_on_other_hosts_are_judged_by_heartbeat_and_slurm(tmp_path, no_slurm, monkeypatch):
    _write_lock(tmp_path, host="elsewhere", pid=1, slurm_job_id="")
    with pytest.raises(RunDirLocked, match="pid 1 on elsewhere"):
        check_unlocked(str(tmp_path))  # a fresh heartbeat
    old = time.time() - run_lock.STALE_AFTER_S - 5
    os.utime(tmp_path / LOCK_FILE, (old, old))
    check_unlocked(str(tmp_path))  # no heartbeat for longer than STALE_AFTER_S
    # a holder in another Slurm job that squeue no longer knows (a stand-in squeue: the box has none here)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "squeue").write_text("#!/bin/sh\necho 'slurm_load_jobs error: Invalid job id specified' >&2\nexit 1\n")
    (bin_dir / "squeue").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    _write_lock(run_dir, host="elsewhere", pid=1, slurm_job_id="41")
    check_unlocked(str(run_dir))
    (bin_dir / "squeue").write_text("#!/bin/sh\necho RUNNING\n")
    with pytest.raises(RunDirLocked, match="Slurm job 41"):
        check_unlocked(str(run_dir))


def test_a_requeued_job_waits_for_its_earlier_attempt_then_refuses(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    proc = _sleeper(2.0)  # the earlier attempt's rank 0, ending 2 s into the wait
    try:
        _write_lock(tmp_path, pid=proc.pid, pid_start=run_lock._pid_start(proc.pid), slurm_job_id="77",
                    slurm_restart_count=0)
        check_unlocked(str(tmp_path))  # a launcher's check lets the requeue through to the wait
        t0 = time.monotonic()
        with RunLock(str(tmp_path), wait_s=60):
            assert 1.0 < time.monotonic() - t0 < 30
    finally:
        proc.kill()
        proc.wait()
    proc = _sleeper()
    try:
        _write_lock(tmp_path, pid=proc.pid, pid_start=run_lock._pid_start(proc.pid), slurm_job_id="77",
                    slurm_restart_count=0)
        with pytest.raises(RunDirLocked, match="after waiting 1 s: pid"):
            RunLock(str(tmp_path), wait_s=1).acquire()
        monkeypatch.setenv("SLURM_JOB_ID", "78")  # another job: refused at once, never waited for
        with pytest.raises(RunDirLocked, match="in use by another run: pid"):
            RunLock(str(tmp_path), wait_s=60).acquire()
    finally:
        proc.kill()
        proc.wait()


def test_an_unreadable_lock_is_refused_until_its_heartbeat_is_old(tmp_path, no_slurm):
    (tmp_path / LOCK_FILE).write_text("")  # a create killed before its JSON was written
    with pytest.raises(RunDirLocked, match="holder unreadable"):
        check_unlocked(str(tmp_path))
    old = time.time() - run_lock.STALE_AFTER_S - 5
    os.utime(tmp_path / LOCK_FILE, (old, old))
    with RunLock(str(tmp_path), wait_s=0):
        pass


def test_the_heartbeat_keeps_the_lock_fresh_and_a_taken_lock_stops_the_run(tmp_path, no_slurm, monkeypatch):
    monkeypatch.setattr(run_lock, "HEARTBEAT_S", 0.05)
    lines = []
    lock = RunLock(str(tmp_path), wait_s=0, on_lost=lines.append)
    lock.acquire()
    old = time.time() - 1000
    os.utime(tmp_path / LOCK_FILE, (old, old))
    time.sleep(0.3)
    assert time.time() - os.stat(tmp_path / LOCK_FILE).st_mtime < 5 and not lock.lost
    # someone took the lock over meanwhile (this holder was judged gone): the heartbeat stops, one
    # line names the new holder, and release leaves their lock alone
    other = replace(this_holder(), pid=1, token="theirs")
    (tmp_path / LOCK_FILE).write_text(json.dumps(asdict(other)))
    deadline = time.monotonic() + 30
    while not lines and time.monotonic() < deadline:
        time.sleep(0.05)
    assert set(lines) == {lock.lost} and "another run took it over: pid 1" in lock.lost and LOCK_FILE in lock.lost
    lock.release()
    assert json.loads((tmp_path / LOCK_FILE).read_text())["token"] == "theirs"


def test_a_lost_lock_raises_in_the_main_thread_of_the_run(tmp_path, no_slurm, monkeypatch):
    from spice_megatron.policy import parallel

    monkeypatch.setattr(run_lock, "HEARTBEAT_S", 0.05)
    monkeypatch.setattr(parallel, "broadcast_from_driver", lambda obj, group: obj)  # one rank, no group
    before = signal.getsignal(run_lock.LOST_SIGNAL)
    with pytest.raises(RunLockLost, match="another run took it over"):
        with run_lock.hold_run_dir(str(tmp_path / "run"), 0, True, None):
            other = replace(this_holder(), pid=1, token="theirs")
            (tmp_path / "run" / LOCK_FILE).write_text(json.dumps(asdict(other)))
            try:
                time.sleep(60)  # a blocking call: the signal ends it
            except Exception:  # noqa: BLE001 - a broad except (a sync's retry) swallows the first
                pass
            time.sleep(60)  # the next beat raises again
    assert signal.getsignal(run_lock.LOST_SIGNAL) == before


def test_two_takeovers_of_one_stale_lock_leave_one_holder(tmp_path, no_slurm, monkeypatch):
    """The review's forced interleaving: B judged the lock stale and is about to move it when A
    takes it over and holds it; B must then find A's lock live and refuse."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    _write_lock(tmp_path, pid=dead.pid, pid_start="", token="stale")
    a, b = RunLock(str(tmp_path), wait_s=0), RunLock(str(tmp_path), wait_s=0)
    a_holds, b_moving = threading.Event(), threading.Event()
    real_rename = os.rename

    def rename(src, dst):
        if threading.current_thread().name == "B":
            b_moving.set()
            a_holds.wait(10)
        real_rename(src, dst)

    monkeypatch.setattr(run_lock.os, "rename", rename)
    errors = []

    def run_a():
        b_moving.wait(10)
        a.acquire()
        a_holds.set()

    def run_b():
        try:
            b.acquire()
        except RunDirLocked as e:
            errors.append(e)

    threads = [threading.Thread(target=run_a, name="A"), threading.Thread(target=run_b, name="B")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    try:
        assert a._beat is not None and b._beat is None and len(errors) == 1
        assert json.loads((tmp_path / LOCK_FILE).read_text())["token"] == a.me.token
        assert [p.name for p in tmp_path.iterdir()] == [LOCK_FILE]  # nothing left aside
    finally:
        a.release()


def test_the_pid_test_needs_the_holders_pid_namespace(tmp_path, no_slurm):
    dead = subprocess.Popen(["true"])
    dead.wait()
    me = this_holder()
    for ns in ("pid:[1]", ""):  # another container on this host, or a lock written before pid_ns
        holder = replace(me, pid=dead.pid, pid_start="", pid_ns=ns)
        assert run_lock.holder_gone(holder, 1.0, me) == ""  # a fresh heartbeat: live
        assert "no heartbeat" in run_lock.holder_gone(holder, run_lock.STALE_AFTER_S + 5, me)
    assert "no longer running" in run_lock.holder_gone(replace(me, pid=dead.pid, pid_start=""), 1.0, me)
