"""tools/checks/ablation_verdict.py: the rule issue 73 wrote before the runs, on made-up seeds."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "checks"))

from ablation_verdict import markdown_table, verdicts  # noqa: E402


def _items(right: set[int], n: int = 1000) -> dict[str, bool]:
    return {f"story-{i}": i in right for i in range(n)}


def _seed(seed: int, r_zero_diff: int) -> dict:
    spice = set(range(400))
    runs = {"spice": {"evaluations": {"0": _items(set(range(250))), "8": _items(spice)}},
            "fixed_challenger": {"evaluations": {"8": _items(set(range(300)))}},  # 10 points behind every seed
            "absolute_zero": {"evaluations": {"8": _items(set(range(10, 410)))}},  # level: 10 items each way
            "r_zero": {"evaluations": {"8": _items(set(range(400 + 10 * r_zero_diff)))}}}
    return {"seed": seed, "minutes": 70.0, "complement_items": 1000, "runs": runs}


def test_the_verdict_reads_each_arm_at_the_look_the_seeds_reach():
    records = [_seed(1, 3), _seed(2, -6), _seed(3, 2), _seed(4, -5)]
    v = verdicts(records[:1])
    assert all(e["verdict"].startswith("not read yet: 1 seed(s) committed") for e in v.values())
    v = verdicts(records)
    assert v["fixed_challenger"]["verdict"].startswith("SPICE ahead") and v["fixed_challenger"]["mean"] == -10
    assert v["absolute_zero"]["verdict"] == "the paper's gap excluded (90% CI above -4.2 points)"
    assert v["r_zero"]["verdict"] == "undecided after 4 seeds (next look at 6)"
    table = markdown_table_from(records)
    assert "| 1 | 70 | 1000 | 25.0% | 40.0% | -10.0 (0 / 100) | +0.0 (10 / 10) | +3.0 (30 / 0) |" in table


def markdown_table_from(records: list[dict]) -> str:
    import json
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        for r in records:
            with open(os.path.join(d, f"seed_{r['seed']}.json"), "w") as f:
                json.dump(r, f)
        return markdown_table(d)
