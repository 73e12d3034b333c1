"""Intervals and tests for held-out accuracies: what the main job's summary and the learning checks
(tools/checks/) report."""
from __future__ import annotations

import functools
import math


def wilson(correct: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a proportion (95% by default), in percent."""
    if n == 0:
        return float("nan"), float("nan")
    p = correct / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return 100 * (centre - half), 100 * (centre + half)


def binomial_tail(k: int, n: int) -> float:
    """P(X >= k) for X ~ Binomial(n, 1/2), exactly."""
    return sum(math.comb(n, i) for i in range(max(k, 0), n + 1)) / 2 ** n if n else 1.0


def mcnemar(arm: list[bool], reference: list[bool]) -> dict:
    """Paired comparison of two evaluations of the same items (in the same order): the difference
    arm - reference in points with its McNemar variance, the discordant counts, and the exact
    one-sided p-value that the reference is better (the binomial test on discordant items)."""
    if len(arm) != len(reference) or not arm:
        raise ValueError("mcnemar: two evaluations of the same, non-empty list of items")
    n = len(arm)
    only_arm = sum(a and not r for a, r in zip(arm, reference))
    only_ref = sum(r and not a for a, r in zip(arm, reference))
    diff = 100.0 * (only_arm - only_ref) / n
    variance = 1e4 * ((only_arm + only_ref) - (only_arm - only_ref) ** 2 / n) / n ** 2
    return {"diff": diff, "variance": variance, "only_arm": only_arm, "only_reference": only_ref, "items": n,
            "p_reference_better": binomial_tail(only_ref, only_arm + only_ref)}


def holm(p_values: dict[str, float]) -> dict[str, float]:
    """Holm's step-down adjusted p-values (family-wise error across the given tests)."""
    order = sorted(p_values, key=p_values.get)
    adjusted, running = {}, 0.0
    for i, name in enumerate(order):
        running = max(running, min(1.0, (len(order) - i) * p_values[name]))
        adjusted[name] = running
    return adjusted


def t_sf(t: float, df: int) -> float:
    """P(T > t) for Student's t with df degrees of freedom."""
    import mpmath

    tail = 0.5 * float(mpmath.betainc(df / 2, 0.5, 0, df / (df + t * t), regularized=True))
    return tail if t >= 0 else 1.0 - tail


def t_quantile(q: float, df: int) -> float:
    """The q-quantile of Student's t (bisection on t_sf)."""
    lo, hi = -1e3, 1e3
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if 1.0 - t_sf(mid, df) < q else (lo, mid)
    return (lo + hi) / 2


def random_effects(estimates: list[float], variances: list[float]) -> dict:
    """Across seeds: DerSimonian-Laird between-seed variance, the weighted mean, and the
    Hartung-Knapp standard error with a t reference on k-1 degrees of freedom (seeds as a sample,
    not as fixed). Needs two or more estimates."""
    k = len(estimates)
    if k < 2 or len(variances) != k:
        raise ValueError("random_effects: two or more estimates, one variance each")
    v = [max(x, 1e-12) for x in variances]
    w = [1 / x for x in v]
    fixed = sum(wi * y for wi, y in zip(w, estimates)) / sum(w)
    q = sum(wi * (y - fixed) ** 2 for wi, y in zip(w, estimates))
    tau2 = max(0.0, (q - (k - 1)) / (sum(w) - sum(wi * wi for wi in w) / sum(w)))
    w = [1 / (x + tau2) for x in v]
    mean = sum(wi * y for wi, y in zip(w, estimates)) / sum(w)
    se = math.sqrt(sum(wi * (y - mean) ** 2 for wi, y in zip(w, estimates)) / ((k - 1) * sum(w)))
    return {"mean": mean, "se": se, "df": k - 1, "tau2": tau2, "seeds": k}


@functools.lru_cache(maxsize=32)  # a verdict asks for the same bounds once per arm and table
def obrien_fleming(fractions: tuple[float, ...], alpha: float = 0.025) -> list[float]:
    """One-sided O'Brien-Fleming boundaries (z-scale) for looks at these information fractions
    (increasing, the last 1): z_k = C / sqrt(t_k) with C such that the chance to cross any of
    them under no effect is `alpha` (the crossing probability by recursive integration of the
    score process, a Brownian motion)."""
    import numpy as np

    grid = np.linspace(-8.0, 8.0, 3201)
    step = grid[1] - grid[0]
    sds = [math.sqrt(t - p) for t, p in zip(fractions, [0.0, *fractions[:-1]])]
    first = np.exp(-0.5 * (grid / sds[0]) ** 2) / (sds[0] * math.sqrt(2 * math.pi))
    kernels = [np.exp(-0.5 * ((grid[:, None] - grid[None, :]) / sd) ** 2) / (sd * math.sqrt(2 * math.pi)) * step
               for sd in sds[1:]]

    def crossing(c: float) -> float:
        over = grid >= c  # B(t) >= C is z = B(t) / sqrt(t) >= C / sqrt(t)
        density, total = first, 0.0
        for k in range(len(fractions)):
            if k:
                density = kernels[k - 1] @ density
            total += float(density[over].sum() * step)
            density = np.where(over, 0.0, density)
        return total

    lo, hi = 0.5, 6.0
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if crossing(mid) > alpha else (lo, mid)
    c = (lo + hi) / 2
    return [c / math.sqrt(t) for t in fractions]
