"""The DeepSeek-V3 family (multi-head latent attention, sigmoid group-limited routing with a
correction bias, shared experts, dense first layers, YaRN) and GLM-4.5 (the same routing, with
biased q/k/v, q/k norms and partial rotary) on tiny random models: megatron against transformers,
the bridge's round trip at expert parallel layouts, FP8 checkpoints, and what the loader refuses."""
import pytest
from dist_utils import run_ranks
from test_moe import _logits_rank, _roundtrip_rank

from spice_megatron.data.offline_assets import make_tiny_hf_model, tiny_hf_config


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory):
    return make_tiny_hf_model(str(tmp_path_factory.mktemp("tiny_deepseek") / "ds"), tiny_hf_config("deepseek_v3"),
                              seed=3)


def test_the_spec_reads_latent_attention_routing_and_yarn():
    from spice_megatron.families import model_spec_from_hf

    spec = model_spec_from_hf(tiny_hf_config("deepseek_v3", num_layers=3))
    assert spec.family.mla and spec.mla.q_lora_rank == 48 and spec.mla.kv_lora_rank == 32
    assert spec.head_dim == 16 + 8 and spec.num_kv_heads == spec.num_heads
    moe = spec.moe
    assert moe.moe_layers == (False, True, True) and moe.score_function == "sigmoid" and moe.expert_bias
    assert (moe.num_groups, moe.group_topk, moe.scaling_factor, moe.shared_expert_ffn_hidden_size) == (2, 1, 2.5, 32)
    assert spec.yarn.factor == 4.0 and spec.yarn.mscale_all_dim == 1.0


def test_what_the_loader_refuses_names_the_field():
    from spice_megatron.families import UnsupportedModelError, model_spec_from_hf

    base = tiny_hf_config("deepseek_v3")
    for change, field in (({"scoring_func": "softmax"}, "scoring_func='softmax'"),
                          ({"topk_method": "greedy"}, "topk_method='greedy'"),
                          ({"norm_topk_prob": False}, "norm_topk_prob=false"),
                          ({"num_experts_per_tok": 4}, "num_experts_per_tok=4 over topk_group=1"),
                          ({"rope_interleave": False}, "rope_interleave=false"),
                          ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "rope_type='longrope'")):
        with pytest.raises(UnsupportedModelError, match=field):
            model_spec_from_hf({**base, **change})
    # YaRN exists in megatron's latent attention only
    with pytest.raises(UnsupportedModelError, match="rope_type='yarn' is not supported \\(default, llama3\\)"):
        model_spec_from_hf({**tiny_hf_config("qwen2"), "rope_scaling": base["rope_scaling"]})


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_logits_match_transformers_and_round_trip_at_ep2_etp2_pp2(family, deepseek_dir, tmp_path):
    model = deepseek_dir if family == "deepseek_v3" else make_tiny_hf_model(str(tmp_path / "glm"),
                                                                             tiny_hf_config("glm4_moe"), seed=4)
    layouts = [(1, 1, 1, 1), (1, 1, 2, 1), (2, 1, 2, 1), (1, 1, 1, 2), (1, 2, 1, 1)]
    logits = {k: v for r in run_ranks(_logits_rank, 2, model, layouts, tmp_path=tmp_path) for k, v in r.items()}
    assert logits.keys() == set(layouts) and max(logits.values()) < 1e-4, logits
    trips = {k: v for r in run_ranks(_roundtrip_rank, 2, model, layouts[1:], tmp_path=tmp_path)
             for k, v in r.items()}
    # every tensor, the routers' correction biases included, comes back bit for bit
    assert trips.keys() == set(layouts[1:]) and all(v == ([], []) for v in trips.values()), trips


