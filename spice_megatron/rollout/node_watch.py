"""A multi-node engine lives and dies whole. vLLM's executor watches only the workers of its own
node: with a follower gone, the leader's next collective waits for it until the distributed timeout
(minutes to hours), serving nothing and answering /health. So each follower holds a TCP connection to
its leader for as long as it lives; when one closes, the leader exits, its engine counts as dead, and
whoever started it (rollout_node.sh, the driver) starts the whole engine again. A follower whose
leader is gone exits the same way.

The connection is proved both ways with the job's token before it counts (docs/cluster.md, "An
engine across nodes"): the leader sends a nonce, the follower answers with an HMAC over its role,
its node rank, that nonce and the watch port, and the leader answers with one over the follower's
nonce and the port of vLLM's store, which it picks at random for this start and tells no one else.
A connection that proves nothing is closed and ends nothing; a follower starts its workers only once
its leader has proved itself, so a process squatting the watch port learns nothing and is followed
by no one. What this does not cover: vLLM's own store and message queues carry no authentication (a process that reaches
them while the engine starts can run code in it, and its broadcast carries every prompt), which is
why an engine across nodes starts only where the operator declared a network only the job reaches
($SPICE_TRUSTED_NETWORK; docs/cluster.md, "Security on a shared cluster")."""
from __future__ import annotations

import hmac
import json
import logging
import os
import secrets
import signal
import socket
import sys
import threading
import time

log = logging.getLogger("spice.rollout.node_watch")
TRUSTED_NETWORK_ENV = "SPICE_TRUSTED_NETWORK"
HANDSHAKE_S = 10.0  # a peer that has not proved itself by then is closed


def trusted_network_refusal(declared: str | None = None) -> str | None:
    """Why an engine across nodes must not start here, or None where the operator declared a network
    only this job reaches ($SPICE_TRUSTED_NETWORK, or `declared`: 1, or the interface on that network)."""
    declared = os.environ.get(TRUSTED_NETWORK_ENV, "") if declared is None else declared
    if declared.strip() not in ("", "0"):
        return None
    return (f"an engine across nodes runs vLLM's store and message queues, which are not authenticated: whoever "
            f"reaches its nodes while it starts can run code in it, and read every prompt at any time (vLLM's "
            f"security guide: an isolated network). Start it only on a network only this job reaches, and say so: "
            f"{TRUSTED_NETWORK_ENV}=1, or the interface on that network (e.g. {TRUSTED_NETWORK_ENV}=ib0); "
            "docs/cluster.md, 'Security on a shared cluster'")


def _proof(token: str, *fields: object) -> str:
    from spice_megatron.wire.auth import mac

    return mac(token, "\n".join(["spice-node-watch", *map(str, fields)]).encode())


def _send(conn: socket.socket, message: dict) -> None:
    conn.sendall(json.dumps(message).encode() + b"\n")


def _receive(conn: socket.socket) -> dict:
    """One JSON line of at most 1 KiB (a peer that says more, or nothing in time, proves nothing)."""
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(1024 - len(data))
        if not chunk or len(data) + len(chunk) >= 1024:
            raise ValueError("no proof")
        data += chunk
    message = json.loads(data)
    if not isinstance(message, dict):
        raise ValueError("no proof")
    return message


def _exit_when_closed(conn: socket.socket, what: str) -> None:
    try:
        while conn.recv(1):
            pass
    except OSError:
        pass
    log.error("%s is gone: this engine cannot run without it, exiting so that it is restarted whole", what)
    end_children()
    os._exit(1)


def _token(token: str | None) -> str:
    from spice_megatron.wire.auth import TOKEN_ENV

    token = token or os.environ.get(TOKEN_ENV, "")
    if not token:
        raise ValueError(f"the follower watch needs the job's token (${TOKEN_ENV})")
    return token


