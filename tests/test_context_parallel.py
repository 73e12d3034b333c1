"""Context parallelism (policy/context_parallel.py): the same log-probs, step, checkpoint and HF
export as one rank per sequence (gloo, CPU)."""
import pytest
import torch

from dist_utils import run_ranks
from spice_megatron.config import ConfigError, OptimConfig, ParallelConfig, PolicyTrainConfig
from spice_megatron.offline_assets import make_tiny_hf_model, tiny_hf_config
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


def _cp_rank(model_dir, parallel_kwargs, root, resume_kwargs, train_kwargs=None):
    """Log-probs, one step (loss, grad norm, HF weights), a checkpoint; then a second batch's step
    continued here and, from the checkpoint, at `resume_kwargs`'s layout."""
    from spice_megatron.bridge.export import gathered_hf_state_dict
    from spice_megatron.policy.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
    from spice_megatron.policy.learner import Learner
    from spice_megatron.policy.model import model_spec_from_hf

    optim = OptimConfig(lr=1e-3, adam_eps=1e-5)
    train = PolicyTrainConfig(max_gen_len=12, micro_batch_tokens=40, **(train_kwargs or {}))
    learner = Learner.from_hf(model_dir, ParallelConfig(**parallel_kwargs), optim, train)
    logprobs = learner.compute_logprobs(batch())
    (m,) = learner.train_on_batch(batch())
    weights = gathered_hf_state_dict(learner)
    save_checkpoint(learner, root, step=1)
    (after,) = learner.train_on_batch(batch(flip=True))
    fresh = Learner(model_spec_from_hf(model_dir), ParallelConfig(**resume_kwargs), optim, train)
    load_checkpoint(fresh, latest_checkpoint(root))
    (resumed,) = fresh.train_on_batch(batch(flip=True))
    return {"logprobs": logprobs, "step": (m.loss, m.grad_norm, m.tokens), "weights": weights,
            "after": (after.loss, after.grad_norm), "resumed": (resumed.loss, resumed.grad_norm),
            "cp": learner.layout.cp, "shared_prefix": learner.shared_prefix}


@pytest.mark.multiprocess
@pytest.mark.slow
def test_context_parallel_steps_exactly_as_one_rank_and_its_checkpoint_resumes_at_another_layout(tmp_path):
    """CP=2 (and TP=2 x CP=2 with sequence parallelism): the old-log-prob pass, a step's loss, grad
    norm and weights equal one rank's; a checkpoint saved at CP=2 resumes at CP=1 x DP=2 (and the
    TP2 x CP2 one at TP=2 x DP=2) with the same next step."""
    model = make_tiny_hf_model(str(tmp_path / "m"), tiny_hf_config("qwen3", num_layers=2), seed=3)
    (ref,) = run_ranks(_cp_rank, 1, model, {}, str(tmp_path / "c1"), {}, tmp_path=tmp_path)
    cp2 = run_ranks(_cp_rank, 2, model, {"context_parallel": 2}, str(tmp_path / "c2"), {}, tmp_path=tmp_path)
    tp_cp = run_ranks(_cp_rank, 4, model, {"tensor_parallel": 2, "context_parallel": 2}, str(tmp_path / "c4"),
                      {"tensor_parallel": 2}, tmp_path=tmp_path)
    for ranks in (cp2, tp_cp):
        first = ranks[0]
        assert first["cp"] == 2 and not first["shared_prefix"]  # auto is off under CP
        for r in ranks:  # every rank has every sequence's log-probs
            for got, want in zip(r["logprobs"], ref["logprobs"]):
                assert got == pytest.approx(want, abs=1e-5)
        loss, norm, tokens = first["step"]
        assert loss == pytest.approx(ref["step"][0], abs=1e-6) and norm == pytest.approx(ref["step"][1], rel=1e-5)
        assert tokens == ref["step"][2]
        w = first["weights"]
        assert w.keys() == ref["weights"].keys()
        assert max((w[k] - ref["weights"][k]).abs().max().item() for k in w) < 2e-6
        assert first["after"] == pytest.approx(ref["after"], rel=1e-5, abs=1e-6)
        assert first["resumed"] == pytest.approx(first["after"], rel=1e-5, abs=1e-6)


