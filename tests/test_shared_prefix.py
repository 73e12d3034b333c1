"""Shared-prefix packed micro-batches: the layout, the attention's isolation, and exactness against
the unshared forward at one rank, TP=2, PP=2, DP=2 and a mixture-of-experts model at EP=2."""
import os
import sys
from types import SimpleNamespace

import pytest
import torch
from dist_utils import run_ranks

from spice_megatron.config import ConfigError, OptimConfig, ParallelConfig, PolicyTrainConfig
from spice_megatron.data.offline_assets import make_tiny_hf_model, tiny_hf_config
from spice_megatron.policy.batching import TrainSequence
from spice_megatron.policy.packing import collate_packed, packed_microbatches, plan_packed, split_units_data_parallel
from spice_megatron.policy.shared_prefix import row_segments

# (prompt length, completion lengths): groups of 3, 2, 1 (a prompt no other sequence shares) and 2
GROUPS = [(5, [4, 2, 6]), (3, [3, 1]), (4, [5]), (6, [2, 3])]


def groups_batch(seed: int = 3, routing_layers: int = 0, experts: int = 8, top_k: int = 2) -> list[TrainSequence]:
    """Sequences of GROUPS, interleaved across groups as the trainer's batches are not; with
    `routing_layers`, engine routing whose prompt rows are the same for every member of a group."""
    g = torch.Generator().manual_seed(seed)
    advantages = iter([0.7, -0.2, 0.4, -0.9, 0.1, 0.3, 0.5, -0.6])
    seqs = []
    for p, lengths in GROUPS:
        prompt = torch.randint(0, 256, (p,), generator=g).tolist()
        prompt_routing = torch.rand(p, routing_layers, experts, generator=g).argsort(-1)[..., :top_k]
        for c in lengths:
            x = TrainSequence(prompt, torch.randint(0, 256, (c,), generator=g).tolist(), advantage=next(advantages),
                              role="reasoner" if p != 5 else "challenger",
                              rollout_logprobs=(-torch.rand(c, generator=g)).tolist())
            if routing_layers:
                own = torch.rand(c - 1, routing_layers, experts, generator=g).argsort(-1)[..., :top_k]
                x.routed_experts = torch.cat([prompt_routing, own]).numpy()
            seqs.append(x)
    order = [0, 3, 5, 1, 6, 2, 4, 7]
    return [seqs[i] for i in order]


# ----------------------------------------------------------------------------- layout

def test_a_packed_row_holds_each_prompt_once_with_positions_of_the_unshared_sequences():
    seqs = groups_batch()
    (units,) = plan_packed(seqs, list(range(len(seqs))), token_budget=1000)
    mb = collate_packed(seqs, units)
    prompts = {tuple(x.prompt_ids) for x in seqs}
    # each prompt once, each completion but its last token once
    assert mb.tokens.shape[1] == sum(len(p) for p in prompts) + sum(len(x.completion_ids) - 1 for x in seqs)
    row, positions = mb.tokens[0].tolist(), mb.position_ids[0].tolist()
    for r, i in enumerate(mb.index):
        x = seqs[i]
        scored = (mb.score_rows == r).nonzero().flatten()
        at = mb.score_index[scored].tolist()
        # the scored positions hold the sequence's tokens but the last, at its own positions
        assert [row[t] for t in at] == (x.prompt_ids + x.completion_ids)[len(x.prompt_ids) - 1:-1]
        assert [positions[t] for t in at] == list(range(len(x.prompt_ids) - 1, len(x) - 1))
        assert mb.labels[0, scored].tolist() == x.completion_ids
        assert mb.loss_mask[r].sum() == len(x.completion_ids)
        assert mb.rollout_logprobs[r, :len(x.completion_ids)].tolist() == pytest.approx(x.rollout_logprobs)
    padded = collate_packed(seqs, units, pad_to=8)
    assert padded.tokens.shape[1] % 8 == 0 and padded.token_mask.sum() == mb.tokens.shape[1]
    # the pads under sequence parallelism (a row a multiple of 128 on GPU) are one attention
    # segment, not one each: attention's cost does not grow with them
    real = row_segments(mb.attention_mask)
    padded = collate_packed(seqs, units, pad_to=128)
    assert padded.tokens.shape[1] - mb.tokens.shape[1] > 64
    assert row_segments(padded.attention_mask) == real + [(mb.tokens.shape[1], padded.tokens.shape[1]) * 2]


