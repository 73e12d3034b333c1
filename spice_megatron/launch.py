"""Starting SPMD learner processes on one machine."""
from __future__ import annotations

import os
import socket
import sys


_handed_out: set[int] = set()


def free_port() -> int:
    """A port nothing listens on now and that this process has not handed out before: two calls
    made before either port is bound (a learner's master port and a sync port) must not collide."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port


def under_launcher() -> bool:
    return "RANK" in os.environ or "SLURM_PROCID" in os.environ


def relaunch_with_torchrun(nproc: int, argv: list[str] | None = None) -> None:
    """Re-execute this script under torchrun with `nproc` local ranks, unless already launched
    (torchrun, srun) or a single rank suffices. Multi-node jobs run torchrun/srun themselves."""
    if under_launcher() or nproc <= 1:
        return
    argv = sys.argv if argv is None else argv
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           f"--master_port={free_port()}", *argv]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.execv(sys.executable, cmd)


def rollout_urls_from_env(env: dict | None = None) -> list[str]:
    """Engine addresses handed over by a cluster launcher (slurm/*.sbatch, recipes/launch.py):
    SPICE_ROLLOUT_NODES (comma-separated hosts), SPICE_ENGINES_PER_NODE and SPICE_ROLLOUT_PORT
    (engine i of a node listens on port + i). Empty when SPICE_ROLLOUT_NODES is unset."""
    env = os.environ if env is None else env
    hosts = [h for h in env.get("SPICE_ROLLOUT_NODES", "").split(",") if h.strip()]
    if not hosts:
        return []
    per_node = int(env.get("SPICE_ENGINES_PER_NODE", "1"))
    port = int(env.get("SPICE_ROLLOUT_PORT", "8100"))
    return [f"http://{h.strip()}:{port + i}" for h in hosts for i in range(per_node)]


def global_rank() -> int:
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))