def _fp8_copy(src: str, dst: str, block: int = 16) -> dict:
    """DeepSeek-V3's published format from a tiny model: the layers' linear weights in e4m3 with one
    fp32 scale per block x block (weight_scale_inv), a multi-token-prediction layer beyond
    num_hidden_layers; returns what the import must produce (bf16 dequantized weights)."""
    import json
    import os
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    weights = load_file(os.path.join(src, "model.safetensors"))
    out, expected = {}, {}
    for name, w in weights.items():
        if w.dim() == 2 and name.startswith("model.layers.") and not name.endswith("gate.weight"):
            rows, cols = w.shape  # a last partial block, as V3's 576-row kv_a_proj_with_mqa has
            r, c = -(-rows // block), -(-cols // block)
            padded = torch.zeros(r * block, c * block)
            padded[:rows, :cols] = w
            blocks = padded.view(r, block, c, block)
            scale = blocks.abs().amax(dim=(1, 3)) / 448.0
            full_scale = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[:rows, :cols]
            w8 = (w / full_scale).to(torch.float8_e4m3fn)
            out[name], out[name + "_scale_inv"] = w8, scale.float()
            expected[name] = (w8.float() * full_scale).to(torch.bfloat16)
        else:
            out[name] = expected[name] = w
    layers = json.load(open(os.path.join(src, "config.json")))["num_hidden_layers"]
    out[f"model.layers.{layers}.eh_proj.weight"] = torch.zeros(64, 128)  # multi-token prediction: skipped
    save_file(out, os.path.join(dst, "model.safetensors"))
    config = json.load(open(os.path.join(dst, "config.json")))
    config.update(quantization_config={"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                       "weight_block_size": [block, block]}, num_nextn_predict_layers=1)
    json.dump(config, open(os.path.join(dst, "config.json"), "w"))
    return expected


def _convert_fp8_rank(hf_dir, ckpt, out):
    from spice_megatron.bridge.convert import convert_from_hf, convert_to_hf

    convert_from_hf(hf_dir, ckpt, 2, 1)  # TP=2: each rank dequantizes its own rows and columns of the blocks
    convert_to_hf(ckpt, out, 2, 1)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_an_fp8_block_scaled_checkpoint_converts_dequantized_without_its_mtp_layers(deepseek_dir, tmp_path):
    import json

    import torch
    from test_bridge import hf_weights

    fp8 = str(tmp_path / "fp8")
    expected = _fp8_copy(deepseek_dir, fp8)
    out = str(tmp_path / "hf")
    run_ranks(_convert_fp8_rank, 2, fp8, str(tmp_path / "ckpt"), out, tmp_path=tmp_path)
    exported = hf_weights(out)
    assert exported.keys() == expected.keys()  # no scales, no multi-token-prediction layer
    wrong = [k for k in expected if not torch.equal(exported[k], expected[k].to(exported[k].dtype))]
    assert not wrong, wrong
    assert any(v.dtype == torch.bfloat16 for v in expected.values())
    config = json.load(open(f"{out}/config.json"))
    assert "quantization_config" not in config and config["num_nextn_predict_layers"] == 0


def test_the_bf16_copy_for_the_engines_holds_the_learners_dequantized_weights(deepseek_dir, tmp_path):
    """Engines that load an FP8 directory hold float8 parameters that the bf16
    weight sync is cast into with stale scales (served weights ~5,000x too small). They serve
    `spice convert bf16`'s copy instead, and an engine directory still quantized is refused."""
    import json
    import subprocess
    import sys

    import torch
    from test_bridge import hf_weights

    from spice_megatron.bridge.dequantize import QuantizedEngineModel, check_engine_model

    fp8, bf16 = str(tmp_path / "fp8"), str(tmp_path / "bf16")
    expected = _fp8_copy(deepseek_dir, fp8)
    with pytest.raises(QuantizedEngineModel, match=f"rollout.model={fp8}: .*quantized \\(fp8\\).*spice convert bf16"):
        check_engine_model(fp8)
    r = subprocess.run([sys.executable, "-m", "spice_megatron.cli", "convert", "bf16", "--model", fp8, "--output",
                        bf16],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "dequantized" in r.stdout and f"rollout.model={bf16}" in r.stdout
    copy = hf_weights(bf16)
    mtp = [k for k in copy if k not in expected]
    assert len(mtp) == 1 and "eh_proj" in mtp[0]  # vLLM skips multi-token-prediction layers itself
    assert not [k for k in copy if k.endswith("_scale_inv")]
    wrong = [k for k in expected if not torch.equal(copy[k], expected[k])]  # what the learner's import gives
    assert not wrong and any(v.dtype == torch.bfloat16 for v in copy.values()), wrong
    config = json.load(open(f"{bf16}/config.json"))
    assert "quantization_config" not in config and config.get("dtype", config.get("torch_dtype")) == "bfloat16"
    check_engine_model(bf16)
    # a second copy onto a written directory is refused; nothing of the source is touched
    r = subprocess.run([sys.executable, "-m", "spice_megatron.cli", "convert", "bf16", "--model", fp8, "--output",
                        bf16],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and f"--output {bf16}" in r.stderr.strip().splitlines()[-1]


def test_another_quantization_is_refused_before_any_rank_starts():
    from spice_megatron.families import UnsupportedModelError, model_spec_from_hf

    with pytest.raises(UnsupportedModelError, match="quant_method='awq'.*not supported \\(fp8 e4m3 with block scales"):
        model_spec_from_hf({**tiny_hf_config("deepseek_v3"), "quantization_config": {"quant_method": "awq"}})


def test_the_bf16_copy_writes_only_a_fresh_directory_of_its_own_and_removes_nothing_it_did_not_make(
        deepseek_dir, tmp_path):
    """`spice convert bf16` wrote into an existing empty
    directory (or a link) another user owned, who then rewrote what the engines serve, and deleted
    OUTPUT.partial unasked. Now: any existing output or link refused, an output under a directory
    another user could change refused, the copy written in a directory of its own and renamed in."""
    import os

    from spice_megatron.bridge.dequantize import write_bf16_copy
    from spice_megatron.bridge.hf_io import CheckpointError
    from spice_megatron.cli import main

    fp8 = str(tmp_path / "fp8")
    _fp8_copy(deepseek_dir, fp8)
    empty = tmp_path / "someone_elses"
    empty.mkdir()
    link = tmp_path / "a_link"
    link.symlink_to(tmp_path / "elsewhere")
    for out in (empty, link):
        with pytest.raises(CheckpointError, match=f"--output {out}: already exists"):
            write_bf16_copy(fp8, str(out))
    notes = tmp_path / "mine.partial"
    notes.mkdir()
    (notes / "notes.txt").write_text("mine")
    write_bf16_copy(fp8, str(tmp_path / "mine"), progress=lambda line: None)
    assert (notes / "notes.txt").read_text() == "mine" and os.path.isfile(tmp_path / "mine" / "config.json")
    assert sorted(p.name for p in tmp_path.iterdir() if ".partial" in p.name) == ["mine.partial"]
    shared = tmp_path / "shared_models"
    shared.mkdir(mode=0o777)
    os.chmod(shared, 0o777)  # writable by everyone, not sticky: another user could swap the copy
    assert main(["convert", "bf16", "--model", fp8, "--output", str(shared / "copy")]) == 2
    assert not os.path.exists(shared / "copy")
