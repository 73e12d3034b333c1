"""Virtual pipeline stages (parallel.virtual_pipeline, megatron's interleaved 1F1B): the same
log-probs, step, checkpoint and HF export as one stage (gloo, CPU)."""
import pytest
import torch

from dist_utils import run_ranks
from spice_megatron.config import ConfigError, OptimConfig, ParallelConfig, PolicyTrainConfig
from spice_megatron.offline_assets import make_tiny_hf_model, tiny_hf_config
from spice_megatron.policy.batching import TrainSequence, make_microbatches


def batch(flip: bool = False) -> list[TrainSequence]:
    g = torch.Generator().manual_seed(9)
    seqs = []
    for i, (p, c) in enumerate([(5, 6), (3, 4), (4, 7), (2, 5), (6, 3)]):
        ids = torch.randint(0, 256, (p + c,), generator=g).tolist()
        adv = [0.8, -0.5, 0.3, -0.6, 0.4][i]
        seqs.append(TrainSequence(ids[:p], ids[p:], advantage=-adv if flip else adv))
    return seqs


def _vpp_rank(model_dir, parallel_kwargs, root, resume_kwargs, train_kwargs):
    """Log-probs, one step (loss, grad norm, HF weights), a checkpoint; a second batch's step continued
    here and, from the checkpoint, at `resume_kwargs`'s layout."""
    from spice_megatron.bridge.export import gathered_hf_state_dict
    from spice_megatron.policy.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
    from spice_megatron.policy.learner import Learner
    from spice_megatron.policy.model import model_spec_from_hf

    optim = OptimConfig(lr=1e-3, adam_eps=1e-5)
    train = PolicyTrainConfig(max_gen_len=8, micro_batch_tokens=16, **train_kwargs)
    learner = Learner.from_hf(model_dir, ParallelConfig(**parallel_kwargs), optim, train)
    logprobs = learner.compute_logprobs(batch())
    micro_batches = len(learner._microbatches(batch()))
    (m,) = learner.train_on_batch(batch())
    weights = gathered_hf_state_dict(learner)
    save_checkpoint(learner, root, step=1)
    (after,) = learner.train_on_batch(batch(flip=True))
    fresh = Learner(model_spec_from_hf(model_dir), ParallelConfig(**resume_kwargs), optim, train)
    load_checkpoint(fresh, latest_checkpoint(root))
    (resumed,) = fresh.train_on_batch(batch(flip=True))
    return {"logprobs": logprobs, "step": (m.loss, m.grad_norm, m.tokens), "weights": weights,
            "after": (after.loss, after.grad_norm), "resumed": (resumed.loss, resumed.grad_norm),
            "chunks": len(learner.chunks), "micro_batches": micro_batches}


def _close(got: dict, ref: dict) -> None:
    assert max(abs(x - y) for a, b in zip(got["logprobs"], ref["logprobs"]) for x, y in zip(a, b)) < 1e-5
    assert got["step"] == pytest.approx(ref["step"], rel=1e-5, abs=1e-6)
    w = got["weights"]
    assert w.keys() == ref["weights"].keys()
    assert max((w[k] - ref["weights"][k]).abs().max().item() for k in w) < 2e-6
    assert got["after"] == pytest.approx(ref["after"], rel=1e-5, abs=1e-6)
    assert got["resumed"] == pytest.approx(got["after"], rel=1e-5, abs=1e-6)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("shared_prefix", ["off", "on"])
def test_virtual_pipeline_stages_step_as_one_stage_and_their_checkpoint_resumes_without_them(tmp_path, shared_prefix):
    """4 layers at PP=2 x VPP=2 (each rank holds layers 0 and 2, or 1 and 3, as two chunks): the
    interleaved schedule's log-probs, step and weights are one stage's; its micro-batch count is a
    multiple of PP (masked fillers); a checkpoint saved with virtual stages resumes at PP=2 without."""
    model = make_tiny_hf_model(str(tmp_path / "m"), tiny_hf_config("qwen3", num_layers=4), seed=4)
    train = {"shared_prefix": shared_prefix}
    (ref,) = run_ranks(_vpp_rank, 1, model, {}, str(tmp_path / "c1"), {}, train, tmp_path=tmp_path)
    ranks = run_ranks(_vpp_rank, 2, model, {"pipeline_parallel": 2, "virtual_pipeline": 2}, str(tmp_path / "c2"),
                      {"pipeline_parallel": 2}, train, tmp_path=tmp_path)
    got = ranks[0]
    assert got["chunks"] == 2 and got["micro_batches"] % 2 == 0
    _close(got, ref)


