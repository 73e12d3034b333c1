"""An engine across nodes lives and dies whole (spice_megatron/rollout/node_watch.py): where the
leader listens for its followers, and that its own workers die with it; run against the leader's
real `serve.main` with its vLLM engine replaced by a
stand-in that starts one worker as vLLM's executor does (forked, the project's plugin run first)."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from dist_utils import free_port

from spice_megatron.torchrun import listen_address

pytestmark = pytest.mark.multiprocess
TOKEN = "r" * 32
FOLLOWER = ("import sys, time\nfrom spice_megatron.rollout.node_watch import hold_to_leader\n"
            "print(hold_to_leader('127.0.0.1', int(sys.argv[1]), 1, timeout_s=float(sys.argv[2])), flush=True)\n"
            "time.sleep(600)\n")


def _follower(watch: int, timeout_s: float = 120, token: str = TOKEN) -> subprocess.Popen:
    """The follower's side of the watch (proved with `token`), in a process of its own: it prints the
    store's port its leader told it, then holds on (it exits when the leader goes)."""
    return subprocess.Popen([sys.executable, "-c", FOLLOWER, str(watch), str(timeout_s)], text=True,
                            env={**os.environ, "SPICE_ROLLOUT_TOKEN": token}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)

LEADER = r"""
import multiprocessing, os, sys, threading, time
import spice_megatron.rollout.engine as engine

def worker(pid_file):
    from spice_megatron.rollout.node_watch import die_with_parent
    die_with_parent()  # what vLLM's plugin loading runs first in each worker it starts (setup.py)
    open(pid_file + ".tmp", "w").write(str(os.getpid()))
    os.rename(pid_file + ".tmp", pid_file)
    time.sleep(600)  # a worker inside a collective whose peers are gone

class OneWorker:
    def __init__(self, *a, **k):
        if os.environ.get("PID_FILE"):
            multiprocessing.get_context("fork").Process(target=worker, args=(os.environ["PID_FILE"],),
                                                        daemon=True).start()
        threading.Event().wait()

engine.VLLMEngine = OneWorker
from spice_megatron.rollout import serve
sys.exit(serve.main(sys.argv[1:]))
"""


def _leader(api: int, watch: int, master_addr: str, pid_file: str = "") -> subprocess.Popen:
    env = {**os.environ, "SPICE_ROLLOUT_TOKEN": TOKEN, "PID_FILE": pid_file, "SPICE_TRUSTED_NETWORK": "1"}
    env.pop("SPICE_DIE_WITH_PARENT", None)
    return subprocess.Popen([sys.executable, "-c", LEADER, "--model", "unused", "--host", "127.0.0.1", "--port",
                             str(api), "--tensor-parallel-size", "2", "--nnodes", "2", "--master-addr", master_addr,
                             "--master-port", str(free_port()), "--watch-port", str(watch)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _alive(pid: int) -> bool:
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def test_where_a_server_listens_for_other_nodes(monkeypatch):
    """A node's own name that resolves to loopback there (Debian/Ubuntu's `127.0.1.1 node001`) is listened
    for on every interface; an address or `localhost` means what it says."""
    real = socket.getaddrinfo

    def resolve(host, *a, **k):
        if host == "node001":
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.1.1", 0))]
        if host == "node002":
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.1.2.3", 0))]
        return real(host, *a, **k)

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    assert listen_address("node001") == "0.0.0.0" and listen_address("node002") == "node002"
    assert listen_address("127.0.0.1") == "127.0.0.1" and listen_address("localhost") == "localhost"
    assert listen_address("10.1.2.3") == "10.1.2.3" and listen_address("::1") == "::1"


def _outward_address() -> str | None:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # sends nothing: the interface a route would use
            addr = s.getsockname()[0]
    except OSError:
        return None
    return None if addr.startswith("127.") else addr


def test_followers_reach_a_leader_whose_name_resolves_to_loopback_on_itself():
    """The watch listened where the leader's name resolves
    on the leader; followers elsewhere were refused and the engine never started."""
    outward = _outward_address()
    name = socket.gethostname()
    if outward is None or not socket.gethostbyname(name).startswith("127."):
        pytest.skip("needs a host name that resolves to loopback here and an outward address")
    watch = free_port()
    leader = _leader(free_port(), watch, name)
    try:
        deadline = time.monotonic() + 120
        while leader.poll() is None and time.monotonic() < deadline:
            try:
                socket.create_connection((outward, watch), timeout=2).close()
                break
            except OSError:
                time.sleep(0.5)
        else:
            pytest.fail(f"the leader's watch on port {watch} never took a follower at {outward}")
    finally:
        leader.kill()
        leader.wait(30)


def test_a_leaders_workers_die_with_it_when_a_follower_goes_and_free_its_port():
    """The leader os._exit-ed and its worker, stuck
    in a collective, lived on (parent 1) holding the API port against the restarted leader."""
    tmp = f"/tmp/spice_watch_{os.getpid()}_{time.monotonic_ns()}"
    watch, api = free_port(), free_port()
    leader = _leader(api, watch, "127.0.0.1", tmp)
    worker, follower = None, _follower(watch)
    try:
        assert int(follower.stdout.readline()) > 0  # proved both ways: the leader named its store's port
        deadline = time.monotonic() + 120
        while not os.path.exists(tmp) and time.monotonic() < deadline and leader.poll() is None:
            time.sleep(0.2)
        assert os.path.exists(tmp), leader.stderr.read().decode()[-2000:]
        worker = int(open(tmp).read())
        follower.kill()  # the follower is gone: the leader exits, its engine with it
        assert leader.wait(30) == 1
        deadline = time.monotonic() + 10
        while _alive(worker) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(worker), "the leader's worker outlived it"
        from spice_megatron.rollout.serve import _bind

        _bind("127.0.0.1", api).close()  # what the restarted leader does first
    finally:
        follower.kill()
        follower.wait(30)
        if leader.poll() is None:
            leader.kill()
            leader.wait(30)
        if worker and _alive(worker):
            os.kill(worker, signal.SIGKILL)
        if os.path.exists(tmp):
            os.unlink(tmp)


def test_the_plugin_leaves_the_asking_process_alone_and_ends_an_orphan_under_a_subreaper(tmp_path):
    """die_with_parent compares with the pid that asked, not with 1: under a subreaper (systemd --user,
    a container's init) an orphan's parent is not 1."""
    code = ("import os, sys\nfrom spice_megatron.rollout.node_watch import die_with_parent\n"
            "die_with_parent()\nprint('alive')\n")
    me = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                        env={**os.environ, "SPICE_DIE_WITH_PARENT": str(os.getpid())})
    assert me.stdout.strip() == "alive"  # its parent is the one that asked
    gone = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "SPICE_DIE_WITH_PARENT": "999999999"})  # no such process
    assert gone.returncode == 1 and gone.stdout == ""
