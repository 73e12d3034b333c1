"""Context parallelism (policy/context_parallel.py): the same log-probs, step, checkpoint and HF
export as one rank per sequence (gloo, CPU)."""
import pytest
import torch
from dist_utils import run_ranks
from learner_checks import assert_same_as_one_rank, assert_same_moe_step, replayed_moe_step, step_checkpoint_resume

from spice_megatron.config import ConfigError, ParallelConfig, PolicyTrainConfig
from spice_megatron.data.offline_assets import make_tiny_hf_model, tiny_hf_config
from spice_megatron.policy.batching import TrainSequence, collate
from spice_megatron.policy.context_parallel import rank_micro_batch, rank_positions


def batch(flip: bool = False) -> list[TrainSequence]:
    g = torch.Generator().manual_seed(7)
    seqs = []
    for i, (p, c) in enumerate([(5, 9), (3, 4), (6, 7), (2, 11)]):
        ids = torch.randint(0, 256, (p + c,), generator=g).tolist()
        adv = [0.8, -0.5, 0.3, -0.6][i]
        seqs.append(TrainSequence(ids[:p], ids[p:], advantage=-adv if flip else adv))
    return seqs


def test_each_rank_holds_an_early_and_a_late_chunk_and_the_ranks_cover_the_sequence():
    assert rank_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert rank_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert sorted(torch.cat([rank_positions(12, 3, r) for r in range(3)]).tolist()) == list(range(12))
    with pytest.raises(ValueError, match="divisible by 4, got 10"):
        rank_positions(10, 2, 0)
    mb = collate(batch(), [0, 1, 2, 3], pad_to=4)
    part = rank_micro_batch(mb, 2, 1)
    keep = rank_positions(mb.tokens.shape[1], 2, 1)
    assert torch.equal(part.tokens, mb.tokens[:, keep]) and torch.equal(part.loss_mask, mb.loss_mask[:, keep])
    assert torch.equal(part.advantages, mb.advantages) and part.index == mb.index


@pytest.mark.multiprocess
@pytest.mark.slow
def test_the_attention_over_gathered_keys_is_the_causal_mask_without_one(monkeypatch):
    """With a boolean [s/CP, s] mask and grouped K/V heads, a GPU without TE
    ran SDPA's math kernel (it keeps the probabilities). Two lower-right causal calls over the
    keys sorted by position give the same values and pass no explicit mask (flash-eligible)."""
    import torch.nn.functional as F
    from torch.nn.attention.bias import CausalBias

    from spice_megatron.policy.context_parallel import causal_attention_over_gathered_keys

    masks, dispatch = [], CausalBias._dispatch

    def recorded(query, key, value, attn_mask, *args, **kwargs):  # torch's route for a causal bias, no mask tensor
        masks.append(attn_mask)
        return dispatch(query, key, value, attn_mask, *args, **kwargs)

    monkeypatch.setattr(CausalBias, "_dispatch", staticmethod(recorded))
    torch.manual_seed(0)
    b, hq, hkv, d, seq = 2, 8, 2, 16, 64
    for cp in (2, 4):
        for r in range(cp):
            q = torch.randn(b, hq, seq // cp, d, dtype=torch.float64)
            k, v = torch.randn(2, b, hkv, seq, d, dtype=torch.float64)  # keys in all-gather order
            key_pos = torch.cat([rank_positions(seq, cp, i) for i in range(cp)])
            visible = key_pos.unsqueeze(0) <= rank_positions(seq, cp, r).unsqueeze(1)
            ref = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, enable_gqa=True)  # the mask form
            got = causal_attention_over_gathered_keys(q, k, v, cp, r, None, 0.0, True)
            assert (got - ref).abs().max() < 1e-12, (cp, r)
    assert len(masks) == 2 * 6  # two calls per rank, each with a causal bias