def _moe_vpp_rank(model_dir, parallel_kwargs):
    """A mixture of experts with the engine's (perturbed) routing replayed, every layer recomputed."""
    from test_moe import _hf_routing

    from spice_megatron.bridge.export import gathered_hf_state_dict
    from spice_megatron.policy.learner import Learner

    tokens = torch.randint(0, 256, (4, 13), generator=torch.Generator().manual_seed(5))
    noisy = _hf_routing(model_dir, tokens, noise=0.5)
    seqs = [TrainSequence(t[:5].tolist(), t[5:].tolist(), advantage=a, routed_experts=noisy[i, :-1].numpy())
            for i, (t, a) in enumerate(zip(tokens, [0.7, -0.4, 0.2, -0.3]))]
    learner = Learner.from_hf(model_dir, ParallelConfig(**parallel_kwargs), OptimConfig(lr=1e-3, adam_eps=1e-5),
                              PolicyTrainConfig(routing_replay="on", micro_batch_tokens=13, max_gen_len=8,
                                                recompute="full"))
    lp = learner.compute_logprobs(seqs)
    (m,) = learner.train_on_batch(seqs)
    return lp, (m.loss, m.grad_norm, m.routing_differs), gathered_hf_state_dict(learner)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_virtual_pipeline_stages_replay_each_chunks_routing_under_full_recompute(tmp_path):
    """A 4-layer Qwen3-MoE at PP=2 x VPP=2, engine routing replayed, every layer recomputed: each
    chunk's routers take back their own micro-batches' experts; log-probs, step and weights are one
    rank's."""
    model = make_tiny_hf_model(str(tmp_path / "moe"), tiny_hf_config("qwen3_moe", num_layers=4), seed=1)
    (ref,) = run_ranks(_moe_vpp_rank, 1, model, {}, tmp_path=tmp_path)
    lp, step, w = run_ranks(_moe_vpp_rank, 2, model, {"pipeline_parallel": 2, "virtual_pipeline": 2},
                            tmp_path=tmp_path)[0]  # rank 0 has the gathered weights
    assert max(abs(x - y) for a, b in zip(lp, ref[0]) for x, y in zip(a, b)) < 1e-5
    assert step == pytest.approx(ref[1], rel=1e-5, abs=1e-6)
    assert step[2] > 0  # the perturbed engine routed some tokens elsewhere: replay mattered
    assert max((w[k] - ref[2][k]).abs().max().item() for k in w) < 2e-6


def test_virtual_pipeline_layouts_are_checked_and_micro_batch_counts_rounded():
    from spice_megatron.policy.model import check_parallel_layout, model_spec_from_hf

    spec = model_spec_from_hf(tiny_hf_config("qwen3", num_layers=6))
    check_parallel_layout(spec, 1, 2, vpp=3)
    with pytest.raises(ConfigError, match=r"parallel.virtual_pipeline: pipeline_parallel x virtual_pipeline = 2 x 2 "
                                          r"does not divide num_hidden_layers=6"):
        check_parallel_layout(spec, 1, 2, vpp=2)
    with pytest.raises(ConfigError, match="parallel.virtual_pipeline: needs pipeline_parallel > 1"):
        ParallelConfig(virtual_pipeline=2).validate()
    with pytest.raises(ConfigError, match="parallel.virtual_pipeline: with uneven stages"):
        ParallelConfig(pipeline_parallel=2, virtual_pipeline=2, first_stage_layers=1).validate()
    mbs = make_microbatches(batch(), 1, 0, 16, count_multiple=4)
    assert len(mbs) == 4 and sum(int(mb.loss_mask.sum()) for mb in mbs) == sum(len(s.completion_ids) for s in batch())
