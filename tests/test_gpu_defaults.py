"""vLLM picks defaults by device and by entry point, and the suite otherwise only ever sees the
CPU's. These tests build every vLLM engine config the project creates (the launchers' own argv,
through the project's own entry points) under vLLM's CUDA platform with an H100 80 GB and an H200
141 GB simulated (tests/gpu_defaults_probe.py: the platform's device queries patched, nothing
started), and assert what the project relies on there."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]
NODES = "10.0.0.1,10.0.0.2"


def _rollout_node_argv(tmp_path, model: str, node: int, **env) -> list[str]:
    """The argv slurm/rollout_node.sh gives its engine on rollout node `node` (a stand-in `python`
    on PATH records it and exits; the script, allowed no restart, then stops)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    stub = bin_dir / "python"
    stub.write_text('#!/bin/sh\nprintf "%s\\n" "$@" > "$ARGV_OUT"\n')
    stub.chmod(0o755)
    out = tmp_path / f"argv_{node}_{os.path.basename(model)}"
    subprocess.run(["bash", os.path.join(ROOT, "slurm/rollout_node.sh")], check=False, timeout=60,
                   capture_output=True,
                   env={"PATH": f"{bin_dir}:{os.environ['PATH']}", "ARGV_OUT": str(out), "SPICE_MODEL": model,
                        "SPICE_ROLLOUT_TOKEN": "t" * 32, "SPICE_ROLLOUT_NODES": NODES, "SLURM_NODEID": str(node),
                        "SPICE_ENGINE_TP": "4", "SPICE_GPUS_PER_NODE": "2", "SPICE_MAX_MODEL_LEN": "2048",
                        "SPICE_ENGINE_RESTARTS": "0", "SPICE_LOG_DIR": str(tmp_path / "logs"),
                        "SPICE_TRUSTED_NETWORK": "1", **env})
    argv = out.read_text().splitlines()
    assert argv[0] == "-m" and argv[1] == ("spice_megatron.rollout.serve" if node == 0 else
                                           "spice_megatron.rollout.follower"), argv
    return argv[2:]


@pytest.fixture(scope="module")
def engine_configs(module_dir):
    """Per simulated device, each engine the project creates: {name: [vLLM config of node 0, node 1...]}."""
    from spice_megatron.data.offline_assets import make_tiny_engine_model
    from spice_megatron.rollout.local import engine_args

    dense = make_tiny_engine_model(str(module_dir / "qwen3"), "qwen3")
    moe = make_tiny_engine_model(str(module_dir / "deepseek_v3"), "deepseek_v3")
    local = ["--model", dense, "--port", "8100", *engine_args(2048, 1.0, 7, on_gpu=True, gpu_memory_utilization=0.8)]
    engines = {  # name: [(role, argv)], node 0 first
        "across nodes (rollout_node.sh)": [("leader", _rollout_node_argv(module_dir, dense, 0)),
                                           ("follower", _rollout_node_argv(module_dir, dense, 1))],
        "deepseek_v3 across nodes, experts parallel": [
            ("leader", _rollout_node_argv(module_dir, moe, 0, SPICE_ENGINE_EXPERT_PARALLEL="1")),
            ("follower", _rollout_node_argv(module_dir, moe, 1, SPICE_ENGINE_EXPERT_PARALLEL="1"))],
        "local (the trainer's)": [("leader", local)],
        "local colocated": [("leader", [*local, "--enable-sleep-mode"])],
        "evaluation (local_fleet)": [("leader", ["--model", dense, *engine_args(2048, 1.0, 0, on_gpu=True)])],
    }
    jobs, names = [], []
    for name, nodes in engines.items():
        for i, (role, argv) in enumerate(nodes):
            path = module_dir / f"job_{len(jobs)}.json"
            path.write_text(json.dumps(argv))
            jobs.append(f"{role}:{path}")
            names.append(name)
    found = {}
    for device in ("h100", "h200"):
        run = subprocess.run([sys.executable, os.path.join(ROOT, "tests/gpu_defaults_probe.py"), device, *jobs],
                             capture_output=True, text=True, timeout=600, cwd=ROOT)
        line = [ln for ln in run.stdout.splitlines() if ln.startswith("GPU-DEFAULTS ")]
        assert run.returncode == 0 and line, run.stderr[-3000:]
        configs = json.loads(line[0].split(" ", 1)[1])
        found[device] = {}
        for name, config in zip(names, configs):
            found[device].setdefault(name, []).append(config)
    return found


