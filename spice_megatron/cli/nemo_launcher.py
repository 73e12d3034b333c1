"""NeMo-Run launchers for a recipe (`spice launch`).

    # the tiny CPU recipe on this machine (torchrun through NeMo-Run's LocalExecutor)
    spice launch --recipe tiny_cpu --executor local run.iterations=2
    # a paper recipe on a Slurm cluster: print the sbatch script, or submit it
    spice launch --recipe qwen3_8b --executor slurm --account ACCT --partition batch \
        --container-image /images/spice-learner.sqsh --mount /lustre/models:/models \
        --mount /lustre/results:/results --mount /lustre/spice_data:/data --model /models/Qwen3-8B-Base \
        --data /data --output /results/qwen3_8b --dryrun
(output, data and model directories must lie under a --mount destination: the container's own
filesystem is private to its node and discarded with the job)

On Slurm one job holds both roles: the rollout services on the last nodes (slurm/rollout_node.sh,
one srun task per node; colocated recipes, run.colocate: on every node, beside the learner, started
asleep) and the learner on the first ones (one srun task per GPU; Megatron reads
SLURM_PROCID). They meet through the environment the job exports (SPICE_ROLLOUT_NODES,
SPICE_ENGINES_PER_NODE, SPICE_ENGINE_NODES, SPICE_ROLLOUT_PORT, SPICE_ROLLOUT_TOKEN); the learner waits for the engines
to be healthy (rollout.health_timeout). NeMo-Run requeues a failed job up to --retries times and the
learner always starts with --resume; after the kill switch (exit code 3, which NeMo-Run's script
requeues like any failure) the learner refuses to resume and the requeued job ends at once.
"""
from __future__ import annotations

import glob
import os
import re
import shlex
import sys

from recipes import get_recipe
from spice_megatron.bridge.dequantize import check_engine_model
from spice_megatron.config import SpiceConfig, apply_overrides
from spice_megatron.rollout.node_watch import TRUSTED_NETWORK_ENV, trusted_network_refusal

CODE_DIR = "/nemo_run/code"  # where NeMo-Run's packager puts the repository inside the container
ROLLOUT_PORT = 8100


def _train_args(recipe: str, model_dir: str, output_dir: str, overrides: list[str]) -> list[str]:
    return ["train", "--recipe", recipe, "--model", model_dir, "--output", output_dir, "--resume", *overrides]


# NeMo-Run (0.11) writes `export KEY=VALUE`, script arguments and srun flags into its sbatch script
# as they are: every value from the user or a recipe is quoted here (env values, arguments), or, where
# NeMo-Run builds the text itself (#SBATCH lines, srun flags), must be plain.
_PLAIN = re.compile(r"^[A-Za-z0-9_./:,+=@%~-]*$")
EXPANDED_ENV = ("MASTER_ADDR", "PATH")  # deliberately expanded on the head node: $head_node_ip, $PATH


def require_plain(what: str, value: str) -> str:
    if not _PLAIN.match(value):
        raise ValueError(f"{what} {value!r}: NeMo-Run writes it into the job script unquoted; use letters, digits and "
                         "_ . / : , + = @ % ~ - only")
    return value


def quoted_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v if k in EXPANDED_ENV else shlex.quote(str(v)) for k, v in env.items()}


def local_experiment(recipe: str, overrides: list[str] | None = None, output_dir: str = "", model_dir: str = ""):
    """An Experiment that runs the recipe on this machine: torchrun with TP x PP local ranks
    (gloo on CPU), the rollout engines started by the driver rank."""
    import nemo_run as run

    import spice_megatron
    from spice_megatron.data import offline_data
    from spice_megatron.data.offline_assets import smollm2_dir

    overrides = list(overrides or [])
    cfg = apply_overrides(get_recipe(recipe), overrides)
    cfg.run.output_dir = os.path.abspath(output_dir or cfg.run.output_dir)
    model_dir = model_dir or cfg.run.model or smollm2_dir()
    offline_data.prepare_for(cfg.corpus.sources)  # as `spice train` does before it starts ranks
    nproc = cfg.parallel.tensor_parallel * cfg.parallel.pipeline_parallel
    # NeMo-Run's local scheduler runs `torchrun` from PATH: use this environment's.
    bin_dir = os.path.dirname(sys.executable)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    executor = run.LocalExecutor(ntasks_per_node=nproc, launcher="torchrun",
                                 env_vars={"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"})
    cli_path = os.path.join(os.path.dirname(os.path.abspath(spice_megatron.__file__)), "cli", "__main__.py")
    script = run.Script(path=cli_path, args=_train_args(recipe, model_dir, cfg.run.output_dir, overrides),
                        entrypoint="python")
    exp = run.Experiment(f"spice_{recipe}", executor=executor)
    with exp:
        exp.add(script, name="spice")
    return exp


