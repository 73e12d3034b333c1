import pytest
import torch

from spice_megatron.policy.batching import (
    TrainSequence,
    collate,
    make_microbatches,
    plan_microbatches,
    split_data_parallel,
)


def test_collate_aligns_labels_and_completion_mask():
    mb = collate([TrainSequence([5, 6, 7], [8, 9], 0.5, [-0.1, -0.2]), TrainSequence([1], [2, 3, 4], -1.0)], [0, 1])
    assert mb.tokens.tolist() == [[5, 6, 7, 8, 9], [1, 2, 3, 4, 0]]
    assert mb.labels.tolist() == [[6, 7, 8, 9, 0], [2, 3, 4, 0, 0]]
    # position t predicts tokens[t+1]: the completion starts at the last prompt position
    assert mb.loss_mask.tolist() == [[0, 0, 1, 1, 0], [1, 1, 1, 0, 0]]
    assert mb.rollout_logprobs[0].tolist() == pytest.approx([0, 0, -0.1, -0.2, 0])
    assert mb.has_rollout.tolist() == [True, False] and mb.advantages.tolist() == [0.5, -1.0]
    assert mb.position_ids.tolist()[1] == [0, 1, 2, 3, 4] and mb.old_logprobs is None


def test_collate_rejects_misaligned_logprobs():
    with pytest.raises(ValueError, match="sequence 4: 1 rollout log-probs for 2 completion tokens"):
        collate([TrainSequence([1], [2, 3], 0.0, [-0.5])], [4])


def test_microbatches_respect_the_token_budget():
    lengths = [10, 3, 7, 9, 2, 2, 5]
    groups = plan_microbatches(list(range(7)), lengths, token_budget=20)
    assert sorted(i for g in groups for i in g) == list(range(7))
    assert all(max(lengths[i] for i in g) * len(g) <= 20 or len(g) == 1 for g in groups)
    assert groups[0] == [0, 3]  # longest first: 10 + 9 padded to 2 x 10


def test_data_parallel_split_balances_tokens():
    lengths = [10, 9, 8, 7, 1, 1]
    parts = split_data_parallel(lengths, 2)
    loads = [sum(lengths[i] for i in p) for p in parts]
    assert sorted(i for p in parts for i in p) == list(range(6)) and abs(loads[0] - loads[1]) <= 2


def test_a_rank_without_sequences_gets_a_masked_filler():
    seqs = [TrainSequence([1, 2], [3], 1.0)]
    (mb,) = make_microbatches(seqs, dp=2, dp_rank=1, token_budget=64)
    assert mb.index == [-1] and mb.loss_mask.sum().item() == 0
    (mine,) = make_microbatches(seqs, dp=2, dp_rank=0, token_budget=64)
    assert mine.index == [0] and torch.equal(mine.loss_mask, torch.tensor([[0.0, 1.0, 0.0]]))
