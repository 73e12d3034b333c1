"""The metrics contract (metric_names.py): one glossary for every name a run writes."""
import glob
import json
import re

from spice_megatron.metric_names import (
    CURVES,
    METRICS,
    RENAMED,
    SUMMARY,
    current_names,
    declared_names,
    describe,
    run_kinds,
    twins,
)
from spice_megatron.tasks import INVALID_REASONS


def test_every_name_is_described_once_and_no_two_differ_by_a_separator():
    names = [m.name for m in METRICS]
    assert len(names) == len(set(names))
    assert twins(names) == []
    assert all(m.meaning and m.unit and m.group for m in METRICS)
    for name in [*SUMMARY, *(k for _, keys in CURVES for k in keys)]:
        assert describe(name) is not None, name
    assert all(describe(new) is not None for new in RENAMED.values())
    assert describe("mix/integer").name == "mix/{answer_type}" and describe("router/x") is None
    assert describe("train/router/max_load/3").only == "moe"


def test_every_invalid_reason_the_code_gives_is_declared():
    given = set()
    for path in glob.glob("spice_megatron/**/*.py", recursive=True):
        given |= set(re.findall(r'ParseResult\(None, "(\w+)"', open(path).read()))
    assert given == set(INVALID_REASONS)


def test_declared_names_follow_the_run_and_old_names_read_as_new():
    from recipes import resolve_recipe

    cfg = resolve_recipe("tiny_cpu", ["run.eval_every=0"])
    plain = declared_names(cfg.selfplay.group_size, run_kinds(cfg))
    assert "pass_hist/%d" % cfg.selfplay.group_size in plain and "invalid/answer_leak" in plain
    assert "time/eval" not in plain and "time/engines_sleep" not in plain
    cfg = resolve_recipe("tiny_cpu", ["run.eval_every=2", "run.colocate=true"])
    kinds = run_kinds(cfg)
    assert {"eval", "colocate"} <= kinds and "time/eval" in declared_names(4, kinds)
    assert current_names({"reasoner_pass_rate": 0.5, "challenger_mode": "self", "x": 1}) == {
        "reasoner/pass_rate": 0.5, "x": 1}


def test_every_row_carries_the_same_names(tmp_path):
    from spice_megatron.run.log import MetricsLogger

    log = MetricsLogger(str(tmp_path), declared=["valid_task_rate", "time/eval"])
    log.log(1, {"valid_task_rate": 0.5})
    log.log(2, {"valid_task_rate": 0.7, "time/eval": 3.0, "eval/gsm8k": 0.25})
    log.close()
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert rows[0] == {"iteration": 1, "valid_task_rate": 0.5, "time/eval": None}
    assert rows[1] == {"iteration": 2, "valid_task_rate": 0.7, "time/eval": 3.0, "eval/gsm8k": 0.25}
    resumed = MetricsLogger(str(tmp_path), resume_at=(tmp_path / "metrics.jsonl").stat().st_size)
    resumed.log(3, {"valid_task_rate": 0.9})  # a benchmark first measured before the resume is carried on
    resumed.close()
    last = json.loads(open(tmp_path / "metrics.jsonl").read().splitlines()[-1])
    assert last == {"iteration": 3, "valid_task_rate": 0.9, "time/eval": None, "eval/gsm8k": None}
    # TensorBoard's tags are the JSONL's names: one spelling to search for
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {"valid_task_rate", "time/eval", "eval/gsm8k"}