def slurm_experiment(recipe: str, *, account: str, partition: str | None, container_image: str | None,
                     model_dir: str, data_dir: str, mounts: list[str] | None = None, time: str = "24:00:00",
                     output_dir: str = "", overrides: list[str] | None = None, env: dict[str, str] | None = None,
                     retries: int = 3, job_dir: str = "", tunnel=None, packager=None, rollout_container_image: str = "",
                     group_wait_s: int = 30, group_monitor_s: int = 60, request_gpus: bool = True):
    """An Experiment with one Slurm job: rollout services on the rollout nodes, the learner on the
    learner nodes, as the recipe's `cluster` section splits them. `data_dir` (inside the container)
    holds the corpus staged by `spice prepare --recipe NAME`. The rollout group runs in
    `rollout_container_image` (the vLLM image; default: `container_image`). No `container_image`
    (None, "" or "none"): both groups run in the submitting environment's Python, from the code
    NeMo-Run packages into the job directory. `group_wait_s` / `group_monitor_s`: NeMo-Run's pause
    between starting the two groups and its wait after the first one ends (30 s / 60 s by default).
    `request_gpus=False`: nodes without GPUs to request (the tiny CPU recipe on a CPU cluster;
    cluster.gpus_per_node then counts engines and learner ranks per node)."""
    import nemo_run as run

    overrides = list(overrides or [])
    cfg: SpiceConfig = apply_overrides(get_recipe(recipe), overrides)
    learner_nodes, rollout_nodes = cfg.cluster.split()
    colocated = cfg.run.colocate
    if colocated:  # both groups on every node, the second beside the first (srun --overlap)
        learner_nodes = rollout_nodes = cfg.cluster.nodes
    elif rollout_nodes < 1:
        raise ValueError(f"cluster.nodes={cfg.cluster.nodes}: a Slurm run needs at least one rollout node")
    gpus = cfg.cluster.gpus_per_node
    etp = cfg.rollout.engine_tensor_parallel
    engine_nodes = max(1, etp // gpus)  # an engine wider than a node: a leader and followers (rollout_node.sh)
    if rollout_nodes % engine_nodes:
        raise ValueError(f"rollout.engine_tensor_parallel={etp}: each engine spans {engine_nodes} nodes of {gpus} "
                         f"GPUs, which {rollout_nodes} rollout node(s) do not divide into")
    trusted = (env or {}).get(TRUSTED_NETWORK_ENV) or os.environ.get(TRUSTED_NETWORK_ENV, "")
    if engine_nodes > 1 and trusted_network_refusal(trusted):
        raise ValueError(f"rollout.engine_tensor_parallel={etp}: {trusted_network_refusal(trusted)}")
    engine_model = cfg.rollout.model or model_dir
    check_engine_model(engine_model, "rollout.model" if cfg.rollout.model else "--model")  # where it is seen here
    if not output_dir:
        raise ValueError("--output: a Slurm run needs an output directory under one of the --mount destinations "
                         "(shared storage): checkpoints, metrics and hf_final are lost in the container otherwise")
    mounts = list(mounts or [])
    for what, value in (("--account", account), ("--partition", partition or ""), ("--time", time),
                        ("--container-image", container_image or ""),
                        ("--rollout-container-image", rollout_container_image or ""), ("--job-dir", job_dir or ""),
                        *(("--mount", m) for m in mounts)):
        require_plain(what, value)
    container_image = None if container_image in (None, "", "none") else container_image
    rollout_image = None if rollout_container_image in ("", "none") and container_image is None else (
        rollout_container_image or container_image)
    if colocated:  # vLLM's CUDA IPC runs in the learner's process too: one image for both roles
        rollout_image = container_image
    if container_image is not None:
        for flag, path in (("--output", output_dir), ("--data", data_dir), ("--model", model_dir)):
            require_mounted(flag, path, mounts)
    else:
        # without a container NeMo-Run rewrites every "/nemo_run" in its script to the job directory
        # (nemo_run/core/execution/slurm.py, RUNDIR_NAME): a path holding it would silently move
        for flag, path in (("--output", output_dir), ("--data", data_dir), ("--model", model_dir)):
            if "/nemo_run" in path:
                raise ValueError(f"{flag} {path!r}: without a container NeMo-Run rewrites '/nemo_run' in every path "
                                 "of its script to the job directory; use a path without it")
        # NeMo-Run's script runs `python` and `bash` from PATH on the nodes: this environment's first
        bin_dir = os.path.dirname(sys.executable)
        (env := dict(env or {})).setdefault("PATH", f"{shlex.quote(bin_dir)}:$PATH")
    shared = {"PYTHONPATH": CODE_DIR, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
              # NCCL_CUMEM_ENABLE stays NCCL's default (NVLS for the learner's collectives): no node holds
              # both a weight-sync sender and an engine (slurm/spice_job.sh); an `env` entry sets it for both
              "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", **(env or {})}
    setup = "\n".join([
        # NeMo-Run's script runs under `set -x`: the token must not be echoed into the job log
        "{ set +x; } 2>/dev/null",
        # a fresh secret per attempt, never one inherited from the submitting shell
        'export SPICE_ROLLOUT_TOKEN="$(od -An -N16 -tx1 /dev/urandom | tr -d \' \\n\')"',
        "set -x",
        # the engines' addresses as Slurm knows them (NodeAddr: a name or an IP)
        f'export SPICE_ROLLOUT_NODES="$(for n in $(scontrol show hostnames "$SLURM_JOB_NODELIST" | tail -n '
        f"+{1 if colocated else learner_nodes + 1}); do scontrol show node -o \"$n\" | grep -o 'NodeAddr=[^ ]*' | cut "
        "-d= -f2; done "
        f'| paste -sd, -)"',
        # the engines' model as the nodes see it: a quantized one is refused before any srun, with no retry
        f"if grep -Eq '\"quantization_config\"[[:space:]]*:[[:space:]]*[{{]' {shlex.quote(engine_model)}/config.json "
        "2>/dev/null; then echo \"spice: the engines' model is quantized: serve a bf16 copy (spice convert bf16); "
        "not starting\" >&2; exit 2; fi",
        f"export SPICE_ENGINES_PER_NODE={max(1, gpus // etp)} SPICE_ENGINE_NODES={engine_nodes} "
        f"SPICE_ROLLOUT_PORT={_port('SPICE_ROLLOUT_PORT', ROLLOUT_PORT)}",
    ])

    def executor(srun_args: list[str], extra_env: dict[str, str], image: str | None):
        return run.SlurmExecutor(
            account=account, partition=partition, nodes=cfg.cluster.nodes, ntasks_per_node=1,
            gpus_per_node=gpus if request_gpus else None,
            time=time, container_image=image, container_mounts=mounts if image else [],
            env_vars=quoted_env({**shared, **extra_env}), exclusive=True, mem="0", srun_args=srun_args,
                                 setup_lines=setup,
            retries=retries, tunnel=tunnel or run.LocalTunnel(job_dir=job_dir or _default_job_dir()),
            packager=packager or run.GitArchivePackager(), wait_time_for_group_job=group_wait_s,
            monitor_group_job_wait_time=group_monitor_s)

    # --ntasks on every srun: the job's SLURM_NTASKS (one task per node) is inherited by srun and
    # would override --ntasks-per-node (a learner on `nodes` GPUs instead of 8 per node).
    overlap = ["--overlap"] if colocated else []
    # colocated engines start asleep (the learner builds beside them) and sleep while it steps
    sleep_env = {"SPICE_SLEEP_MODE": "1", "SPICE_START_ASLEEP": "1"} if colocated else {}
    rollout = executor([f"--nodes={rollout_nodes}", f"--ntasks={rollout_nodes}", "--ntasks-per-node=1",
                        f"--relative={0 if colocated else learner_nodes}", *overlap],
                       {"SPICE_MODEL": cfg.rollout.model or model_dir,
                        "SPICE_ENGINE_TP": str(etp),
                        "SPICE_ENGINE_MASTER_PORT": str(_port("SPICE_ENGINE_MASTER_PORT", 29600)),
                        "SPICE_MAX_MODEL_LEN": str(cfg.rollout.max_model_len), "SPICE_GPUS_PER_NODE": str(gpus),
                        "SPICE_GPU_MEMORY_UTILIZATION": str(cfg.rollout.gpu_memory_utilization),
                        "SPICE_MAX_NUM_BATCHED_TOKENS": str(cfg.rollout.max_num_batched_tokens),
                        "SPICE_MAX_NUM_SEQS": str(cfg.rollout.max_num_seqs),
                        "SPICE_WEIGHT_TRANSFER": cfg.rollout.weight_transfer,
                        **({"SPICE_ENGINE_EXPERT_PARALLEL": "1"} if cfg.rollout.engine_expert_parallel else {}),
                        "SPICE_LOG_DIR": f"{output_dir}/logs", **sleep_env,
                        **({TRUSTED_NETWORK_ENV: trusted} if engine_nodes > 1 else {})}, rollout_image)
    # One task per GPU (srun, not torchrun): Megatron's init reads SLURM_PROCID / SLURM_NTASKS.
    learner = executor([f"--nodes={learner_nodes}", f"--ntasks={learner_nodes * gpus}", f"--ntasks-per-node={gpus}",
                        "--relative=0", *overlap],
                       {"MASTER_ADDR": "$head_node_ip", "MASTER_PORT": str(_port("SPICE_MASTER_PORT", 29500)),
                        "CUDA_DEVICE_MAX_CONNECTIONS": "1",
                        "SPICE_DATA_DIR": data_dir}, container_image)
    exp = run.Experiment(f"spice_{recipe}", executor=rollout)
    with exp:
        exp.add([run.Script(path="slurm/rollout_node.sh", entrypoint="bash"),
                 run.Script(path="spice_megatron/cli/__main__.py", entrypoint="python",
                            args=[shlex.quote(a) for a in _train_args(recipe, model_dir, output_dir, overrides)])],
                executor=[rollout, learner], name="spice")
    return exp


def _port(name: str, default: int) -> int:
    value = os.environ.get(name, str(default))
    if not value.isdigit() or not 0 < int(value) < 65536:
        raise ValueError(f"${name}={value!r} is not a port number")
    return int(value)


def require_mounted(flag: str, path: str, mounts: list[str]) -> None:
    """A pyxis container's own filesystem is private to its node and discarded with the job: what a
    run reads on every node or must keep (checkpoints, the staged corpus, the model) has to lie under
    a mount destination (src:dst[:flags])."""
    destinations = [m.split(":")[1] if ":" in m else m for m in mounts]
    inside = [d for d in destinations if os.path.normpath(path) == os.path.normpath(d)
              or os.path.normpath(path).startswith(os.path.normpath(d).rstrip("/") + "/")]
    if not os.path.isabs(path) or not inside:
        raise ValueError(f"{flag} {path!r} is not under a --mount destination ({', '.join(destinations) or 'none'}): "
                         "on Slurm it must be on shared storage mounted into the container, "
                         "e.g. --mount /lustre/results:/results with --output /results/NAME")


def completed_iterations(output_dir: str) -> int:
    from spice_megatron.policy.checkpoint import read_trainer_state
    from spice_megatron.policy.checkpoint_files import latest_checkpoint

    latest = latest_checkpoint(os.path.join(output_dir, "checkpoints"))
    return int(read_trainer_state(latest).get("iteration", 0)) if latest else 0


def _default_job_dir() -> str:
    """Where NeMo-Run writes an experiment's sbatch script, and so where sbatch must read it: its
    own default ($NEMORUN_HOME/experiments, nemo_run/core/tunnel/client.py). A LocalTunnel given
    another directory makes sbatch look for a script that was never written there."""
    from nemo_run.config import get_nemorun_home

    return os.path.join(get_nemorun_home(), "experiments")


def wait_for_job(job_id: str, poll_s: float = 5.0, timeout_s: float | None = None) -> str:
    """Poll until Slurm job `job_id` has left the queue; its final state from `scontrol show job`
    (Slurm keeps it MinJobAge seconds). squeue/scontrol, not sacct: NeMo-Run's status calls use
    sacct, which a cluster without accounting storage refuses."""
    import subprocess
    import time

    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        queued = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True)
        states = queued.stdout.split()
        if queued.returncode == 0 and states and not set(states) <= {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}:
            if deadline is not None and time.monotonic() > deadline:
                return "RUNNING"
            time.sleep(poll_s)
            continue
        shown = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True).stdout
        state = next((w.split("=", 1)[1] for w in shown.split() if w.startswith("JobState=")), "")
        if state in ("PENDING", "RUNNING", "REQUEUED", "CONFIGURING", "COMPLETING"):  # a requeue between polls
            time.sleep(poll_s)
            continue
        return state or "UNKNOWN"


