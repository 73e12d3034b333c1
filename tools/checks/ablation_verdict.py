"""The verdict of ablation v2 (tools/checks/ablation_v2.py) over the seeds committed in
docs/data/ablation_v2/, the rule written before the runs:

- Per seed and arm: held-out accuracy at the last evaluation minus spice's on the seed's complement
  set, paired item by item, with its McNemar variance (eval/stats.py).
- Across seeds: a random-effects estimate (DerSimonian-Laird between-seed variance, Hartung-Knapp
  standard error, t with S-1 degrees of freedom): seeds are a sample, not fixed.
- One-sided in the paper's direction (SPICE better), Holm across the three arms, read at 4, 6 and 8
  seeds with O'Brien-Fleming bounds (information fraction S/8). An arm stops as "SPICE ahead" when
  it crosses its bound, or as "the paper's gap excluded" when its 90% interval lies above minus the
  paper's gap; at 8 seeds without either it is "undecided after 8 seeds" (before 4: not read).
"""
from __future__ import annotations

import glob
import json
import math
import os

from spice_megatron.eval.stats import mcnemar, obrien_fleming, random_effects, t_quantile, t_sf

# the paper's margins of SPICE over each comparison, in points (its Table 1 and Figure 4a)
PAPER_GAPS = {"fixed_challenger": 1.9, "absolute_zero": 4.2, "r_zero": 1.3}
LOOKS = (4, 6, 8)
ALPHA = 0.025  # one-sided, family-wise over the three arms (Holm)


def load_records(directory: str) -> list[dict]:
    records = []
    for path in sorted(glob.glob(os.path.join(directory, "seed_*.json"))):
        with open(path) as f:
            records.append(json.load(f))
    return records


def last_evaluation(run: dict) -> dict[str, bool]:
    evaluations = {int(k): v for k, v in run["evaluations"].items()}
    return evaluations[max(evaluations)]


def paired_tests(records: list[dict], arm: str) -> list[dict]:
    """Per seed that ran the arm: mcnemar(arm, spice) on the last evaluation's items."""
    tests = []
    for r in records:
        if arm not in r["runs"]:
            continue
        theirs, ours = last_evaluation(r["runs"][arm]), last_evaluation(r["runs"]["spice"])
        ids = sorted(ours)
        tests.append({"seed": r["seed"], **mcnemar([theirs[i] for i in ids], [ours[i] for i in ids])})
    return tests


def _normal_sf(z: float) -> float:
    return 0.5 * math.erfc(z / math.sqrt(2))


def arm_estimate(tests: list[dict]) -> dict:
    """The random-effects estimate of arm - spice over the seeds, its 90% interval and the one-sided
    p-value that SPICE is better (None with fewer than two seeds)."""
    if len(tests) < 2:
        return {}
    re = random_effects([t["diff"] for t in tests], [t["variance"] for t in tests])
    half = t_quantile(0.95, re["df"]) * re["se"]
    stat = re["mean"] / re["se"] if re["se"] > 0 else (-math.inf if re["mean"] < 0 else math.inf)
    return {**re, "low90": re["mean"] - half, "high90": re["mean"] + half, "p": 1.0 - t_sf(stat, re["df"])}


def verdicts(records: list[dict]) -> dict[str, dict]:
    """Every arm's estimate and verdict at the look the committed seeds reach."""
    tests = {arm: paired_tests(records, arm) for arm in PAPER_GAPS}
    arms = {arm: arm_estimate(t) for arm, t in tests.items()}
    seeds = min(len(t) for t in tests.values())
    looks = [s for s in LOOKS if s <= seeds]
    out = {arm: {**e, "verdict": f"not read yet: {seeds} seed(s) committed, the first look is at {LOOKS[0]}"}
           for arm, e in arms.items()}
    if not looks:
        return out
    look = len(looks) - 1
    still_open = True  # Holm: an arm may cross only while every arm with a smaller p-value did
    ranked = sorted((a for a in arms if arms[a]), key=lambda a: arms[a]["p"])
    for i, arm in enumerate(ranked):
        e = arms[arm]
        bound = obrien_fleming(tuple(s / LOOKS[-1] for s in LOOKS), ALPHA / (len(ranked) - i))[look]
        nominal = _normal_sf(bound)
        e["bound_p"] = nominal
        if still_open and e["p"] <= nominal:
            e["verdict"] = f"SPICE ahead (p {e['p']:.3g} <= {nominal:.3g} at {seeds} seeds)"
        else:
            still_open = False
            if e["low90"] > -PAPER_GAPS[arm]:
                e["verdict"] = f"the paper's gap excluded (90% CI above -{PAPER_GAPS[arm]} points)"
            elif seeds >= LOOKS[-1]:
                e["verdict"] = f"undecided after {seeds} seeds"
            else:
                e["verdict"] = f"undecided after {seeds} seeds (next look at {next(s for s in LOOKS if s > seeds)})"
        out[arm] = e
    return out


def markdown_table(directory: str) -> str:
    """docs/learning.md's ablation v2 table: every committed seed, per arm, and the verdict."""
    records = load_records(directory)
    if not records:
        return ("(no seed committed yet: `python tools/checks/ablation_v2.py --seed 1234`, then 4321, 777, 2025, "
                "..., committing docs/data/ablation_v2/seed_S.json as each finishes)")
    rows = ["| seed | minutes | complement items | base model | spice | fixed_challenger | absolute_zero | r_zero |",
            "|---|---|---|---|---|---|---|---|"]
    for r in records:
        spice = r["runs"]["spice"]
        base = spice["evaluations"].get("0") or spice["evaluations"].get(0)
        cells = [f"{100 * sum(base.values()) / len(base):.1f}%" if base else "-",
                 f"{100 * sum(last_evaluation(spice).values()) / len(last_evaluation(spice)):.1f}%"]
        for arm in PAPER_GAPS:
            t = next((t for t in paired_tests([r], arm)), None)
            cells.append(f"{t['diff']:+.1f} ({t['only_arm']} / {t['only_reference']})" if t else "-")
        rows.append(f"| {r['seed']} | {r['minutes']:.0f} | {r['complement_items']} | " + " | ".join(cells) + " |")
    rows += ["", "| arm | seeds | arm - spice, points (random effects) | 90% CI | one-sided p | verdict |",
             "|---|---|---|---|---|---|"]
    for arm, e in verdicts(records).items():
        if not e.get("seeds"):
            rows.append(f"| {arm} | {len(paired_tests(records, arm))} | - | - | - | {e['verdict']} |")
            continue
        rows.append(f"| {arm} | {e['seeds']} | {e['mean']:+.2f} | {e['low90']:+.2f} to {e['high90']:+.2f} | "
                    f"{e['p']:.3g} | {e['verdict']} |")
    return "\n".join(rows)
