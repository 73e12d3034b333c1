"""Issue 63's engine across nodes, on this machine: vLLM's multi-node serving with the `mp` executor,
the leader (node 0) our HTTP service, the follower (node 1) `spice_megatron.rollout.follower`, each a
process of its own holding one of the engine's two tensor-parallel workers, reaching each other
through the leader's torch.distributed store (gloo on CPU, NCCL on GPU). What a Slurm job does
with two hosts, on one: the same processes and the same TCP rendezvous, not a stand-in."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from dist_utils import free_port, run_ranks
from test_rollout import ENGINE_ARGS, PROMPTS, TOKEN, _in_process_greedy, _learner_sends, greedy, status

from spice_megatron.data.offline_assets import make_tiny_engine_model
from spice_megatron.rollout.fleet import RolloutFleet
from spice_megatron.rollout.local import start_engine, wait_healthy
from spice_megatron.wire.auth import TOKEN_ENV
from spice_megatron.wire.types import SamplingSpec

# an engine across nodes starts only where the operator declared a network only the job reaches
TRUSTED = {"OMP_NUM_THREADS": "1", "SPICE_TRUSTED_NETWORK": "1"}


@pytest.mark.slow
def test_an_engine_across_two_nodes_serves_syncs_every_worker_and_dies_with_a_follower(tmp_path):
    a = make_tiny_engine_model(str(tmp_path / "a"), "qwen3", seed=1)
    b = make_tiny_engine_model(str(tmp_path / "b"), "qwen3", seed=2)
    # vLLM's store on a port the leader picks per start and tells its proven follower (rollout/node_watch.py)
    span = ["--tensor-parallel-size", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", "0",
            "--watch-port", str(free_port()), *ENGINE_ARGS]
    follower_log = open(tmp_path / "follower.log", "w")
    follower = subprocess.Popen([sys.executable, "-m", "spice_megatron.rollout.follower", "--model", a,
                                 "--node-rank", "1", *span], stdout=follower_log, stderr=subprocess.STDOUT,
                                start_new_session=True,  # its group: vLLM's workers and resource tracker
                                env={**os.environ, **TRUSTED, TOKEN_ENV: TOKEN})  # every worker checks
    leader = start_engine(a, TOKEN, str(tmp_path), extra=span, env=TRUSTED)
    try:
        wait_healthy([leader], timeout=600)
        assert status(leader.url)["workers"] == 2  # the weight sync's receivers: one worker per node
        # the leader asked both nodes' workers what they built (rollout/step_settings.py) before serving
        assert "2 worker(s) on 2 node(s) built the same step" in open(leader.log_path).read()
        # a stranger subscribed to every other port the leader listens on (vLLM's queues to the other
        # node among them) reads nothing of the requests: they speak CURVE with the job token's keys
        # (rollout/engine_channels.py)
        listening = _listening_ports(leader.process.pid) - {int(leader.url.rsplit(":", 1)[1])}
        assert listening, "the leader's queues to the follower's node were not found"
        stranger = _subscribed_everywhere(listening)
        (alone,) = run_ranks(_in_process_greedy, 1, a, PROMPTS, 12, tmp_path=tmp_path)
        assert greedy(leader.url) == alone  # TP=2 over two nodes decodes what one process does
        assert _heard(stranger) == 0, "a process without the token read the engine's broadcast"

        go, joined = str(tmp_path / "go"), str(tmp_path / "joined")
        open(go, "w").close()
        sent = {}
        learner = threading.Thread(target=lambda: sent.update(r=run_ranks(
            _learner_sends, 1, b, free_port(), 3, 2, [leader.url], go, joined, tmp_path=tmp_path)))
        learner.start()
        learner.join(600)
        assert "r" in sent, "the weight sync did not finish"
        fleet = RolloutFleet([leader.url], TOKEN)
        fleet.barrier(3)
        (fresh,) = run_ranks(_in_process_greedy, 1, b, PROMPTS, 12, tmp_path=tmp_path)
        assert greedy(leader.url) == fresh != alone  # both workers took the new weights, checked per tensor
        fleet.close()

        # a follower's death during a long batch is the engine's (rollout/node_watch.py): the leader exits,
        # to be restarted whole, with every worker of its own; vLLM alone would wait
        # in its next collective
        long = RolloutFleet([leader.url], TOKEN, request_timeout=300)
        batch = long._pool.submit(long.generate, [f"story {i}:" for i in range(32)],
                                  SamplingSpec(n=1, temperature=1.0, max_tokens=400, seed=3))
        steps = status(leader.url)["steps"]
        deadline = time.monotonic() + 120
        while status(leader.url)["steps"] < steps + 5 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert status(leader.url)["running"] > 0, "the long batch is not generating"
        follower.kill()
        deadline = time.monotonic() + 60
        while leader.alive() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not leader.alive(), "the leader outlived its follower"
        assert "follower node 1 of 1 proved itself from 127.0.0.1" in open(leader.log_path).read()
        # the workers of both nodes die with their process (node_watch.die_with_parent, end_children): on a
        # GPU an orphan would hold its memory and ports against the restarted engine
        while (_in_group(follower.pid) or _in_group(leader.process.pid)) and time.monotonic() < deadline + 30:
            time.sleep(0.5)
        assert not _in_group(follower.pid), "the follower's workers outlived it"
        assert not _in_group(leader.process.pid), "the leader's workers outlived it"
        with pytest.raises(Exception):  # noqa: B017 - the batch's engine is gone (the trainer restarts it)
            batch.result(timeout=120)
        long.close()

        # restarted whole, as rollout_node.sh restarts each node's part: it serves again, on the same ports.
        # A stranger without the token reaches the watch first: one connection closes at once, one holds
        # its slot and one sends a made-up hello;
        # none ends the leader, keeps the job's follower out or learns the engine's store port
        port = int(leader.url.rsplit(":", 1)[1])
        leader = start_engine(a, TOKEN, str(tmp_path / "restarted"), port, extra=span, env=TRUSTED)
        watch = int(span[span.index("--watch-port") + 1])
        strangers = _stranger_at_the_watch(watch)
        follower_log.close()
        follower_log = open(tmp_path / "follower2.log", "w")
        follower = subprocess.Popen([sys.executable, "-m", "spice_megatron.rollout.follower", "--model", a,
                                     "--node-rank", "1", *span], stdout=follower_log, stderr=subprocess.STDOUT,
                                    start_new_session=True,
                                    env={**os.environ, **TRUSTED, TOKEN_ENV: TOKEN})
        wait_healthy([leader], timeout=600)
        assert greedy(leader.url) == alone
        said = b"".join(_drain(s) for s in strangers)
        assert b"master_port" not in said and b"proof" not in said, said
        log = open(leader.log_path).read()
        assert "follower node 1 of 1 proved itself from 127.0.0.1" in log
        assert "did not prove it holds the job's token" in log
        for s in strangers:
            s.close()
    finally:
        leader.stop()
        try:
            os.killpg(follower.pid, signal.SIGKILL)  # the follower and every process it started
        except ProcessLookupError:
            pass
        follower.wait(30)
        follower_log.close()


def _listening_ports(pid: int) -> set[int]:
    """The TCP ports a process listens on (its sockets in /proc/net/tcp, as a port scan finds them)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:["):-1])
    ports = set()
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in open(name).read().splitlines()[1:]:
            f = row.split()
            if f[3] == "0A" and f[9] in inodes:  # LISTEN
                ports.add(int(f[1].rsplit(":", 1)[1], 16))
    return ports


def _subscribed_everywhere(ports: set[int]) -> list:
    import zmq

    context = zmq.Context()
    subs = []
    for port in ports:
        sub = context.socket(zmq.SUB)
        sub.setsockopt_string(zmq.SUBSCRIBE, "")
        sub.setsockopt(zmq.LINGER, 0)
        sub.connect(f"tcp://127.0.0.1:{port}")
        subs.append(sub)
    return subs


def _heard(subs: list) -> int:
    """Messages the subscribers received (none wait: whatever arrived is queued by now)."""
    import zmq

    got = 0
    for sub in subs:
        while True:
            try:
                sub.recv(zmq.NOBLOCK)
                got += 1
            except zmq.Again:
                break
        sub.close()
    return got


def _stranger_at_the_watch(port: int) -> list:
    """Three connections to the leader's watch as soon as it listens, without the token."""
    deadline = time.monotonic() + 120
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=5).close()  # connect and close
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    holder = socket.create_connection(("127.0.0.1", port), timeout=5)  # says nothing, holds a slot
    liar = socket.create_connection(("127.0.0.1", port), timeout=5)
    liar.sendall(b'{"role": "follower", "node_rank": 1, "proof": "00"}\n')
    return [holder, liar]


def _drain(conn) -> bytes:
    """What the leader sent a stranger before closing on it (nothing that helps it)."""
    conn.settimeout(1)
    got = b""
    try:
        while chunk := conn.recv(4096):
            got += chunk
    except OSError:
        pass
    return got


def _in_group(pgid: int) -> list[str]:
    """The live (not zombie) processes of a process group, by name."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            stat = open(f"/proc/{entry}/stat").read()
        except (OSError, ValueError):
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if entry.isdigit() and fields[0] != "Z" and int(fields[2]) == pgid:
            found.append(stat[stat.index("(") + 1:stat.rindex(")")])
    return found