def submitted_job_id(exp) -> str:
    """The Slurm job id of a submitted experiment (its handle ends with it)."""
    return str(exp.jobs[0].handle).rstrip("/").split("/")[-1]


def dryrun_sbatch(exp) -> str:
    """The sbatch script NeMo-Run would submit, without submitting it."""
    exp.dryrun(log=False, delete_exp_dir=False)
    files = sorted(glob.glob(os.path.join(exp._exp_dir, "*_sbatch.sh")))
    if not files:
        raise RuntimeError(f"NeMo-Run wrote no sbatch script under {exp._exp_dir}")
    with open(files[-1]) as f:
        return f.read()


def main(argv: list[str] | None = None) -> int:
    from recipes import recipe_names
    from spice_megatron.entry import ArgumentParser

    ap = ArgumentParser(prog="spice launch", description="Launch a recipe's SPICE run with NeMo-Run: torchrun on "
                        "this machine (--executor local) or a Slurm job of learner and engine nodes "
                        "(--executor slurm).")
    ap.add_argument("--recipe", required=True, help="one of: " + ", ".join(recipe_names()))
    ap.add_argument("--executor", choices=["local", "slurm"], default="local")
    ap.add_argument("--output", "--output-dir", dest="output_dir", metavar="OUTPUT", default="",
                    help="the run directory (default: the recipe's run.output_dir)")
    ap.add_argument("--model", "--model-dir", dest="model_dir", metavar="MODEL", default="",
                    help="HF directory of the base model (inside the container on Slurm)")
    ap.add_argument("--account")
    ap.add_argument("--partition")
    ap.add_argument("--container-image", default="", help="the learner's image (NGC PyTorch + megatron-core + "
                    "TE/apex); none or unset: no container, this environment's Python on the nodes")
    ap.add_argument("--rollout-container-image", default="",
                    help="the engines' image (vLLM); default: --container-image")
    ap.add_argument("--data", "--data-dir", dest="data_dir", metavar="DATA", default="",
                    help="directory with the staged corpus, inside the container (Slurm; "
                    "stage it first with `spice prepare --recipe NAME`)")
    ap.add_argument("--mount", action="append", default=[], help="container mount src:dst (repeatable)")
    ap.add_argument("--time", default="24:00:00")
    ap.add_argument("--retries", type=int, default=3, help="requeues after a failure (Slurm)")
    ap.add_argument("--dryrun", action="store_true", help="print the sbatch script instead of submitting (Slurm)")
    ap.add_argument("--wait", action="store_true", help="after submitting, wait until the job ends; exit 0 if it "
                    "COMPLETED (polls squeue and scontrol: no accounting storage needed)")
    ap.add_argument("--cpu-only", action="store_true", help="nodes without GPUs to request (the tiny CPU recipe)")
    ap.add_argument("--group-wait", type=int, default=30, help="seconds NeMo-Run waits between starting the rollout "
                    "and learner groups (and, doubled, after the first one ends)")
    ap.add_argument("overrides", nargs="*", help="config overrides key=value")
    args = ap.parse_args(argv)
    if args.executor == "local":
        from spice_megatron.run.lock import check_unlocked

        exp = local_experiment(args.recipe, args.overrides, args.output_dir, args.model_dir)
        cfg = apply_overrides(get_recipe(args.recipe), args.overrides)
        check_unlocked(os.path.abspath(args.output_dir or cfg.run.output_dir))  # the run would refuse too, later
        with exp:
            exp.run(sequential=True, tail_logs=True)
        # NeMo-Run does not track local task states; the run's last checkpoint says how far it got.
        done = completed_iterations(os.path.abspath(args.output_dir or cfg.run.output_dir))
        print(f"spice run through NeMo-Run: {done} of {cfg.run.iterations} iterations completed")
        return 0 if done >= cfg.run.iterations else 1
    missing = [n for n in ("account", "model_dir", "data_dir", "output_dir") if not getattr(args, n)]
    if missing:
        ap.error("--executor slurm needs " + ", ".join("--" + m.split("_")[0] for m in missing))
    try:
        exp = slurm_experiment(args.recipe, account=args.account, partition=args.partition,
                               container_image=args.container_image, model_dir=args.model_dir, data_dir=args.data_dir,
                               rollout_container_image=args.rollout_container_image, mounts=args.mount, time=args.time,
                               output_dir=args.output_dir, overrides=args.overrides, retries=args.retries,
                               group_wait_s=args.group_wait, group_monitor_s=2 * args.group_wait,
                               request_gpus=not args.cpu_only)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.dryrun:
        print(dryrun_sbatch(exp))
        return 0
    with exp:
        exp.run(detach=True)
        job_id = submitted_job_id(exp)
    print(f"spice: submitted Slurm job {job_id}")
    if not args.wait:
        return 0
    state = wait_for_job(job_id)
    print(f"spice: Slurm job {job_id} {state}")
    return 0 if state == "COMPLETED" else 1


if __name__ == "__main__":
    from spice_megatron.entry import run_entry_point

    run_entry_point(main)