def test_context_parallelism_refuses_shared_prefix_rows_with_one_line(tmp_path):
    from spice_megatron.policy.model import build_policy_model, model_spec_from_hf
    from spice_megatron.policy.parallel import Layout

    spec = model_spec_from_hf(tiny_hf_config("qwen3", num_layers=2))
    layout = Layout(rank=0, world_size=2, tp=1, pp=1, dp=1, tp_rank=0, pp_rank=0, dp_rank=0, cp=2)
    with pytest.raises(ConfigError, match="parallel.context_parallel: shared-prefix packed rows cannot be split"):
        build_policy_model(spec, ParallelConfig(context_parallel=2), PolicyTrainConfig(shared_prefix="on"), layout,
                           torch.float32, torch.device("cpu"))


def _moe_cp_rank(model_dir, parallel_kwargs):
    """A mixture of experts with the engine's (perturbed) routing replayed: the log-probs, one step's
    loss, grad norm and routing-differs share, and the weights after it."""
    from test_moe import _hf_routing

    from spice_megatron.bridge.export import gathered_hf_state_dict
    from spice_megatron.policy.learner import Learner

    tokens = torch.randint(0, 256, (3, 13), generator=torch.Generator().manual_seed(5))
    noisy = _hf_routing(model_dir, tokens, noise=0.5)
    seqs = [TrainSequence(t[:5].tolist(), t[5:].tolist(), advantage=a, routed_experts=noisy[i, :-1].numpy())
            for i, (t, a) in enumerate(zip(tokens, [0.7, -0.4, 0.2]))]
    learner = Learner.from_hf(model_dir, ParallelConfig(**parallel_kwargs), OptimConfig(lr=1e-3, adam_eps=1e-5),
                              PolicyTrainConfig(routing_replay="on", micro_batch_tokens=26, max_gen_len=8))
    lp = learner.compute_logprobs(seqs)
    (m,) = learner.train_on_batch(seqs)
    return lp, (m.loss, m.grad_norm, m.routing_differs), gathered_hf_state_dict(learner)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_context_parallel_mixture_of_experts_replays_routing_and_steps_as_one_rank(tmp_path):
    """CP=2 and CP=2 x EP=2 on a tiny Qwen3-MoE with replayed engine routing: each rank routes its own
    chunks' tokens with the engine's experts; log-probs, step and weights are one rank's."""
    model = make_tiny_hf_model(str(tmp_path / "moe"), tiny_hf_config("qwen3_moe"), seed=1)
    (ref,) = run_ranks(_moe_cp_rank, 1, model, {}, tmp_path=tmp_path)
    for kwargs in ({"context_parallel": 2}, {"context_parallel": 2, "expert_parallel": 2}):
        lp, step, w = run_ranks(_moe_cp_rank, 2, model, kwargs, tmp_path=tmp_path)[0]
        assert max(abs(x - y) for a, b in zip(lp, ref[0]) for x, y in zip(a, b)) < 1e-5, kwargs
        assert step == pytest.approx(ref[1], rel=1e-5, abs=1e-6), kwargs
        assert max((w[k] - ref[2][k]).abs().max().item() for k in w) < 2e-6, kwargs


@pytest.mark.multiprocess
@pytest.mark.slow
def test_context_parallel_latent_attention_steps_as_one_rank(tmp_path):
    """DeepSeek-V3's latent attention (its own rotary embedding, keys wider than values) at CP=2."""
    model = make_tiny_hf_model(str(tmp_path / "ds"), tiny_hf_config("deepseek_v3"), seed=2)
    off = {"routing_replay": "off"}
    (ref,) = run_ranks(_cp_rank, 1, model, {}, str(tmp_path / "c1"), {}, off, tmp_path=tmp_path)
    got = run_ranks(_cp_rank, 2, model, {"context_parallel": 2}, str(tmp_path / "c2"), {}, off, tmp_path=tmp_path)[0]
    assert max(abs(x - y) for a, b in zip(got["logprobs"], ref["logprobs"]) for x, y in zip(a, b)) < 1e-5
    assert got["step"] == pytest.approx(ref["step"], rel=1e-5, abs=1e-6)
    assert max((got["weights"][k] - ref["weights"][k]).abs().max().item() for k in ref["weights"]) < 2e-6
    assert got["resumed"] == pytest.approx(got["after"], rel=1e-5, abs=1e-6)