def test_groups_stay_on_one_data_parallel_rank_and_a_long_group_is_split_with_its_prompt_again():
    seqs = groups_batch()
    split = split_units_data_parallel(seqs, 2)
    assert sorted(i for part in split for i in part) == list(range(len(seqs)))
    for part in split:
        for i in part:  # every member of i's group is on the same rank
            assert all(j in part for j, y in enumerate(seqs) if y.prompt_ids == seqs[i].prompt_ids)
    rows = plan_packed(seqs, list(range(len(seqs))), token_budget=10)
    group = [i for i, x in enumerate(seqs) if len(x.prompt_ids) == 5]  # 5 + 3 + 1 + 5 tokens > 10
    holding = [u for row in rows for u in row if u[0] in group or any(i in group for i in u)]
    assert len(holding) == 2 and sorted(i for u in holding for i in u) == sorted(group)
    # an expert-parallel group spanning DP ranks runs equal micro-batch counts (fillers masked)
    counts = [len(packed_microbatches(seqs, 2, r, 10, equal_counts=True)) for r in (0, 1)]
    assert counts[0] == counts[1]


def test_mini_batches_hold_whole_groups_dealt_round_robin():
    from spice_megatron.policy.packing import minibatch_split

    seqs = [TrainSequence([g], [1, 2]) for g in (0, 0, 1, 1, 2, 2, 3, 3)]
    assert minibatch_split(seqs, 2) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert minibatch_split(seqs, 1) == [list(range(8))]
    assert minibatch_split(seqs[:2], 2) == [[0], [1]]  # fewer groups than steps: seqs[j::k]


def _attention(heads=2, groups=1, dim=4, kernel="sdpa"):
    from spice_megatron.policy.shared_prefix import SharedPrefixAttention

    config = SimpleNamespace(context_parallel_size=1, num_attention_heads=heads, num_query_groups=groups,
                             kv_channels=dim, apply_query_key_layer_scaling=False, attention_dropout=0.0)
    tp = SimpleNamespace(tp=SimpleNamespace(size=lambda: 1))
    return SharedPrefixAttention(config, layer_number=1, pg_collection=tp, kernel=kernel).eval()


def test_the_flex_kernel_computes_what_the_sdpa_kernel_does():
    """train.shared_prefix_kernel=flex: one FlexAttention call per layer over the row's block mask.
    Forward only on CPU (torch has no FlexAttention backward there; the learner refuses flex
    without a GPU); GQA, several groups and the pads of pad_to=8."""
    from spice_megatron.policy.model import build_policy_model

    seqs = groups_batch()
    (units,) = plan_packed(seqs, list(range(len(seqs))), token_budget=1000)
    mb = collate_packed(seqs, units, pad_to=8)
    s = mb.tokens.shape[1]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(s, 1, n, 8, generator=g) for n in (4, 2, 2))
    with torch.no_grad():
        sdpa = _attention(4, 2, 8)(q, k, v, mb.attention_mask.clone())
        flex = _attention(4, 2, 8, kernel="flex")(q, k, v, mb.attention_mask.clone())
    real = int(mb.token_mask.sum())
    assert (flex[:real] - sdpa[:real]).abs().max() < 1e-5
    with pytest.raises(ConfigError, match="train.shared_prefix_kernel: flex needs a GPU"):
        build_policy_model(None, None, PolicyTrainConfig(shared_prefix="on", shared_prefix_kernel="flex"), None,
                           torch.float32, torch.device("cpu"))
    with pytest.raises(ConfigError, match="train.shared_prefix_kernel"):
        PolicyTrainConfig(shared_prefix_kernel="flash").validate()


