"""The Slurm scripts: syntax, shellcheck, agreement with their recipes, and what only stand-in
`srun` / `scontrol` / `curl` / `python` commands can show on a machine without GPUs or pyxis: the
GPU counts per node, the container flags, 8 engines per node, the failure counters and the kill
switch. What a real Slurm shows (runs, the time limit, requeue, scancel, kills, NeMo-Run) is
tests/test_slurm_box.py, against tools/env/slurm_box.sh."""
from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from recipes import get_recipe
from spice_megatron.plan.planner import plan_layout

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SBATCH = sorted(glob.glob(os.path.join(ROOT, "slurm", "*.sbatch")))
SCRIPTS = SBATCH + sorted(glob.glob(os.path.join(ROOT, "slurm", "*.sh")))

# Records its argv and the launch-relevant environment to $FAKE_LOG, then acts like the real command.
# The srun stand-in works out its task count as Slurm does: --ntasks, else the SLURM_NTASKS it
# inherits from the allocation, else nodes x --ntasks-per-node.
# The learner stand-in acts like torchrun over the trainer: every failure is exit 1; FAKE_LEARNER
# says what the trainer does (finish, fail, kill_switch: write the marker, run: iterate until a
# STOP file appears, then checkpoint and stop, or ignore_stop: never stop).
STAND_IN = r'''#!{python}
import json, os, signal, sys, time
name = os.path.basename(sys.argv[0]); argv = sys.argv[1:]
env = {{k: v for k, v in os.environ.items()
       if k.startswith(("SPICE_", "NCCL_", "TORCH_NCCL", "CUDA_", "HF_HUB", "VLLM_"))}}
rec = {{"cmd": name, "argv": argv, "env": env}}
def opt(flag, default=None):
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return default
if name == "srun":
    nodes = int(opt("--nodes", os.environ.get("SLURM_NNODES", "1")))
    per_node = int(opt("--ntasks-per-node", "1"))
    rec["tasks"] = int(opt("--ntasks", os.environ.get("SLURM_NTASKS", nodes * per_node)))
    rec["nodes"] = nodes
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write(json.dumps(rec) + "\n")
if name == "scontrol" and argv[:2] == ["show", "hostnames"]:
    print("\n".join(os.environ["FAKE_NODES"].split()))
elif name == "scontrol" and argv[:3] == ["show", "node", "-o"]:  # Slurm's address of a node: 10.0.0.<index>
    addr = os.environ.get("FAKE_NODE_ADDR") or "10.0.0." + str(os.environ["FAKE_NODES"].split().index(argv[3]))
    print("NodeName=" + argv[3] + " Arch=x86_64 NodeAddr=" + addr + " State=IDLE")
elif name == "squeue":  # FAKE_SQUEUE: the state it prints for any job (none: not in the queue)
    print(os.environ.get("FAKE_SQUEUE", ""))
elif name == "srun" and "hostname" in argv:
    print("10.1.2.3")
elif name == "srun" and "slurm/rollout_node.sh" in argv:
    time.sleep(120)  # a rollout service runs until the job script stops it
elif name == "srun" and "spice_megatron.torchrun" in argv:
    mode = os.environ.get("FAKE_LEARNER", "finish")
    out = argv[argv.index("--output") + 1]  # the run directory (srun's own is --output=<log>)
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(1))
    if mode == "fail":
        sys.exit(1)
    if mode == "kill_switch":
        open(os.path.join(out, "KILL_SWITCH"), "w").write("valid-task rate below 0.02 for 20 iterations\n")
        sys.exit(1)
    if mode == "stopped":  # someone touched OUTPUT_DIR/STOP: checkpoint, the STOPPED marker, exit 130 -> 1
        open(os.path.join(out, "STOPPED"), "w").write("stop requested\n")
        sys.exit(1)
    if mode in ("run", "ignore_stop"):
        open(os.path.join(out, "learner_started"), "w").close()
        while mode == "ignore_stop" or not os.path.exists(os.path.join(out, "STOP")):
            time.sleep(0.2)
        open(os.path.join(out, "checkpointed"), "w").close()
        sys.exit(1)  # the trainer exits 130 (Interrupted); torchrun reports 1
elif name == "python":  # rollout_node.sh starting one engine, or its follower on this node
    port = opt("--port", "follower")
    if port == os.environ.get("FAKE_EXIT_PORT"):
        time.sleep(1); sys.exit(7)
    time.sleep(120)
'''


