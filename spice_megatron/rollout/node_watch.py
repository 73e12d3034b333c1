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
    os._exit(1)


def watch_followers(host: str, port: int, followers: int, timeout_s: float = 600.0) -> None:
    """On the leader: wait (in the background) for `followers` connections on host:port; exit the
    process as soon as any of them closes, or if they have not all come within `timeout_s`."""
    server = socket.create_server((host, port))

    def accept() -> None:
        server.settimeout(timeout_s)
        for i in range(followers):
            try:
                conn, peer = server.accept()
            except OSError:
                log.error("only %d of %d followers connected within %.0f s: exiting", i, followers, timeout_s)
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
    """A vLLM general plugin (setup.py), run in every process vLLM starts: where a follower asked for it
    ($SPICE_DIE_WITH_PARENT=1, inherited by its workers), the kernel kills this process when its parent
    goes. A headless follower's workers otherwise outlive a kill -9 of the follower (their death pipe
    shuts down message queues that a remote leader feeds, not a worker waiting on them: measured with
    vLLM 0.32 on CPU) and would hold their GPUs' memory against the follower restarted beside them."""
    if os.environ.get(DIE_WITH_PARENT_ENV) != "1" or not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGKILL))
    if os.getppid() == 1:  # the parent went before the request took hold
        os._exit(1)
