"""torchrun for the learner: `python -m spice_megatron.torchrun` (the job scripts: its rendezvous
store bound to the given address only), the relaunch of `spice train` under it on one machine, and
the ports and sockets the processes share."""
from __future__ import annotations

import os
import secrets
import signal
import socket
import sys

_handed_out: set[int] = set()


def free_port() -> int:
    """A free port that no other bind(0) on this machine will be given for about a minute, so that
    another process (a parallel test worker, another run) cannot take it before its user binds it.
    The port is reserved through TCP's TIME_WAIT: a connection to it is accepted and closed from
    the listening side first, which leaves that side's socket in TIME_WAIT on the port (60 s on
    Linux). The kernel hands out no port with a socket in TIME_WAIT to bind(0), while a server that
    binds it with SO_REUSEADDR (uvicorn's and torch's TCPStore do) gets it at once. This process
    never hands out a port twice either (a learner's master port and a sync port, before binding)."""
    while True:
        with socket.socket() as listener:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(("127.0.0.1", 0))
            listener.listen(1)
            port = listener.getsockname()[1]
            with socket.create_connection(("127.0.0.1", port)) as client:
                accepted, _ = listener.accept()
                accepted.close()  # the listening side closes first: its end waits in TIME_WAIT
                client.recv(1)  # the peer's FIN, so our close completes the handshake
        if port not in _handed_out:
            _handed_out.add(port)
            return port


def listen_address(host: str) -> str:
    """Where a server that other nodes reach as `host` listens: `host` itself, except a name (not an
    address, not `localhost`) that resolves to loopback on this node, as Debian and Ubuntu write a
    node's own name into /etc/hosts (`127.0.1.1 node001`) while the other nodes resolve it to the real
    address: bound there, the server would refuse every other node, so it listens on every interface
    (slurm/rollout_node.sh's rule for the engines' API ports)."""
    import ipaddress

    try:
        ipaddress.ip_address(host)
        return host  # an address means that address
    except ValueError:
        pass
    if host == "localhost":
        return host
    try:
        resolved = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]
    except OSError:
        return host  # the bind names it
    return "0.0.0.0" if ipaddress.ip_address(resolved).is_loopback else host


def listen_on(host: str, port: int) -> socket.socket:
    """A listening socket bound to `host` alone (a TCPStore by itself listens on every interface;
    given this socket's fd it serves on it), or every interface where `host` is this node's name
    resolving to loopback here (listen_address)."""
    info = socket.getaddrinfo(listen_address(host), port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(info[0], socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(info[4])
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


def _bound_store_class(tcp_store):
    """torch's TCPStore, except that a server (is_master) listens on its host's address only: the
    learner's rendezvous store (torchrun's agent store, the c10d rendezvous) is not reachable from
    every interface (docs/cluster.md, "The learner's rendezvous"). Clients are unchanged."""

    def bound_store(host, port, world_size=None, is_master=False, *args, **kwargs):
        if is_master and kwargs.get("master_listen_fd") is None and port:
            try:
                kwargs["master_listen_fd"] = listen_on(host, port).detach()  # the store owns the fd from here
            except OSError as e:  # what TCPStore raises: the c10d rendezvous then joins as a client
                raise RuntimeError(f"cannot serve the rendezvous store on {host}:{port}: {e}") from e
        return tcp_store(host, port, world_size, is_master, *args, **kwargs)

    return bound_store


def die_with_parent(parent_pid: int) -> None:
    """First thing in a helper process (a spawned worker, the driver process): be killed when
    `parent_pid`, the process that started it, dies, even if a kill -9 gave the parent no chance to
    say so and this process is busy in C code that never reads its pipe (Linux's parent-death
    signal; elsewhere only the check below). The signal follows the *thread* that started the
    child: start helpers from a thread that lives as long as they should."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        os._exit(1)


def under_launcher() -> bool:
    return "RANK" in os.environ or "SLURM_PROCID" in os.environ


def relaunch_with_torchrun(nproc: int, argv: list[str] | None = None) -> None:
    """Re-execute this script under torchrun with `nproc` local ranks, unless already launched
    (torchrun, srun) or a single rank suffices. Multi-node jobs run torchrun/srun themselves."""
    if under_launcher() or nproc <= 1:
        return
    argv = sys.argv if argv is None else argv
    cmd = [sys.executable, "-m", "spice_megatron.torchrun", f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", *argv]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # the ranks prove it to each other before they exchange pickled objects (policy/parallel.py)
    os.environ.setdefault("SPICE_WORLD_SECRET", secrets.token_hex(16))
    os.execv(sys.executable, cmd)


def run_torchrun(torchrun_argv: list[str]) -> int:
    """torchrun, except that the rendezvous store it serves listens on its address only, and that a
    rank's user error (entry.UserError, recorded in SPICE_ERROR_FILE) ends the job with that one
    line and exit code 2 instead of every rank's line and torchrun's ChildFailedError traceback. Any
    other failure is torchrun's as it is."""
    import logging
    import tempfile

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend, static_tcp_rendezvous
    from torch.distributed.run import get_args_parser, run

    for module in (static_tcp_rendezvous, c10d_rendezvous_backend):  # the stores this agent serves
        module.TCPStore = _bound_store_class(module.TCPStore)

    from spice_megatron.entry import ERROR_FILE_ENV, USER_ERROR_EXIT

    with tempfile.TemporaryDirectory(prefix="spice-launch-") as tmp:
        error_file = os.path.join(tmp, "user_error")
        os.environ[ERROR_FILE_ENV] = error_file

        class QuietAfterUserError(logging.Filter):  # torchrun's "failed (exitcode: 2)" and SIGTERM notes
            def filter(self, record: logging.LogRecord) -> bool:
                return not os.path.exists(error_file)

        for name in ("", "torch", "torch.distributed"):  # where torch puts its stderr handlers
            for handler in logging.getLogger(name).handlers:
                handler.addFilter(QuietAfterUserError())
        try:
            run(get_args_parser().parse_args(torchrun_argv))
        except ChildFailedError:
            if not os.path.exists(error_file):
                raise
            with open(error_file) as f:
                print(f.read().strip(), file=sys.stderr)
            return USER_ERROR_EXIT
    return 0


if __name__ == "__main__":
    sys.exit(run_torchrun(sys.argv[1:]))


def rollout_urls_from_env(env: dict | None = None) -> list[str]:
    """Engine addresses handed over by a cluster launcher (slurm/*.sbatch, nemo_launcher.py):
    SPICE_ROLLOUT_NODES (comma-separated hosts), SPICE_ENGINES_PER_NODE and SPICE_ROLLOUT_PORT
    (engine i of rollout node k listens on port + k * engines per node + i, as slurm/rollout_node.sh
    starts them: rollout nodes that share a host do not collide). An engine across
    SPICE_ENGINE_NODES > 1 nodes answers on its first node only (its leader). Empty when
    SPICE_ROLLOUT_NODES is unset."""
    env = os.environ if env is None else env
    hosts = [h.strip() for h in env.get("SPICE_ROLLOUT_NODES", "").split(",") if h.strip()]
    if not hosts:
        return []
    per_node = int(env.get("SPICE_ENGINES_PER_NODE", "1"))
    span = int(env.get("SPICE_ENGINE_NODES", "1"))
    port = int(env.get("SPICE_ROLLOUT_PORT", "8100"))
    return [f"http://{h}:{port + k * per_node + i}" for k, h in enumerate(hosts) if k % span == 0
            for i in range(per_node)]


def global_rank() -> int:
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))
