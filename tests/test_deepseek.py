"""The DeepSeek-V3 family (multi-head latent attention, sigmoid group-limited routing with a
correction bias, shared experts, dense first layers, YaRN) on tiny random models: megatron against
transformers, the bridge's round trip at expert parallel layouts, and what the loader refuses."""
import pytest

from dist_utils import run_ranks
from spice_megatron.offline_assets import make_tiny_hf_model, tiny_hf_config
from test_moe import _logits_rank, _roundtrip_rank


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory):
    return make_tiny_hf_model(str(tmp_path_factory.mktemp("tiny_deepseek") / "ds"), tiny_hf_config("deepseek_v3"),
                              seed=3)


def test_the_spec_reads_latent_attention_routing_and_yarn():
    from spice_megatron.policy.model import model_spec_from_hf

    spec = model_spec_from_hf(tiny_hf_config("deepseek_v3", num_layers=3))
    assert spec.family.mla and spec.mla.q_lora_rank == 48 and spec.mla.kv_lora_rank == 32
    assert spec.head_dim == 16 + 8 and spec.num_kv_heads == spec.num_heads
    moe = spec.moe
    assert moe.moe_layers == (False, True, True) and moe.score_function == "sigmoid" and moe.expert_bias
    assert (moe.num_groups, moe.group_topk, moe.scaling_factor, moe.shared_expert_ffn_hidden_size) == (2, 1, 2.5, 32)
    assert spec.yarn.factor == 4.0 and spec.yarn.mscale_all_dim == 1.0


def test_what_the_loader_refuses_names_the_field():
    from spice_megatron.policy.model import UnsupportedModelError, model_spec_from_hf

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
def test_deepseek_logits_match_transformers_and_round_trip_at_ep2_etp2_pp2(deepseek_dir, tmp_path):
    layouts = [(1, 1, 1, 1), (1, 1, 2, 1), (2, 1, 2, 1), (1, 1, 1, 2), (1, 2, 1, 1)]
    logits = {k: v for r in run_ranks(_logits_rank, 2, deepseek_dir, layouts, tmp_path=tmp_path) for k, v in r.items()}
    assert logits.keys() == set(layouts) and max(logits.values()) < 1e-4, logits
    trips = {k: v for r in run_ranks(_roundtrip_rank, 2, deepseek_dir, layouts[1:], tmp_path=tmp_path)
             for k, v in r.items()}
    # every tensor, the routers' correction biases included, comes back bit for bit
    assert trips.keys() == set(layouts[1:]) and all(v == ([], []) for v in trips.values()), trips