def test_a_completion_sees_its_prefix_and_itself_and_never_another_completion():
    """Against a dense reference mask built independently, and by perturbation: changing one
    completion's keys and values changes no other completion and not the prefix."""
    seqs = groups_batch()
    (units,) = plan_packed(seqs, list(range(len(seqs))), token_budget=1000)
    mb = collate_packed(seqs, units, pad_to=4)
    s = mb.tokens.shape[1]
    attention = _attention()
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(s, 1, 2, 4, generator=g), torch.randn(s, 1, 1, 4, generator=g), torch.randn(s, 1, 1, 4,
                                                                                                     generator=g)
    out = attention(q, k, v, mb.attention_mask.clone())
    # reference: a prefix token sees its prefix up to itself; a completion token its whole prefix
    # and its own completion up to itself; a pad the pads up to itself
    prefix_start, prefix_end, own = mb.attention_mask.tolist()
    allowed = torch.zeros(s, s, dtype=torch.bool)
    for t in range(s):
        for u in range(s):
            if own[t] == prefix_start[t]:
                allowed[t, u] = own[t] <= u <= t
            else:
                allowed[t, u] = prefix_start[t] <= u < prefix_end[t] or own[t] <= u <= t
    scores = torch.einsum("shd,uhd->hsu", q[:, 0], k[:, 0].expand(s, 2, 4)) / 2.0
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    reference = torch.einsum("hsu,uhd->shd", probs, v[:, 0].expand(s, 2, 4)).reshape(s, 1, 8)
    assert (out - reference).abs().max() < 1e-5
    # perturb the second completion of the first unit: only its own outputs move
    first = [t for t in range(s) if own[t] != prefix_start[t]]
    target = own[first[0]]
    other_segments = sorted({own[t] for t in first} - {target})
    second = [t for t in range(s) if own[t] == other_segments[0]]
    k2, v2 = k.clone(), v.clone()
    k2[second] += 3.0
    v2[second] -= 2.0
    moved = attention(q, k2, v2, mb.attention_mask.clone())
    untouched = [t for t in range(s) if t not in second]
    assert (moved[untouched] - out[untouched]).abs().max() == 0.0
    assert (moved[second] - out[second]).abs().max() > 1e-3