def watch_followers(host: str, port: int, followers: int, timeout_s: float = 600.0, token: str | None = None,
                    master_port: int = 0) -> None:
    """On the leader: wait (in the background) for `followers` followers, nodes 1..followers, each
    proved with the job's token (default $SPICE_ROLLOUT_TOKEN), and tell each the port of vLLM's store
    (`master_port`); exit the process as soon as a proved one closes, or if they have not all come within
    `timeout_s`. `host`: the leader's address as its followers know it (every interface where it names
    this node and resolves to loopback here: torchrun.listen_address)."""
    from spice_megatron.torchrun import listen_on

    token = _token(token)
    server = listen_on(host, port)
    proved: dict[int, socket.socket] = {}
    lock, everyone = threading.Lock(), threading.Event()

    def proves(hello: dict, nonce: str) -> bool:
        rank, theirs = hello.get("rank"), str(hello.get("nonce", ""))
        return (isinstance(rank, int) and 1 <= rank <= followers and 16 <= len(theirs) <= 128
                and hmac.compare_digest(str(hello.get("proof", "")).encode(),
                                        _proof(token, "follower", rank, nonce, port).encode()))

    def handshake(conn: socket.socket, peer: tuple) -> None:
        rank = None
        try:
            conn.settimeout(HANDSHAKE_S)
            nonce = secrets.token_hex(16)
            _send(conn, {"nonce": nonce})
            hello = _receive(conn)
            if not proves(hello, nonce):
                raise ValueError("no proof")
            with lock:
                if hello["rank"] in proved:
                    raise ValueError(f"node {hello['rank']} has proved itself already")
                rank = hello["rank"]
                proved[rank] = conn
            _send(conn, {"master_port": master_port,
                         "proof": _proof(token, "leader", hello["nonce"], port, master_port)})
        except (OSError, ValueError) as e:
            log.warning("a connection from %s to the follower watch did not prove it holds the job's token (%s): "
                        "closed, nothing ended", peer[0], e)
            with lock:
                if rank is not None:
                    del proved[rank]
            conn.close()
            return
        conn.settimeout(None)
        log.info("follower node %d of %d proved itself from %s", rank, followers, peer[0])
        with lock:
            if len(proved) == followers:
                everyone.set()
        _exit_when_closed(conn, f"follower node {rank} ({peer[0]}:{peer[1]})")

    def accept() -> None:
        deadline = time.monotonic() + timeout_s
        while not everyone.is_set():
            server.settimeout(max(0.1, min(1.0, deadline - time.monotonic())))
            try:
                conn, peer = server.accept()
            except socket.timeout:
                if time.monotonic() < deadline:
                    continue
                log.error("only %d of %d followers proved themselves within %.0f s: exiting", len(proved), followers,
                          timeout_s)
                end_children()
                os._exit(1)
            threading.Thread(target=handshake, args=(conn, peer), daemon=True, name="spice-follower-watch").start()
        server.close()

    threading.Thread(target=accept, daemon=True, name="spice-follower-accept").start()


def hold_to_leader(host: str, port: int, node_rank: int = 1, timeout_s: float = 600.0,
                   token: str | None = None) -> int:
    """On a follower: prove this node to the leader's watch with the job's token (default
    $SPICE_ROLLOUT_TOKEN; retrying while the leader starts), check the leader's proof, and exit this
    process when the leader is gone. Returns the port of vLLM's store the leader chose. A process at
    host:port that cannot prove it is this job's leader is left, and tried again until `timeout_s`."""
    token = _token(token)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            conn = socket.create_connection((host, port), timeout=HANDSHAKE_S)
            try:
                conn.settimeout(HANDSHAKE_S)
                nonce = str(_receive(conn).get("nonce", ""))
                mine = secrets.token_hex(16)
                _send(conn, {"rank": node_rank, "nonce": mine, "proof": _proof(token, "follower", node_rank, nonce,
                                                                                 port)})
                answer = _receive(conn)
                master_port = answer.get("master_port")
                if not (isinstance(master_port, int) and 0 <= master_port < 65536 and hmac.compare_digest(
                        str(answer.get("proof", "")).encode(),
                        _proof(token, "leader", mine, port, master_port).encode())):
                    raise ValueError("no proof")
            except (OSError, ValueError) as e:
                conn.close()
                log.warning("the process at %s:%d did not prove it is this job's leader (%s): not following it",
                            host, port, e)
                raise OSError(f"{host}:{port} did not prove it is this job's leader") from e
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)
    conn.settimeout(None)
    threading.Thread(target=_exit_when_closed, args=(conn, f"the leader {host}:{port}"), daemon=True,
                     name="spice-leader-watch").start()
    return master_port


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