DEVICES = ("h100", "h200")


@pytest.mark.parametrize("device", DEVICES)
def test_every_node_of_an_engine_builds_the_same_step_cache_and_parallel_settings(engine_configs, device):
    """On a GPU of >= 70
    GiB that is not an A100, max_num_batched_tokens defaults to 16384 for UsageContext.LLM_CLASS (the
    leader's `vllm.LLM`) and 8192 for OPENAI_API_SERVER (a follower's create_engine_config, as `vllm
    serve --headless`); _set_default_max_num_seqs_and_batched_tokens_args applies it whenever the
    engine arguments leave it unset. Each node's workers size their input buffers from their own
    value (vllm/v1/worker/gpu_model_runner.py), so every setting must agree across nodes."""
    for name, nodes in engine_configs[device].items():
        leader, *followers = nodes
        for follower in followers:
            differ = {k: (leader[k], follower[k]) for k in leader
                      if k not in ("role", "usage_context", "node_rank") and leader[k] != follower[k]}
            assert not differ, f"{name} on {device}: leader and follower differ in {differ}"
        assert [n["node_rank"] for n in nodes] == list(range(len(nodes))), name


@pytest.mark.parametrize("device", DEVICES)
def test_the_step_is_pinned_not_left_to_vllms_device_defaults(engine_configs, device):
    """rollout/step_settings.py pins what get_batch_defaults would choose by device and entry point
    (vllm/engine/arg_utils.py), and chunked prefill, which _set_default_chunked_prefill_and_prefix_caching_args
    turns on where the model supports it: the same figures on an H100 and an H200 (a B200's >= 160 GiB
    default would be 16384 for both entry points, an A100's 8192 and 2048)."""
    from spice_megatron.rollout.step_settings import GPU_MAX_SEQS, GPU_STEP_TOKENS

    for name, nodes in engine_configs[device].items():
        for node in nodes:
            assert (node["max_num_batched_tokens"], node["max_num_seqs"], node["enable_chunked_prefill"]) == (
                GPU_STEP_TOKENS, GPU_MAX_SEQS, True), f"{name}, node {node['node_rank']} on {device}"
            assert node["max_model_len"] == 2048 and node["dtype"] == "torch.bfloat16", name


@pytest.mark.parametrize("device", DEVICES)
def test_the_kv_cache_budget_is_the_share_the_planner_assumes_and_colocated_engines_can_sleep(engine_configs, device):
    """The planner sizes an engine's KV cache as rollout.gpu_memory_utilization of each GPU less the
    weights (plan_memory.engine_memory); vLLM does the same only when no kv_cache_memory_bytes is given
    (vllm/config/cache.py: it overrides the utilization), which the project sets on the CPU alone.
    Sleep mode (vllm/config/model.py enable_sleep_mode, default off) where the engine shares the
    learner's GPUs, and nowhere else."""
    configs = engine_configs[device]
    for name, nodes in configs.items():
        want = 0.8 if name.startswith("local") else 0.85
        for node in nodes:
            assert node["kv_cache_memory_bytes"] is None and node["gpu_memory_utilization"] == want, name
            assert node["enable_sleep_mode"] == (name == "local colocated"), name
    # routing replay on a MoE engine: vLLM's routed-experts capture needs Model Runner V2 (the GPU default)
    assert all(n["model_runner_v2"] and n["enable_expert_parallel"]
               for n in configs["deepseek_v3 across nodes, experts parallel"])