def test_context_parallel_steps_exactly_as_one_rank_and_its_checkpoint_resumes_at_another_layout(tmp_path):
    """CP=2 (and TP=2 x CP=2 with sequence parallelism): the old-log-prob pass, a step's loss, grad
    norm and weights equal one rank's; a checkpoint saved at CP=2 resumes at CP=1 x DP=2 (and the
    TP2 x CP2 one at TP=2 x DP=2) with the same next step."""
    model = make_tiny_hf_model(str(tmp_path / "m"), tiny_hf_config("qwen3", num_layers=2), seed=3)
    train = {"max_gen_len": 12, "micro_batch_tokens": 40}
    (ref,) = run_ranks(step_checkpoint_resume, 1, model, {}, str(tmp_path / "c1"), {}, train, batch, tmp_path=tmp_path)
    cp2 = run_ranks(step_checkpoint_resume, 2, model, {"context_parallel": 2}, str(tmp_path / "c2"), {}, train, batch,
                    tmp_path=tmp_path)
    tp_cp = run_ranks(step_checkpoint_resume, 4, model, {"tensor_parallel": 2, "context_parallel": 2},
                      str(tmp_path / "c4"), {"tensor_parallel": 2}, train, batch, tmp_path=tmp_path)
    for ranks in (cp2, tp_cp):
        assert ranks[0]["layout"].cp == 2 and not ranks[0]["shared_prefix"]  # auto is off under CP
        for r in ranks:  # every rank has every sequence's log-probs
            assert max(abs(x - y) for a, b in zip(r["logprobs"], ref["logprobs"]) for x, y in zip(a, b)) < 1e-5
        assert_same_as_one_rank(ranks[0], ref)


def test_context_parallelism_refuses_shared_prefix_rows_with_one_line(tmp_path):
    from spice_megatron.families import model_spec_from_hf
    from spice_megatron.policy.model import build_policy_model
    from spice_megatron.policy.parallel import Layout

    spec = model_spec_from_hf(tiny_hf_config("qwen3", num_layers=2))
    layout = Layout(rank=0, world_size=2, tp=1, pp=1, dp=1, tp_rank=0, pp_rank=0, dp_rank=0, cp=2)
    with pytest.raises(ConfigError, match="parallel.context_parallel: shared-prefix packed rows cannot be split"):
        build_policy_model(spec, ParallelConfig(context_parallel=2), PolicyTrainConfig(shared_prefix="on"), layout,
                           torch.float32, torch.device("cpu"))


@pytest.mark.multiprocess
@pytest.mark.slow
def test_context_parallel_mixture_of_experts_replays_routing_and_steps_as_one_rank(tmp_path):
    """CP=2 and CP=2 x EP=2 on a tiny Qwen3-MoE with replayed engine routing: each rank routes its own
    chunks' tokens with the engine's experts; log-probs, step and weights are one rank's."""
    model = make_tiny_hf_model(str(tmp_path / "moe"), tiny_hf_config("qwen3_moe"), seed=1)
    train = {"micro_batch_tokens": 26}
    (ref,) = run_ranks(replayed_moe_step, 1, model, {}, train, tmp_path=tmp_path)
    for kwargs in ({"context_parallel": 2}, {"context_parallel": 2, "expert_parallel": 2}):
        assert_same_moe_step(run_ranks(replayed_moe_step, 2, model, kwargs, train, tmp_path=tmp_path)[0], ref)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_context_parallel_latent_attention_steps_as_one_rank(tmp_path):
    """DeepSeek-V3's latent attention (its own rotary embedding, keys wider than values) at CP=2."""
    model = make_tiny_hf_model(str(tmp_path / "ds"), tiny_hf_config("deepseek_v3"), seed=2)
    train = {"max_gen_len": 12, "micro_batch_tokens": 40, "routing_replay": "off"}
    (ref,) = run_ranks(step_checkpoint_resume, 1, model, {}, str(tmp_path / "c1"), {}, train, batch, tmp_path=tmp_path)
    got = run_ranks(step_checkpoint_resume, 2, model, {"context_parallel": 2}, str(tmp_path / "c2"), {}, train, batch,
                    tmp_path=tmp_path)[0]
    assert_same_as_one_rank(got, ref)