def test_a_long_prefix_row_saves_what_the_planner_counts_for_attention():
    """A challenger-like unit (a 2,400-token prefix, 3 completions of 300,
    GQA 4) once saved 6.9x the planner's attention terms (K/V per query head, copied per completion,
    a mask each). Now what the backward keeps (each storage once, q/k/v included, plus the output the
    projection keeps) is within 1.3x of the planner's terms for the row's tokens."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "bench"))
    from bench_learner import long_prefix_saved

    saved, planned, _ = long_prefix_saved(torch.bfloat16)
    assert 0.5 < saved / planned <= 1.3, f"saved {saved / 2**20:.1f} MiB, planned {planned / 2**20:.1f} MiB"


def test_the_config_field_is_validated_by_name():
    with pytest.raises(ConfigError, match="train.shared_prefix"):
        PolicyTrainConfig(shared_prefix="yes").validate()
    assert PolicyTrainConfig().use_shared_prefix
    assert not PolicyTrainConfig(moe_aux_loss_coeff=1e-3).use_shared_prefix  # inexact there: off on auto
    assert PolicyTrainConfig(moe_aux_loss_coeff=1e-3, shared_prefix="on").use_shared_prefix


# ----------------------------------------------------------------------------- exactness

def _flipped(seqs):
    out = [TrainSequence(**{**x.__dict__}) for x in seqs]
    for x in out:
        x.advantage = -0.5 * x.advantage
    return out


def _compare_rank(model_dir, layouts, dtype="fp32", routing_layers=0, replay="off", per_update=0):
    """Per layout and shared_prefix off/on: completion log-probs, (loss, grad norm) of the first
    two optimiser steps, the weights after them and the tokens the forward ran."""
    from spice_megatron.bridge.export import gathered_hf_state_dict
    from spice_megatron.bridge.hf_io import learner_from_hf

    out = {}
    for tp, pp, ep in layouts:
        for shared in ("off", "on"):
            learner = learner_from_hf(model_dir, ParallelConfig(tp, pp, expert_parallel=ep),
                                      OptimConfig(lr=1e-3, adam_eps=1e-5),
                                      PolicyTrainConfig(max_gen_len=8, micro_batch_tokens=24, shared_prefix=shared,
                                                        dtype=dtype, routing_replay=replay,
                                                        trajectories_per_update=per_update))
            batch = groups_batch(routing_layers=routing_layers)
            lps = learner.compute_logprobs(batch)
            first = learner.train_on_batch(batch)[0]
            second = learner.train_on_batch(_flipped(batch))[-1]
            weights = {k: v.float() for k, v in (gathered_hf_state_dict(learner) or {}).items()}  # on rank 0
            out[(tp, pp, ep, shared)] = (lps, [first.loss, first.grad_norm, second.loss, second.grad_norm], weights,
                                         first.tokens_run)
    return out


def _assert_same(results, layouts, lp_tol=1e-5, rel=1e-5):
    for tp, pp, ep in layouts:
        off, on = results[(tp, pp, ep, "off")], results[(tp, pp, ep, "on")]
        where = f"TP={tp} PP={pp} EP={ep}"
        assert max(abs(a - b) for x, y in zip(off[0], on[0]) for a, b in zip(x, y)) < lp_tol, where
        assert [len(x) for x in on[0]] == [len(x) for x in off[0]], where
        for a, b in zip(off[1], on[1]):
            assert b == pytest.approx(a, rel=rel, abs=1e-7), where
        scale = max(w.abs().max().item() for w in off[2].values())
        assert max((off[2][k] - on[2][k]).abs().max().item() for k in off[2]) <= rel * scale, where
        assert on[3] < off[3], where  # fewer tokens through the forward


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    return make_tiny_hf_model(str(tmp_path_factory.mktemp("sp_dense") / "qwen3"), tiny_hf_config("qwen3", True),
                              seed=1)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return make_tiny_hf_model(str(tmp_path_factory.mktemp("sp_moe") / "moe"), tiny_hf_config("qwen3_moe"), seed=1)


@pytest.mark.multiprocess
def test_shared_prefix_equals_the_unshared_forward_and_steps_at_one_rank_fp32_and_bf16(dense_dir, tmp_path):
    (fp32,) = run_ranks(_compare_rank, 1, dense_dir, [(1, 1, 1)], tmp_path=tmp_path)
    _assert_same(fp32, [(1, 1, 1)])
    assert fp32[(1, 1, 1, "on")][3] == 36 and fp32[(1, 1, 1, "off")][3] == 63
    # two mini-batches of whole groups per batch: the old-log-prob pass and the PPO clip
    (clipped,) = run_ranks(_compare_rank, 1, dense_dir, [(1, 1, 1)], "fp32", 0, "off", 4, tmp_path=tmp_path)
    _assert_same(clipped, [(1, 1, 1)])
    (bf16,) = run_ranks(_compare_rank, 1, dense_dir, [(1, 1, 1)], "bf16", tmp_path=tmp_path)
    # bf16: 8 bits of mantissa; the two forwards sum in other orders
    _assert_same(bf16, [(1, 1, 1)], lp_tol=0.1, rel=0.05)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_shared_prefix_is_exact_at_tp2_pp2_and_dp2(dense_dir, tmp_path):
    layouts = [(2, 1, 1), (1, 2, 1), (1, 1, 1)]  # TP=2 (sequence parallel), PP=2, DP=2
    results = run_ranks(_compare_rank, 2, dense_dir, layouts, tmp_path=tmp_path)[0]
    _assert_same(results, layouts)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_shared_prefix_is_exact_for_experts_at_ep2_with_routing_replay(moe_dir, tmp_path):
    """EP=2 across DP=2 (equal micro-batch counts), routing replayed: a prompt's routing is taken
    once, from the first sequence of its group (the same for every member here, as an engine's
    prefix cache makes it)."""
    results = run_ranks(_compare_rank, 2, moe_dir, [(1, 1, 2)], "fp32", 2, "on", tmp_path=tmp_path)[0]
    _assert_same(results, [(1, 1, 2)])
