"""The learner's old log-probs during a streamed iteration's rollouts (streamed_forward.py); end to
end: test_trainer_resilience.py."""
import queue

import pytest
from dist_utils import run_ranks

from spice_megatron.loop.streamed_forward import _next_chunk, overlaps


def test_a_chunk_is_every_document_complete_so_far_and_the_end_comes_after_it():
    chunks = queue.Queue()
    for item in (["a"], ["b", "c"], None):
        chunks.put(item)
    assert _next_chunk(chunks) == ["a", "b", "c"]
    assert _next_chunk(chunks) is None
    chunks.put(["d"])
    assert _next_chunk(chunks) == ["d"]


def test_only_an_on_policy_disaggregated_streamed_run_with_several_steps_per_batch_overlaps():
    from recipes import get_recipe

    cfg = get_recipe("qwen3_8b")  # the paper's: 128 trajectories per update, disaggregated, streamed
    assert overlaps(cfg)
    for field, value in (("run.streamed", False), ("run.colocate", True), ("train.max_staleness", 1),
                         ("train.old_logprobs", "rollout"), ("train.trajectories_per_update", 0)):
        other = get_recipe("qwen3_8b")
        section, name = field.split(".")
        setattr(getattr(other, section), name, value)
        assert not overlaps(other), field
    assert not overlaps(get_recipe("tiny_cpu"))  # one step per batch: no old log-probs to run


def _deliver_a_streamed_chunk(dp):
    """A complete document's sequences (advantage 0: not known yet) through
    BatchDelivery's forward_only path, on `dp` ranks; each rank checks the routing of its share as
    compute_logprobs does first."""
    import types

    import numpy as np
    import torch.distributed as dist

    from recipes import get_recipe
    from spice_megatron.families import model_spec_from_hf
    from spice_megatron.loop.batch_delivery import BatchDelivery
    from spice_megatron.plan.known_models import KNOWN_MODELS
    from spice_megatron.policy.batching import TrainSequence
    from spice_megatron.policy.learner import Learner

    dist.init_process_group("gloo")
    cfg = get_recipe("glm4_5_air")
    spec = model_spec_from_hf(KNOWN_MODELS[cfg.run.model])
    learner = object.__new__(Learner)  # only what the routing paths read
    learner.spec, learner.train_cfg, learner.shared_prefix, learner.routing_replay = spec, cfg.train, False, True
    learner.layout = types.SimpleNamespace(dp=dp, dp_rank=dist.get_rank())
    rng = np.random.default_rng(0)

    def seq(role, n_prompt, n_out):
        routing = rng.integers(0, spec.moe.num_experts, (n_prompt + n_out - 1, spec.num_layers, spec.moe.top_k))
        return TrainSequence(list(range(1, n_prompt + 1)), list(range(n_out)), 0.0, [-0.1] * n_out, role, None,
                             routing.astype(np.uint8))

    chunk = [seq("challenger", 40, 12)] + [seq("reasoner", 20, 9) for _ in range(8)]
    delivered, _ = BatchDelivery(learner, dist.group.WORLD)(chunk if dist.get_rank() == 0 else None,
                                                             forward_only=True)
    learner._check_routing(delivered)  # raised before the fix: routing kept for one sequence per role
    mine = set(learner.data_parallel_split(delivered)[dist.get_rank()])
    return [i for i, x in enumerate(delivered) if x.routed_experts is not None], sorted(mine)


@pytest.mark.multiprocess
@pytest.mark.parametrize("dp", [1, 2])
def test_a_streamed_chunk_keeps_the_routing_of_every_sequence_its_forward_runs(dp, tmp_path):
    for kept, mine in run_ranks(_deliver_a_streamed_chunk, dp, dp, tmp_path=tmp_path):
        assert kept == mine and (dp == 2 or len(kept) == 9)
