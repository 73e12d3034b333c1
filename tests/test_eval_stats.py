"""spice_megatron/eval/stats.py against figures known from the literature and by hand."""
import pytest

from spice_megatron.eval.stats import (
    binomial_tail,
    holm,
    mcnemar,
    obrien_fleming,
    random_effects,
    t_quantile,
    t_sf,
    wilson,
)


def test_intervals_and_tails():
    lo, hi = wilson(76, 300)
    assert (round(lo, 1), round(hi, 1)) == (20.7, 30.5)  # the learning check's base model
    assert binomial_tail(56, 92) == pytest.approx(0.0235, abs=1e-4)  # issue 73: fixed challenger, exact p
    assert t_quantile(0.975, 3) == pytest.approx(3.182, abs=1e-3) and t_sf(0.0, 5) == pytest.approx(0.5)


def test_mcnemar_counts_discordant_items_and_holm_steps_down():
    arm = [True, False, False, True, False]
    ref = [True, True, True, False, False]
    m = mcnemar(arm, ref)
    assert (m["only_arm"], m["only_reference"], m["diff"]) == (1, 2, pytest.approx(-20.0))
    assert m["p_reference_better"] == pytest.approx(0.5)  # 2 or more of 3 fair coins
    assert m["variance"] == pytest.approx(1e4 * (3 - 1 / 5) / 25)
    assert holm({"a": 0.01, "b": 0.04, "c": 0.03}) == {"a": 0.03, "c": 0.06, "b": 0.06}
    with pytest.raises(ValueError):
        mcnemar([True], [True, False])


def test_random_effects_widens_with_the_spread_between_seeds():
    alike = random_effects([-3.0, -3.1, -2.9, -3.0], [1.0] * 4)
    spread = random_effects([3.0, -6.0, 2.0, -5.0], [1.0] * 4)
    assert alike["tau2"] == 0 and alike["mean"] == pytest.approx(-3.0) and alike["df"] == 3
    assert spread["tau2"] > 10 and spread["se"] > 5 * alike["se"]


def test_obrien_fleming_bounds_match_the_published_ones():
    # Jennison & Turnbull, table 2.3: K = 3 equally spaced looks, two-sided 0.05 (one-sided 0.025)
    assert obrien_fleming((1 / 3, 2 / 3, 1.0)) == pytest.approx([3.471, 2.454, 2.004], abs=2e-3)
    assert obrien_fleming((1.0,)) == pytest.approx([1.960], abs=1e-3)
