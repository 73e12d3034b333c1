import math

import pytest
import torch

from spice_megatron.selfplay.loss import center_by_group, drgrpo_token_loss, role_advantages


def test_role_advantages_are_centred_per_role_without_std():
    rewards = torch.tensor([1.0, 0.2, -0.1, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0], dtype=torch.float64)
    roles = ["challenger"] * 3 + ["reasoner"] * 6
    tasks = [-1, -1, -1, 0, 0, 0, 1, 1, 1]
    adv = role_advantages(rewards, roles, tasks)
    c_mean = (1.0 + 0.2 - 0.1) / 3
    expected = [1.0 - c_mean, 0.2 - c_mean, -0.1 - c_mean, 2 / 3, -1 / 3, -1 / 3, -2 / 3, 1 / 3, 1 / 3]
    assert adv.tolist() == pytest.approx(expected)


def test_role_advantages_validate_inputs():
    with pytest.raises(ValueError, match="roles"):
        role_advantages(torch.zeros(2), ["challenger", "critic"], [-1, 0])
    with pytest.raises(ValueError, match="same length"):
        role_advantages(torch.zeros(2), ["challenger"], [-1, 0])
    with pytest.raises(ValueError, match="groups: reasoner"):
        role_advantages(torch.zeros(1), ["reasoner"], [-1])


def test_challenger_advantages_are_centred_per_document():
    # two documents' challenger groups (0 and 1) and a reasoner group that reuses the id 0
    rewards = torch.tensor([1.0, -0.1, 0.8, 0.0, -0.1, 1.0, 0.0], dtype=torch.float64)
    roles = ["challenger"] * 5 + ["reasoner"] * 2
    groups = [0, 0, 1, 1, 1, 0, 0]
    adv = role_advantages(rewards, roles, groups).tolist()
    assert adv[:2] == pytest.approx([0.55, -0.55])
    assert adv[2:5] == pytest.approx([0.8 - 0.7 / 3, -0.7 / 3, -0.1 - 0.7 / 3])
    assert adv[5:] == pytest.approx([0.5, -0.5])  # not mixed with the challenger group 0


def test_center_by_group_single_group():
    assert center_by_group(torch.tensor([1.0, 3.0]), [7, 7]).tolist() == [-1.0, 1.0]


def test_on_policy_loss_hand_computed():
    # Two sequences, constant normaliser max_gen_len=4: loss = -(sum_t A_i * mask) / (4 * 2).
    logp = torch.tensor([[-1.0, -2.0, -0.5, 0.0], [-0.3, -0.7, 0.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    adv = torch.tensor([0.5, -1.0])
    loss, m = drgrpo_token_loss(logp, adv, mask, max_gen_len=4)
    assert loss.item() == pytest.approx(-(0.5 * 3 - 1.0 * 2) / 8)
    loss.backward()
    # d loss / d logp = -A / 8 on unmasked tokens: independent of each sequence's length.
    expected = torch.tensor([[-0.0625, -0.0625, -0.0625, 0.0], [0.125, 0.125, 0.0, 0.0]])
    assert torch.allclose(logp.grad, expected)
    assert m["tokens"].item() == 5 and m["ratio_mean"].item() == pytest.approx(1.0)


def test_clipped_loss_hand_computed():
    logp = torch.tensor([[math.log(1.5), math.log(0.5)]], requires_grad=True)
    old = torch.zeros(1, 2)
    mask = torch.ones(1, 2)
    # A > 0: ratio 1.5 is clipped to 1.2; ratio 0.5 keeps min(0.5, 0.8) * A = 0.5 A.
    loss, m = drgrpo_token_loss(logp, torch.tensor([2.0]), mask, max_gen_len=10, old_logprobs=old)
    assert loss.item() == pytest.approx(-(1.2 * 2 + 0.5 * 2) / 10)
    loss.backward()
    assert logp.grad[0, 0].item() == 0.0  # clipped token has no gradient
    assert logp.grad[0, 1].item() == pytest.approx(-0.5 * 2 / 10)
    assert m["clip_fraction"].item() == pytest.approx(0.5)


def test_global_normaliser_makes_microbatches_add_up():
    torch.manual_seed(0)
    logp = torch.randn(4, 6)
    mask = (torch.rand(4, 6) > 0.3).int()
    adv = torch.randn(4)
    whole, _ = drgrpo_token_loss(logp, adv, mask, 6)
    parts = sum(drgrpo_token_loss(logp[i:i + 2], adv[i:i + 2], mask[i:i + 2], 6, num_sequences=4)[0]
                for i in (0, 2))
    assert parts.item() == pytest.approx(whole.item())


def test_shape_errors_name_the_argument():
    with pytest.raises(ValueError, match="mask"):
        drgrpo_token_loss(torch.zeros(2, 3), torch.zeros(2), torch.zeros(2, 4), 3)
    with pytest.raises(ValueError, match="advantages"):
        drgrpo_token_loss(torch.zeros(2, 3), torch.zeros(3), torch.zeros(2, 3), 3)


def test_tis_weights_equal_the_direct_formula():
    from spice_megatron.selfplay.loss import tis_weights

    learner = torch.tensor([[-1.0, -2.0, -0.5, -3.0]])
    engine = torch.tensor([[-1.0, -2.5, -2.0, -2.9]])
    expected = [min(math.exp(a - b), 2.0) for a, b in zip(learner[0].tolist(), engine[0].tolist())]
    assert tis_weights(learner, engine, 2.0)[0].tolist() == pytest.approx(expected)
    assert expected[2] == 2.0 and expected[0] == 1.0  # capped; equal policies weigh 1


def test_tis_weights_each_token_of_the_loss():
    lp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    engine = torch.tensor([[-1.2, -2.0, -3.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, m = drgrpo_token_loss(lp, torch.tensor([0.5]), mask, max_gen_len=4, engine_logprobs=engine, tis_cap=2.0)
    w = [math.exp(0.2), 1.0]  # the third token is masked out
    assert loss.item() == pytest.approx(-(0.5 * w[0] + 0.5 * w[1]) / 4)
    loss.backward()
    assert lp.grad[0].tolist() == pytest.approx([-0.5 * w[0] / 4, -0.5 / 4, 0.0])
    assert m["tis_weight_mean"].item() == pytest.approx(sum(w) / 2)
    with pytest.raises(ValueError, match="engine's log-probs"):
        drgrpo_token_loss(lp, torch.tensor([0.5]), mask, 4, tis_cap=2.0)
