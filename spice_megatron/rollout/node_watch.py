"""A multi-node engine lives and dies whole. vLLM's executor watches only the workers of its own
node: with a follower gone, the leader's next collective waits for it until the distributed timeout
(minutes to hours), serving nothing and answering /health. So each follower holds a TCP connection to
its leader for as long as it lives; when one closes, the leader exits, its engine counts as dead, and
whoever started it (rollout_node.sh, the driver) starts the whole engine again. A follower whose
leader is gone exits the same way. The connection carries nothing: a process that connects in a
follower's place can end the engine, not feed it (its workers still verify every weight they load)."""
from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time

log = logging.getLogger("spice.rollout.node_watch")


def _exit_when_closed(conn: socket.socket, what: str) -> None:
    try:
        while conn.recv(1):
            pass
    except OSError:
        pass
    log.error("%s is gone: this engine cannot run without it, exiting so that it is restarted whole", what)
    end_children()
    os._exit(1)


def watch_followers(host: str, port: int, followers: int, timeout_s: float = 600.0) -> None:
    """On the leader: wait (in the background) for `followers` connections on host:port; exit the
    process as soon as any of them closes, or if they have not all come within `timeout_s`. `host`:
    the leader's address as its followers know it (every interface where it names this node and
    resolves to loopback here: torchrun.listen_address)."""
    from spice_megatron.torchrun import listen_on

    server = listen_on(host, port)

    def accept() -> None:
        server.settimeout(timeout_s)
        for i in range(followers):
            try:
                conn, peer = server.accept()
            except OSError:
                log.error("only %d of %d followers connected within %.0f s: exiting", i, followers, timeout_s)
                end_children()
                os._exit(1)
            log.info("follower %d of %d connected from %s", i + 1, followers, peer[0])
            threading.Thread(target=_exit_when_closed, args=(conn, f"follower {peer[0]}:{peer[1]}"),
                             daemon=True, name="spice-follower-watch").start()
        server.close()

    threading.Thread(target=accept, daemon=True, name="spice-follower-accept").start()


def hold_to_leader(host: str, port: int, timeout_s: float = 600.0) -> None:
    """On a follower: connect to the leader's watch (retrying while it starts) and exit this process
    when the leader is gone."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            conn = socket.create_connection((host, port), timeout=10)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)
    conn.settimeout(None)
    threading.Thread(target=_exit_when_closed, args=(conn, f"the leader {host}:{port}"), daemon=True,
                     name="spice-leader-watch").start()


DIE_WITH_PARENT_ENV = "SPICE_DIE_WITH_PARENT"


def die_with_parent() -> None:
    """A vLLM general plugin (setup.py), run in every process vLLM starts: where a leader or a follower
    of an engine across nodes asked for it ($SPICE_DIE_WITH_PARENT = its own pid, inherited by its
    workers), the kernel kills this process when its parent goes. Such a worker otherwise outlives a
    kill -9 or an `os._exit` of its engine's process (its death pipe only shuts down message queues,
    which a worker inside a collective never reads again: measured with vLLM 0.32 on CPU) and keeps its
    GPU memory, the store's port and, forked, the API port against the engine restarted beside it.
    A parent gone before the signal took hold shows as a parent other than the one that asked (init, or
    a subreaper: compared with its pid, not with 1); the asking process itself is left alone."""
    owner = os.environ.get(DIE_WITH_PARENT_ENV, "")
    if not owner.isdigit() or int(owner) == os.getpid() or not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGKILL))
    if os.getppid() != int(owner) and not _alive(int(owner)):  # a process of a worker's: its own parent holds it
        os._exit(1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def workers_die_with_this_process() -> None:
    """Before vLLM starts this engine's workers: each one is killed when this process goes."""
    os.environ[DIE_WITH_PARENT_ENV] = str(os.getpid())


def end_children() -> None:
    """SIGKILL every process this one started (vLLM's workers, their helpers) before an `os._exit`,
    which runs no executor shutdown: the parent-death signal covers a kill -9 of this process, this
    covers its own exit, on any platform."""
    import psutil

    for child in psutil.Process().children(recursive=True):
        try:
            child.kill()
        except psutil.Error:
            pass
