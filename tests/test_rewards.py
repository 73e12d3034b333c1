import pytest

from spice_megatron.selfplay.rewards import challenger_reward, reasoner_reward

# SPICE.md, worked values for K = 8.
WORKED = {0: 0.0439, 1: 0.3720, 2: 0.8226, 3: 0.9879, 4: 1.0, 5: 0.9879, 6: 0.8226, 7: 0.3720, 8: 0.0439}


@pytest.mark.parametrize("correct,expected", sorted(WORKED.items()))
def test_variance_reward_worked_values(correct, expected):
    outcomes = [True] * correct + [False] * (8 - correct)
    assert challenger_reward(outcomes) == pytest.approx(expected, abs=5e-5)


def test_invalid_task_gets_the_penalty_for_every_kind():
    for kind in ("variance", "absolute_zero", "threshold", "r_zero"):
        assert challenger_reward([], valid=False, kind=kind) == -0.1
    assert challenger_reward([], valid=False, invalid_penalty=-0.5) == -0.5


def test_absolute_zero():
    assert challenger_reward([True] * 2 + [False] * 6, kind="absolute_zero") == pytest.approx(0.75)
    assert challenger_reward([False] * 8, kind="absolute_zero") == 0.0
    assert challenger_reward([True] * 8, kind="absolute_zero") == 0.0  # as the reference code


def test_threshold():
    assert challenger_reward([True] + [False] * 7, kind="threshold") == 1.0
    assert challenger_reward([True] * 8, kind="threshold") == 0.0
    assert challenger_reward([False] * 8, kind="threshold") == 0.0


def test_r_zero_uses_the_answers():
    assert challenger_reward([], kind="r_zero", answers=["4"] * 4 + ["5"] * 4) == pytest.approx(1.0)
    assert challenger_reward([], kind="r_zero", answers=["4"] * 8) == pytest.approx(0.0)
    assert challenger_reward([], kind="r_zero", answers=["4"] * 6 + ["5", None]) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="answers"):
        challenger_reward([True, False], kind="r_zero")


def test_unknown_kind_and_reasoner_reward():
    with pytest.raises(ValueError, match="kind"):
        challenger_reward([True, False], kind="entropy")
    assert reasoner_reward(True) == 1.0 and reasoner_reward(False) == 0.0
