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


def test_a_finished_run_is_kept_with_every_evaluation_its_draws_and_its_last_challenger_tasks(tmp_path):
    """ablation_v2.kept_run: what the verdict reads of a run directory (per-item correctness at each
    evaluation through eval.run.evaluation_records, the documents the audit trail drew)."""
    import json

    from ablation_v2 import kept_run

    run = tmp_path / "spice"
    for it, right in ((0, {0}), (4, {0, 1}), (8, {0, 1, 2})):
        (run / "eval" / f"iteration_{it:04d}").mkdir(parents=True)
        (run / "eval" / f"iteration_{it:04d}" / "complement.jsonl.items.jsonl").write_text("".join(
            json.dumps({"id": f"q{i}", "correct": i in right}) + "\n" for i in range(4)))
    (run / "challenger_eval").mkdir()
    for it in (4, 8):
        (run / "challenger_eval" / f"iteration_{it:04d}.json").write_text(json.dumps({"iteration": it}))
    (run / "audit.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (
        {"kind": "document", "iteration": 1, "doc_id": "d2"}, {"kind": "reasoner", "iteration": 1},
        {"kind": "document", "iteration": 1, "doc_id": "d1"})))
    kept = kept_run(str(run), {"seconds": 60.0, "metrics": [{"iteration": 1, "valid_task_rate": 1.0}]})
    assert {it: sum(e.values()) for it, e in kept["evaluations"].items()} == {0: 1, 4: 2, 8: 3}
    assert kept["drawn"] == [(1, "d1"), (1, "d2")] and kept["kept"]["challenger_tasks"] == {"iteration": 8}
    assert kept["metrics"][0]["valid_task_rate"] == 1.0