@pytest.fixture
def fake_bin(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("srun", "scontrol", "curl", "python", "squeue"):
        p = bin_dir / name
        p.write_text(STAND_IN.format(python=sys.executable))
        p.chmod(0o755)
    return bin_dir


def _records(log) -> list[dict]:
    return [json.loads(line) for line in open(log)] if os.path.exists(log) else []


@pytest.mark.parametrize("script", SCRIPTS, ids=os.path.basename)
def test_syntax_and_shellcheck(script):
    subprocess.run(["bash", "-n", script], check=True)
    shellcheck = shutil.which("shellcheck") or os.path.join(os.path.dirname(sys.executable), "shellcheck")
    r = subprocess.run([shellcheck, "-x", script], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def _sbatch_settings(path: str) -> dict:
    text = open(path).read()
    header = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", text, re.M))
    body = dict(re.findall(r"^([A-Z_]+)=(\S+)$", text, re.M))
    return {**header, **body}


@pytest.mark.parametrize("script", SBATCH, ids=os.path.basename)
def test_sbatch_matches_its_recipe(script):
    s = _sbatch_settings(script)
    cfg = get_recipe(s["RECIPE"])
    assert int(s["nodes"]) == cfg.cluster.nodes
    assert int(s["LEARNER_NODES"]) == (cfg.cluster.nodes if cfg.run.colocate else cfg.cluster.split()[0])
    assert int(s["ENGINE_TP"]) == cfg.rollout.engine_tensor_parallel
    assert int(s["MAX_MODEL_LEN"]) == cfg.rollout.max_model_len
    assert s.get("ENGINE_EP", "0") == ("1" if cfg.rollout.engine_expert_parallel else "0")
    assert int(s["gpus-per-node"]) == cfg.cluster.gpus_per_node
    plan = plan_layout(cfg)  # the recipe's layout fits the nodes the script asks for
    assert plan.learner.gpus == int(s["LEARNER_NODES"]) * cfg.cluster.gpus_per_node
    # colocated: the engines' share of each GPU and vLLM's CUDA IPC, as the recipe plans them
    assert (s.get("COLOCATE") == "1") == cfg.run.colocate
    if "ENGINE_MEMORY_SHARE" in s:  # disaggregated too, where the recipe gives its engines more than 0.85
        assert float(s["ENGINE_MEMORY_SHARE"]) == cfg.rollout.gpu_memory_utilization
    if cfg.run.colocate:
        assert float(s["ENGINE_MEMORY_SHARE"]) == cfg.rollout.gpu_memory_utilization == plan.engines.utilization
        assert s["WEIGHT_TRANSFER"] == "${WEIGHT_TRANSFER:-ipc}" and cfg.rollout.weight_transfer == "ipc"
        assert plan.phases.rollout_gib <= 0.9 * cfg.cluster.gpu_memory_gib


def _job_env(script, fake_bin, tmp_path, learner="finish", restart=0, **extra_env):
    s = _sbatch_settings(script)
    nodes = [f"gpu{i:03d}" for i in range(int(s["nodes"]))]
    # what sbatch puts in the batch script's environment for --nodes=N --ntasks-per-node=1
    env = {**os.environ, "PATH": f"{fake_bin}:{os.environ['PATH']}", "FAKE_LOG": str(tmp_path / "calls.jsonl"),
           "FAKE_NODES": " ".join(nodes), "FAKE_LEARNER": learner, "SLURM_JOB_ID": "4242",
           "SLURM_JOB_NODELIST": f"gpu[000-{len(nodes) - 1:03d}]", "SLURM_NNODES": str(len(nodes)),
           "SLURM_NTASKS": str(len(nodes)), "SLURM_NTASKS_PER_NODE": "1",
           "SLURM_SUBMIT_DIR": ROOT, "SLURM_RESTART_COUNT": str(restart), "SLURM_GPUS_ON_NODE": "8",
           "MODEL_DIR": "/models/base", "OUTPUT_DIR": str(tmp_path / "run"), "CONTAINER_IMAGE": "/images/spice.sqsh",
           "ROLLOUT_CONTAINER_IMAGE": "/images/vllm.sqsh", "CONTAINER_MOUNTS": "/lustre/models:/models",
           "SPICE_TRUSTED_NETWORK": "1", **extra_env}  # engines across nodes: a network only the job reaches
    env.pop("SPICE_ROLLOUT_TOKEN", None)
    return env, nodes, s


def _run_job(script, fake_bin, tmp_path, learner="finish", restart=0, extra=(), **extra_env):
    env, nodes, s = _job_env(script, fake_bin, tmp_path, learner, restart, **extra_env)
    r = subprocess.run(["bash", script, *extra], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    return r, _records(tmp_path / "calls.jsonl"), nodes, s


@pytest.mark.parametrize("script", SBATCH, ids=os.path.basename)
def test_sbatch_launches_rollout_then_learner(script, fake_bin, tmp_path):
    r, calls, nodes, s = _run_job(script, fake_bin, tmp_path, extra=["run.iterations=5"])
    assert r.returncode == 0, r.stderr
    colocated = s.get("COLOCATE") == "1"
    learners, rollouts = nodes[:int(s["LEARNER_NODES"])], nodes[int(s["LEARNER_NODES"]):]
    if colocated:  # both roles on every node, the second step beside the first (--overlap)
        learners = rollouts = nodes
    sruns = [c for c in calls if c["cmd"] == "srun"]
    rollout = next(c for c in sruns if "slurm/rollout_node.sh" in c["argv"])
    learner = next(c for c in sruns if "spice_megatron.torchrun" in c["argv"])
    # one task per node for both (the inherited SLURM_NTASKS must not decide it)
    assert rollout["tasks"] == len(rollouts) and learner["tasks"] == len(learners)
    assert all(c["tasks"] == 1 for c in sruns if "hostname" in c["argv"])
    # CUDA_DEVICE_MAX_CONNECTIONS for the learner only
    assert "CUDA_DEVICE_MAX_CONNECTIONS=1" in learner["argv"] and "CUDA_DEVICE_MAX_CONNECTIONS" not in rollout["env"]
    # placement: each role on its own nodes, inside the container
    assert f"-w={','.join(rollouts)}" in "=".join(rollout["argv"]) or ",".join(rollouts) in rollout["argv"]
    assert ",".join(learners) in learner["argv"]
    assert "--container-image=/images/spice.sqsh" in learner["argv"]
    if colocated:  # one image for both (vLLM's IPC on the learner), engines asleep until the learner built
        assert "--container-image=/images/spice.sqsh" in rollout["argv"]
        assert "--overlap" in rollout["argv"] and "--overlap" in learner["argv"]
        assert rollout["env"]["SPICE_START_ASLEEP"] == "1" and rollout["env"]["SPICE_SLEEP_MODE"] == "1"
        assert rollout["env"]["SPICE_GPU_MEMORY_UTILIZATION"] == s["ENGINE_MEMORY_SHARE"]
        assert rollout["env"]["SPICE_WEIGHT_TRANSFER"] == "ipc"
        assert "cluster.learner_nodes=0" in learner["argv"]
    else:
        assert "--container-image=/images/vllm.sqsh" in rollout["argv"]  # two images: vLLM's torch breaks TE/apex
        assert "--overlap" not in rollout["argv"] + learner["argv"]
    assert learner["env"]["SPICE_DATA_DIR"] == os.path.join(ROOT, "data")  # the staged corpus
    for c in (rollout, learner):
        assert any(a.startswith("--container-mounts=") and "/lustre/models:/models" in a for a in c["argv"])
        assert any(a.startswith("--output=") and str(tmp_path / "run" / "logs") in a for a in c["argv"])
    assert any("rollout_%N" in a for a in rollout["argv"]) and any("learner_%N" in a for a in learner["argv"])
    # the engines are healthy before the learner starts
    order = [c["cmd"] + (":learner" if "spice_megatron.torchrun" in c["argv"] else "") for c in calls]
    per_node = max(1, 8 // int(s["ENGINE_TP"]))
    span = max(1, int(s["ENGINE_TP"]) // 8)  # an engine wider than a node answers on its first node
    health = [c["argv"][-1] for c in calls if c["cmd"] == "curl"]
    # the engines at Slurm's node addresses; engine i of rollout node k on 8100 + k * per_node + i
    addrs = [f"10.0.0.{nodes.index(h)}" for h in rollouts]
    expected = [f"http://{a}:{8100 + k * per_node + i}/health" for k, a in enumerate(addrs) if k % span == 0
                for i in range(per_node)]
    assert sorted(health) == sorted(expected)
    assert len(health) == len(rollouts) * per_node // span and order.index("srun:learner") > max(
        i for i, o in enumerate(order) if o == "curl")
    # torchrun rendezvous over the learner nodes; the recipe, resume and overrides reach the trainer
    a = learner["argv"]
    assert f"--nnodes={s['LEARNER_NODES']}" in a and "--nproc-per-node=8" in a
    assert "--rdzv-endpoint=10.1.2.3:29500" in a and "--rdzv-id=4242" in a
    assert a[a.index("--recipe") + 1] == s["RECIPE"] and "--resume" in a and "run.iterations=5" in a
    # addresses and token through the environment, the token never on a command line
    env = learner["env"]
    assert env["SPICE_ROLLOUT_NODES"] == ",".join(addrs) and env["SPICE_ENGINES_PER_NODE"] == str(per_node)
    assert env["SPICE_ENGINE_NODES"] == str(span)
    assert len(env["SPICE_ROLLOUT_TOKEN"]) == 32 and rollout["env"]["SPICE_ROLLOUT_TOKEN"] == env["SPICE_ROLLOUT_TOKEN"]
    assert all(env["SPICE_ROLLOUT_TOKEN"] not in " ".join(c["argv"]) for c in calls)
    # NCCL's default cuMem (NVLS for the learner's collectives): no node holds a sender and an engine
    assert "NCCL_CUMEM_ENABLE" not in env and env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    from spice_megatron.torchrun import rollout_urls_from_env
    assert [u + "/health" for u in rollout_urls_from_env(env)] == expected
    assert not [c for c in calls if c["cmd"] == "scontrol" and "requeue" in c["argv"]]


@pytest.mark.parametrize("learner,failed_before,rc,requeued", [
    ("fail", 0, 1, True), ("fail", 3, 1, False), ("kill_switch", 0, 3, False), ("stopped", 0, 0, False)])
def test_sbatch_requeues_failures_not_the_kill_switch(fake_bin, tmp_path, learner, failed_before, rc, requeued):
    script = os.path.join(ROOT, "slurm", "spice_8b.sbatch")
    (tmp_path / "run").mkdir()
    if failed_before:
        (tmp_path / "run" / ".slurm_failed_attempts").write_text(f"{failed_before}\n")
    # torchrun reports the kill switch as exit 1 like any failure: the marker file tells them apart
    r, calls, _, _ = _run_job(script, fake_bin, tmp_path, learner=learner, restart=5)
    assert r.returncode == rc, r.stderr
    requeues = [c for c in calls if c["cmd"] == "scontrol" and c["argv"][:1] == ["requeue"]]
    assert bool(requeues) == requeued and all(c["argv"] == ["requeue", "4242"] for c in requeues)
    if learner == "fail":
        assert (tmp_path / "run" / ".slurm_failed_attempts").read_text().strip() == str(failed_before + 1)


@pytest.mark.parametrize("holder_state,starts", [("RUNNING", False), ("", True)])
def test_a_run_directory_another_running_job_holds_is_refused_untouched(fake_bin, tmp_path, holder_state, starts):
    script = os.path.join(ROOT, "slurm", "spice_8b.sbatch")
    run = tmp_path / "run"
    run.mkdir()
    (run / "RUN_LOCK").write_text(json.dumps({"host": "gpu007", "pid": 12, "slurm_job_id": "99"}))
    (run / "STOP").write_text("")  # the other job's time-limit request: not this job's to remove
    r, calls, _, _ = _run_job(script, fake_bin, tmp_path, FAKE_SQUEUE=holder_state)
    assert any(c["cmd"] == "squeue" and "99" in c["argv"] for c in calls)
    if starts:  # job 99 has left the queue: the trainer takes its lock over
        assert r.returncode == 0, r.stderr
        assert not (run / "STOP").exists()
    else:
        assert r.returncode == 2 and "in use by Slurm job 99" in r.stderr
        assert (run / "STOP").exists() and not [c for c in calls if c["cmd"] in ("srun", "scontrol")]


def test_a_rollout_node_address_that_does_not_resolve_is_one_line_at_once(fake_bin, tmp_path):
    """Not a health wait of HEALTH_TIMEOUT (30 minutes) and a requeue: the line names node and address."""
    import time

    script = os.path.join(ROOT, "slurm", "spice_8b.sbatch")
    t0 = time.monotonic()
    r, calls, nodes, _ = _run_job(script, fake_bin, tmp_path, FAKE_NODE_ADDR="n2.invalid")
    assert r.returncode == 2 and f"rollout node {nodes[1]}'s address n2.invalid does not resolve" in r.stderr
    assert time.monotonic() - t0 < 30 and not [c for c in calls if c["cmd"] == "curl" or "requeue" in c["argv"]]


def _time_limit_run(script, fake_bin, tmp_path, learner, grace):
    import signal
    import time

    env, _, _ = _job_env(script, fake_bin, tmp_path, learner, restart=2, STOP_GRACE=str(grace))
    proc = subprocess.Popen(["bash", script], env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    started = tmp_path / "run" / "learner_started"
    deadline = time.monotonic() + 60
    while not started.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert started.exists()
    t0 = time.monotonic()
    proc.send_signal(signal.SIGUSR1)  # what sbatch --signal=B:USR1@600 sends
    out, err = proc.communicate(timeout=60)
    return proc.returncode, err, time.monotonic() - t0, _records(tmp_path / "calls.jsonl")


@pytest.mark.parametrize("learner", ["ignore_stop"])  # one that stops: tests/test_slurm_box.py, for real
def test_time_limit_lets_the_learner_checkpoint_then_requeues(fake_bin, tmp_path, learner):
    script = os.path.join(ROOT, "slurm", "spice_8b.sbatch")
    rc, err, seconds, calls = _time_limit_run(script, fake_bin, tmp_path, learner, grace=3)
    assert rc == 0, err
    requeues = [c for c in calls if c["cmd"] == "scontrol" and c["argv"][:1] == ["requeue"]]
    assert len(requeues) == 1 and "time limit" in err
    assert (tmp_path / "run" / ".slurm_time_limit_requeues").read_text().strip() == "1"
    assert not (tmp_path / "run" / ".slurm_failed_attempts").exists()  # not counted as a failure
    if learner == "run":  # it saw the STOP file and checkpointed before the requeue
        assert (tmp_path / "run" / "checkpointed").exists() and seconds < 3
    else:  # bounded: killed after STOP_GRACE
        assert "did not stop within 3s" in err and 3 <= seconds < 30


def test_rollout_node_starts_one_engine_per_gpu_group_restarts_one_that_dies_and_fails_past_the_bound(
        fake_bin, tmp_path):
    log = tmp_path / "calls.jsonl"
    env = {**os.environ, "PATH": f"{fake_bin}:{os.environ['PATH']}", "FAKE_LOG": str(log), "FAKE_EXIT_PORT": "8106",
           "SPICE_MODEL": "/models/base", "SPICE_ROLLOUT_TOKEN": "t" * 32, "SPICE_ENGINE_TP": "2",
           "SPICE_GPUS_PER_NODE": "8", "SPICE_ROLLOUT_PORT": "8100", "SPICE_LOG_DIR": str(tmp_path / "logs"),
           "SLURM_NODEID": "1", "SLURMD_NODENAME": "gpu007", "SPICE_ENGINE_RESTARTS": "2",
           "SPICE_SLEEP_MODE": "1", "SPICE_START_ASLEEP": "1"}  # a colocated job's
    r = subprocess.run(["bash", os.path.join(ROOT, "slurm", "rollout_node.sh")], env=env, capture_output=True,
                       text=True, timeout=60)
    # the engine on port 8106 exits with 7 each time: started again twice on its GPUs and port, then
    # the node fails with it (a requeue)
    assert r.returncode == 7, r.stderr
    assert "restart 1 of 2" in r.stderr and "restart 2 of 2" in r.stderr and "after 2 restart(s)" in r.stderr
    engines = [c for c in _records(log) if c["cmd"] == "python"]
    # rollout node 1 of the step: its engines after node 0's four (ports that cannot collide on one host)
    assert sorted((c["env"]["CUDA_VISIBLE_DEVICES"], c["argv"][c["argv"].index("--port") + 1]) for c in engines) == [
        ("0,1", "8104"), ("2,3", "8105"), ("4,5", "8106"), ("4,5", "8106"), ("4,5", "8106"), ("6,7", "8107")]
    assert os.path.exists(tmp_path / "logs" / "rollout_gpu007_8106.log")  # named by Slurm's node name
    assert all(c["argv"][c["argv"].index("--tensor-parallel-size") + 1] == "2" for c in engines)
    assert all("t" * 32 not in c["argv"] for c in engines)
    assert not any("--enable-expert-parallel" in c["argv"] for c in engines)
    # colocated: every engine in sleep mode; each starts asleep the first time, a restarted one awake
    assert all("--enable-sleep-mode" in c["argv"] for c in engines)
    asleep = [c["argv"][c["argv"].index("--port") + 1] for c in engines if "--start-asleep" in c["argv"]]
    assert sorted(asleep) == ["8104", "8105", "8106", "8107"]


def test_rollout_node_passes_expert_parallelism_to_moe_engines(fake_bin, tmp_path):
    log = tmp_path / "calls.jsonl"
    env = {**os.environ, "PATH": f"{fake_bin}:{os.environ['PATH']}", "FAKE_LOG": str(log), "FAKE_EXIT_PORT": "8100",
           "SPICE_MODEL": "/models/moe", "SPICE_ROLLOUT_TOKEN": "t" * 32, "SPICE_ENGINE_TP": "8",
           "SPICE_GPUS_PER_NODE": "8", "SPICE_ROLLOUT_PORT": "8100", "SPICE_LOG_DIR": str(tmp_path / "logs"),
           "SPICE_ENGINE_EXPERT_PARALLEL": "1", "SPICE_ENGINE_RESTARTS": "0"}
    subprocess.run(["bash", os.path.join(ROOT, "slurm", "rollout_node.sh")], env=env, capture_output=True, text=True,
                   timeout=60)
    (engine,) = [c for c in _records(log) if c["cmd"] == "python"]
    assert "--enable-expert-parallel" in engine["argv"]


def test_rollout_node_starts_the_leader_or_a_follower_of_an_engine_across_nodes(fake_bin, tmp_path):
    """Engines of TP=16 over nodes of 8 GPUs on four rollout nodes: two engines of two nodes each. Node 2
    leads the second engine (the API on port 8100 + 2), node 3 runs its follower; both on every GPU of
    their node, with the same span and seed, restarted on their own when they exit."""
    log = tmp_path / "calls.jsonl"
    base = {**os.environ, "PATH": f"{fake_bin}:{os.environ['PATH']}", "FAKE_LOG": str(log),
            "SPICE_MODEL": "/models/big", "SPICE_ROLLOUT_TOKEN": "t" * 32, "SPICE_ENGINE_TP": "16",
            "SPICE_GPUS_PER_NODE": "8", "SPICE_ROLLOUT_PORT": "8100", "SPICE_LOG_DIR": str(tmp_path / "logs"),
            "SPICE_ROLLOUT_NODES": "10.0.0.5,10.0.0.6,10.0.0.7,10.0.0.8", "SPICE_ENGINE_RESTARTS": "1",
            "SPICE_TRUSTED_NETWORK": "1"}
    for node, exits in (("2", "8102"), ("3", "follower")):
        node_env = {"SLURM_NODEID": node, "SLURMD_NODENAME": f"gpu00{node}", "FAKE_EXIT_PORT": exits}
        r = subprocess.run(["bash", os.path.join(ROOT, "slurm", "rollout_node.sh")], capture_output=True, text=True,
                           env={**base, **node_env}, timeout=60)
        assert r.returncode == 7 and "restart 1 of 1" in r.stderr, r.stderr
    leader, _, follower, _ = [c for c in _records(log) if c["cmd"] == "python"]
    # vLLM's store: a port the leader picks per start and tells proven followers (--master-port 0)
    span = ["--nnodes", "2", "--master-addr", "10.0.0.7", "--master-port", "0", "--watch-port", "29603"]
    assert leader["argv"][:5] == ["-m", "spice_megatron.rollout.serve", "--host", "10.0.0.7", "--port"]
    assert leader["argv"][5:14] == ["8102", *span]
    assert follower["argv"][:4 + len(span)] == ["-m", "spice_megatron.rollout.follower", "--node-rank", "1", *span]
    for c in (leader, follower):
        assert c["env"]["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"
        assert c["argv"][c["argv"].index("--tensor-parallel-size") + 1] == "16" and "--seed" in c["argv"]
        assert c["argv"][c["argv"].index("--seed") + 1] == str(1234 + 2000)  # the same on both nodes
    assert os.path.exists(tmp_path / "logs" / "rollout_gpu003_8102_node1.log")
    # an engine that cannot span whole nodes, or would be colocated, is one line and exit 2
    for bad in ({"SPICE_ENGINE_TP": "12"}, {"SPICE_ROLLOUT_NODES": "a,b,c"}, {"SPICE_SLEEP_MODE": "1"}):
        r = subprocess.run(["bash", os.path.join(ROOT, "slurm", "rollout_node.sh")], capture_output=True, text=True,
                           env={**base, "SLURM_NODEID": "0", **bad}, timeout=60)
        assert r.returncode == 2 and "spans whole nodes" in r.stderr, (bad, r.stderr)


def test_a_colocated_job_with_an_engine_wider_than_a_node_is_refused_naming_the_placement(fake_bin, tmp_path):
    r, calls, _, _ = _run_job(os.path.join(ROOT, "slurm", "spice_8b_1node.sbatch"), fake_bin, tmp_path,
                              SPICE_ENGINE_TP="16")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "colocated engines stay within a node: use the disaggregated placement (COLOCATE=0" in r.stderr
    assert not [c for c in calls if c["cmd"] == "srun" and "slurm/rollout_node.sh" in c["argv"]]


def test_nccl_mismatch_names_a_remedy_that_reaches_torchs_nccl(tmp_path):
    """The spice sync runs torch's ProcessGroupNCCL on both sides: the remedy is the same torch/NCCL or
    a pinned NCCL in the rollout image, never VLLM_NCCL_SO_PATH (vLLM's ctypes NCCL only). `srun` is a
    stand-in printing each image's NCCL version."""
    fake = tmp_path / "srun"
    fake.write_text('#!/bin/sh\ncase "$2" in *learner*) echo 2.27.3;; *) echo 2.26.5;; esac\n')
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    script = os.path.join(ROOT, "tools", "env", "containers", "nccl_versions.sh")
    r = subprocess.run(["bash", script, "learner.sqsh", "rollout.sqsh"], capture_output=True, text=True, env=env)
    assert r.returncode == 1 and "learner image NCCL 2.27.3, rollout image NCCL 2.26.5" in r.stdout
    assert "nvidia-nccl-cu12==2.27.3" in r.stderr and "same torch/NCCL" in r.stderr
    assert "set VLLM_NCCL_SO_PATH" not in r.stderr


def test_a_quantized_engine_model_is_refused_before_any_srun_and_not_requeued(fake_bin, tmp_path, monkeypatch):
    """An FP8 MODEL_DIR without ROLLOUT_MODEL_DIR was refused only from the engines'
    /status after the learner had loaded 671B parameters, as a failure that requeued (four starts)."""
    import io

    from spice_megatron.bridge.dequantize import QuantizedEngineModel
    from spice_megatron.cli.nemo_launcher import slurm_experiment

    fp8 = tmp_path / "fp8"
    fp8.mkdir()
    (fp8 / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "fp8"}}))
    r, calls, _, _ = _run_job(os.path.join(ROOT, "slurm", "spice_8b.sbatch"), fake_bin, tmp_path, MODEL_DIR=str(fp8))
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(f"spice: ROLLOUT_MODEL_DIR={fp8} is quantized") and "spice convert bf16" in r.stderr
    assert not [c for c in calls if c["cmd"] == "srun"]  # nothing started, nothing requeued
    # NeMo-Run's launcher, on the submitting host, before anything is written
    monkeypatch.setenv("NEMORUN_HOME", str(tmp_path / "nemorun"))
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    with pytest.raises(QuantizedEngineModel, match=f"--model={fp8}: the engines would serve it quantized"):
        slurm_experiment("qwen3_8b", account="acct", partition="p", container_image="none", model_dir=str(fp8),
                         data_dir="/data", output_dir=str(tmp_path / "out"), job_dir=str(tmp_path / "jobs"))


def test_an_engine_across_nodes_gets_vllm_host_ip_and_a_restart_waits_for_its_port(fake_bin, tmp_path):
    """vLLM advertises its message queues at VLLM_HOST_IP (else the default
    route's interface); a restarted engine waits, bounded, until its last one's processes let go of its
    ports (and GPUs, where nvidia-smi is)."""
    import socket

    from dist_utils import free_port

    log = tmp_path / "calls.jsonl"
    port = free_port()
    base = {**os.environ, "PATH": f"{fake_bin}:{os.environ['PATH']}", "FAKE_LOG": str(log),
            "SPICE_MODEL": "/models/big", "SPICE_ROLLOUT_TOKEN": "t" * 32, "SPICE_ENGINE_TP": "16",
            "SPICE_GPUS_PER_NODE": "8", "SPICE_ROLLOUT_PORT": str(port), "SPICE_LOG_DIR": str(tmp_path / "logs"),
            "SPICE_ROLLOUT_NODES": "10.0.0.5,10.0.0.6", "SPICE_ENGINE_RESTARTS": "1", "SLURM_NODEID": "0",
            "FAKE_EXIT_PORT": str(port), "SPICE_ENGINE_FREE_WAIT": "3", "SPICE_ENGINE_HOST_IP": "10.0.0.5",
            "SPICE_TRUSTED_NETWORK": "1",
            "SPICE_ENGINE_MASTER_PORT": str(free_port())}
    base.pop("VLLM_HOST_IP", None)
    with socket.create_server(("127.0.0.1", port)):  # an orphan of the last engine holding the API port
        r = subprocess.run(["bash", os.path.join(ROOT, "slurm", "rollout_node.sh")], capture_output=True, text=True,
                           env=base, timeout=60)
    assert r.returncode == 7 and "restart 1 of 1" in r.stderr, r.stderr
    assert f"still held after 3 s: port {port}; restarting anyway" in r.stderr
    engines = [c for c in _records(log) if c["cmd"] == "python"]
    assert len(engines) == 2 and all(c["env"]["VLLM_HOST_IP"] == "10.0.0.5" for c in engines)
    # a single-node engine is left to vLLM's own choice
    single = {**base, "SPICE_ENGINE_TP": "8", "SPICE_ENGINE_RESTARTS": "0"}
    log.unlink()
    subprocess.run(["bash", os.path.join(ROOT, "slurm", "rollout_node.sh")], capture_output=True, text=True,
                   env=single, timeout=60)
    assert all("VLLM_HOST_IP" not in c["env"] for c in _records(log) if c["cmd"] == "python")


def test_an_engine_across_nodes_needs_a_declared_trusted_network_before_any_srun(fake_bin, tmp_path):
    """vLLM's store and queues are not authenticated; the job starts an engine
    across nodes only where SPICE_TRUSTED_NETWORK says the rollout nodes' network is the job's alone."""
    script = os.path.join(ROOT, "slurm", "spice_deepseek_v3.sbatch")
    r, calls, _, _ = _run_job(script, fake_bin, tmp_path, SPICE_TRUSTED_NETWORK="")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "runs vLLM's unauthenticated store" in r.stderr and "SPICE_TRUSTED_NETWORK=1" in r.stderr
    assert not [c for c in calls if c["cmd"] == "srun"]
    r, calls, _, _ = _run_job(script, fake_bin, tmp_path, SPICE_TRUSTED_NETWORK="1")
    assert r.returncode == 0, r.stderr
    rollout = next(c for c in calls if c["cmd"] == "srun" and "slurm/rollout_node.sh" in c["argv"])
    assert rollout["env"]["SPICE_TRUSTED_NETWORK"] == "1"


def test_the_learners_world_secret_is_fresh_and_reaches_the_learners_step_only(fake_bin, tmp_path):
    """The learner's world secret fell back to the engines' token, which every
    rollout node (vLLM's open plane) holds. The job gives the learner's step a secret of its own."""
    r, calls, _, _ = _run_job(os.path.join(ROOT, "slurm", "spice_8b.sbatch"), fake_bin, tmp_path)
    assert r.returncode == 0, r.stderr
    rollout = next(c for c in calls if c["cmd"] == "srun" and "slurm/rollout_node.sh" in c["argv"])
    learner = next(c for c in calls if c["cmd"] == "srun" and "spice_megatron.torchrun" in c["argv"])
    assert "SPICE_WORLD_SECRET" not in rollout["env"]
    secret = learner["env"]["SPICE_WORLD_SECRET"]
    assert len(secret) == 32 and secret != learner["env"]["SPICE_ROLLOUT_TOKEN"]
    assert secret not in " ".join(learner["argv"])  # never on a command line


def test_one_set_of_image_names_and_every_disaggregated_example_names_both_images():
    """Three names for the images, and sbatch headers whose example gave one image
    where the job needs two (vLLM's torch breaks an NGC image's TE/apex: slurm/spice_job.sh)."""
    names = set()
    for path in [os.path.join(ROOT, "README.md"), *glob.glob(os.path.join(ROOT, "docs", "*.md")),
                 *glob.glob(os.path.join(ROOT, "slurm", "*"))]:
        names |= set(re.findall(r"([\w.-]+)\.sqsh", open(path).read()))
    assert names <= {"spice-learner", "spice-rollout", "spice-colocated"}, names
    for script in SBATCH:
        header = "".join(line for line in open(script) if line.startswith("#   "))
        if "CONTAINER_IMAGE=" in header and "colocated" not in header:
            assert "ROLLOUT_CONTAINER_IMAGE=/images/spice-rollout.sqsh" in header, script
