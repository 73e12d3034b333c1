"""One rank's part of the layout-exactness tests (context parallelism, virtual pipeline stages):
what a learner at a layout computes, to compare with one rank's."""
from typing import Callable

from spice_megatron.config import OptimConfig, ParallelConfig, PolicyTrainConfig


def step_checkpoint_resume(model_dir: str, parallel_kwargs: dict, root: str, resume_kwargs: dict, train_kwargs: dict,
                           make_batch: Callable) -> dict:
    """Log-probs, one step (loss, grad norm, tokens, HF weights), a checkpoint; then make_batch(flip=True)'s
    step continued here and, from the checkpoint, at `resume_kwargs`'s layout."""
    from spice_megatron.bridge.export import gathered_hf_state_dict
    from spice_megatron.bridge.hf_io import learner_from_hf
    from spice_megatron.families import model_spec_from_hf
    from spice_megatron.policy.checkpoint import load_checkpoint, save_checkpoint
    from spice_megatron.policy.checkpoint_files import latest_checkpoint
    from spice_megatron.policy.learner import Learner

    optim = OptimConfig(lr=1e-3, adam_eps=1e-5)
    train = PolicyTrainConfig(**train_kwargs)
    learner = learner_from_hf(model_dir, ParallelConfig(**parallel_kwargs), optim, train)
    logprobs = learner.compute_logprobs(make_batch())
    micro_batches = len(learner._microbatches(make_batch()))
    (m,) = learner.train_on_batch(make_batch())
    weights = gathered_hf_state_dict(learner)
    save_checkpoint(learner, root, step=1)
    (after,) = learner.train_on_batch(make_batch(flip=True))
    fresh = Learner(model_spec_from_hf(model_dir), ParallelConfig(**resume_kwargs), optim, train)
    load_checkpoint(fresh, latest_checkpoint(root))
    (resumed,) = fresh.train_on_batch(make_batch(flip=True))
    return {"logprobs": logprobs, "step": (m.loss, m.grad_norm, m.tokens), "weights": weights,
            "after": (after.loss, after.grad_norm), "resumed": (resumed.loss, resumed.grad_norm),
            "layout": learner.layout, "chunks": len(learner.chunks), "shared_prefix": learner.shared_prefix,
            "micro_batches": micro_batches}


def assert_same_as_one_rank(got: dict, ref: dict) -> None:
    """Every rank's log-probs, the step and weights within fp32 tolerance, and the resumed step exact."""
    import pytest

    assert max(abs(x - y) for a, b in zip(got["logprobs"], ref["logprobs"]) for x, y in zip(a, b)) < 1e-5
    assert got["step"] == pytest.approx(ref["step"], rel=1e-5, abs=1e-6)
    w = got["weights"]
    assert w.keys() == ref["weights"].keys()
    assert max((w[k] - ref["weights"][k]).abs().max().item() for k in w) < 2e-6
    assert got["after"] == pytest.approx(ref["after"], rel=1e-5, abs=1e-6)
    assert got["resumed"] == pytest.approx(got["after"], rel=1e-5, abs=1e-6)


def replayed_moe_step(model_dir: str, parallel_kwargs: dict, train_kwargs: dict) -> tuple:
    """A mixture of experts given four sequences with an engine's perturbed routing, replayed: the
    log-probs, one step's loss, grad norm and routing-differs share, and the weights after it (rank 0)."""
    import torch
    from test_moe import _hf_routing

    from spice_megatron.bridge.export import gathered_hf_state_dict
    from spice_megatron.bridge.hf_io import learner_from_hf
    from spice_megatron.policy.batching import TrainSequence

    tokens = torch.randint(0, 256, (4, 13), generator=torch.Generator().manual_seed(5))
    noisy = _hf_routing(model_dir, tokens, noise=0.5)
    seqs = [TrainSequence(t[:5].tolist(), t[5:].tolist(), advantage=a, routed_experts=noisy[i, :-1].numpy())
            for i, (t, a) in enumerate(zip(tokens, [0.7, -0.4, 0.2, -0.3]))]
    learner = learner_from_hf(model_dir, ParallelConfig(**parallel_kwargs), OptimConfig(lr=1e-3, adam_eps=1e-5),
                              PolicyTrainConfig(routing_replay="on", max_gen_len=8, **train_kwargs))
    lp = learner.compute_logprobs(seqs)
    (m,) = learner.train_on_batch(seqs)
    return lp, (m.loss, m.grad_norm, m.routing_differs), gathered_hf_state_dict(learner)


def assert_same_moe_step(got: tuple, ref: tuple) -> None:
    import pytest

    lp, step, w = got
    assert max(abs(x - y) for a, b in zip(lp, ref[0]) for x, y in zip(a, b)) < 1e-5
    assert step == pytest.approx(ref[1], rel=1e-5, abs=1e-6)
    assert step[2] > 0  # the perturbed engine routed some tokens elsewhere: replay mattered
    assert max((w[k] - ref[2][k]).abs().max().item() for k in w) < 2e-6
