"""tools/checks/gpu_check.py: the prepared bf16 GPU checks. On CPU its smoke mode runs every check that
does not need a GPU, so the script cannot rot between the rare runs on a lent GPU machine."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args):
    return subprocess.run([sys.executable, os.path.join(ROOT, "tools", "checks", "gpu_check.py"), *args],
                          capture_output=True, text=True, timeout=480,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "")}
                          if "--allow-cpu" in args else None)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_gpu_check_smoke_on_cpu():
    r = _run("--allow-cpu")
    lines = [x for x in r.stdout.splitlines() if x.startswith("gpu_check ") and not x.startswith("gpu_check scope:")]
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert "gpu_check scope: 0 GPU(s) here; needs 4 GPUs: receive_order_nccl" in r.stdout  # what one GPU cannot show
    verdicts = {x.split(":")[0].split()[1]: x.split(":", 1)[1].split()[0] for x in lines[1:-1]}
    passed = {"versions_and_checksums", "bf16_hf_load_then_step", "logprobs_gpu_vs_cpu", "bf16_checkpoint_resume",
              "moe_bf16_hf_load_then_step", "moe_logprobs_gpu_vs_cpu", "weight_sync_gloo_to_cpu_receiver",
              "activation_memory_vs_planner", "concurrent_receive", "moe_routing_replay_round_trip",
              "shared_prefix_vs_unshared", "long_prefix_row_pad_to_128", "cp_attention_without_te", "fp8_engine_guard",
              "receive_order_nccl", "engine_step_leader_vs_follower"}
    gpu_only = {"stream_handover", "weight_sync_nccl", "weight_sync_nccl_one_rank", "vocab_parallel_logprob_peak",
                "allocator_fragmentation", "moe_vllm_routed_experts", "colocation_sleep_wake_ipc",
                "optimizer_offload_round_trip", "ipc_leg_learner_allocator", "te_context_parallel"}
    assert verdicts == {**{k: "PASS" for k in passed}, **{k: "SKIP" for k in gpu_only}}


@pytest.mark.multiprocess
@pytest.mark.slow
def test_gpu_check_script_installs_into_a_target_folder_not_a_venv(tmp_path):
    """The lent machine's python3 is itself a venv holding torch: the script runs that interpreter
    (no nested venv, which would lose torch) and installs only what it lacks with pip --target onto
    PYTHONPATH. Here this venv lacks nothing, so the target folder stays empty and the smoke run goes
    through the script the way the lent machine runs it."""
    env = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_SITE": str(tmp_path / "site"), "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run(["bash", os.path.join(ROOT, "tools", "gpu_check.sh"), "--allow-cpu", str(tmp_path / "wheels")],
                       capture_output=True, text=True, timeout=540, env=env)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert "gpu_check env: torch" in r.stdout and "megatron-core 0.16.1" in r.stdout
    assert not (tmp_path / "site").exists()  # nothing was missing: nothing installed, no venv made
    assert "gpu_check done: all passed" in r.stdout


@pytest.mark.gpu
def test_gpu_check_on_gpu():
    r = _run()
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
