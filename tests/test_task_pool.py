"""selfplay.challenger=tasks: a task file stands in for the challenger; only the reasoner trains."""
import json
import random

import pytest

from spice_megatron.config import SelfPlayConfig, SpiceConfig
from spice_megatron.data.corpus import DocumentSampler
from spice_megatron.selfplay.iteration import run_fixed_tasks
from spice_megatron.selfplay.task_pool import TaskPool, TaskPoolError
from spice_megatron.wire.types import Completion


def _write(path, lines):
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return str(path)


def test_task_file_records_are_checked_and_bad_ones_counted(tmp_path):
    path = _write(tmp_path / "tasks.jsonl", [
        {"id": "t1", "question": "What is 2 + 3?", "answer": "5", "answer_type": "integer"},
        {"id": "t2", "question": "Which is a metal?", "answer": "c", "answer_type": "multiple_choice",
         "options": ["wood", "glass", "iron", "cloth"]},
        {"id": "t3", "question": "What is 7 - 2?", "answer": 5, "answer_type": "integer"},  # a JSON number is fine
        "{not json",
        {"id": "b1", "question": "", "answer": "1", "answer_type": "integer"},
        {"id": "b2", "question": "Q?", "answer": "1", "answer_type": "number"},
        {"id": "b3", "question": "Q?", "answer": "E", "answer_type": "multiple_choice", "options": ["a", "b"]},
        "", "[1, 2]"])
    pool = TaskPool(path)
    assert [t.doc_id for t in pool.documents] == ["tasks.jsonl/t1", "tasks.jsonl/t2", "tasks.jsonl/t3"]
    assert pool.documents[1].task.answer == "C" and pool.documents[2].task.answer == "5"
    assert sum(pool.skipped.values()) == 5
    assert any("question" in k for k in pool.skipped) and any("answer_type" in k for k in pool.skipped)
    # the corpus sampler draws from it and resumes exactly
    sampler = DocumentSampler(pool, seed=3)
    first = [t.doc_id for t in sampler.next_batch(2)]
    state = sampler.state_dict()
    rest = [t.doc_id for t in sampler.next_batch(4)]
    again = DocumentSampler(pool, seed=3)
    again.load_state_dict(state)
    assert [t.doc_id for t in again.next_batch(4)] == rest and len(first) == 2
    with pytest.raises(TaskPoolError, match="no usable task"):
        TaskPool(_write(tmp_path / "bad.jsonl", ["{}", "nope"]))


def test_only_the_reasoner_is_trained_on_file_tasks(tmp_path, verifier):
    pool = TaskPool(_write(tmp_path / "tasks.jsonl", [
        {"id": "a", "question": "What is 2 + 3?", "answer": "5", "answer_type": "integer"},
        {"id": "b", "question": "What is 4 + 4?", "answer": "8", "answer_type": "integer"}]))

    def generate(prompts, spec):
        assert spec.role == "reasoner" and spec.n == 4
        return [[Completion(f"\\boxed{{{5 if '2 + 3' in p else (8 if j < 1 else 9)}}}", [1, 2]) for j in range(4)]
                for p in prompts]

    cfg = SelfPlayConfig(batch_docs=2, group_size=4, template="qwen3", challenger="tasks",
                         tasks_file=str(tmp_path / "tasks.jsonl"))
    result = run_fixed_tasks(pool.documents, generate, verifier, cfg, rollout_version=2, iteration=1, seed=7)
    assert {s.role for s in result.samples} == {"reasoner"} and len(result.samples) == 8
    a = [s for s in result.samples if s.doc_id == "tasks.jsonl/a"]
    b = [s for s in result.samples if s.doc_id == "tasks.jsonl/b"]
    assert all(s.advantage == 0.0 for s in a)  # 4/4 right: no signal
    assert sorted(s.advantage for s in b) == pytest.approx([-0.25] * 3 + [0.75])
    assert "challenger_mode" not in result.stats and result.stats["challenger/samples"] == 0  # a setting
    assert result.stats["reasoner/pass_rate"] == pytest.approx(5 / 8)
    assert all(r["challenger_mode"] == "tasks" for r in result.records)
    tasks = [r for r in result.records if r["kind"] == "task"]
    assert [t["doc_id"] for t in tasks] == ["tasks.jsonl/a", "tasks.jsonl/b"] and tasks[1]["pass_rate"] == 0.25


def test_fixed_modes_are_validated(tmp_path):
    cfg = SpiceConfig()
    cfg.run.model = "m"
    from spice_megatron.config import ConfigError, SourceConfig

    cfg.corpus.sources = [SourceConfig(path="x.jsonl")]
    cfg.selfplay.challenger = "tasks"
    with pytest.raises(ConfigError, match="selfplay.tasks_file"):
        cfg.validate()
    cfg.selfplay.challenger = "model"
    with pytest.raises(ConfigError, match="selfplay.challenger_model"):
        cfg.validate()
    cfg.rollout.challenger_engines = ["http://10.0.0.1:8100"]
    cfg.validate()


def test_a_fixed_challenger_model_writes_tasks_that_are_not_trained(verifier):
    from test_selfplay import PaperScriptedModel, doc

    from spice_megatron.selfplay.iteration import run_iteration

    challenger, policy = PaperScriptedModel(), PaperScriptedModel()
    cfg = SelfPlayConfig(batch_docs=1, group_size=8, attempts_per_round=8, max_attempts=8, challenger="model",
                         challenger_model="/models/strong")
    result = run_iteration([doc(0, "PLAN[3/8]")], policy, verifier, cfg, random.Random(0),
                           challenger_generate=challenger)
    assert {s.role for s in result.samples} == {"reasoner"} and len(result.samples) == 8
    assert [c[0] for c in challenger.calls] == ["selection", "generation"]  # the fixed model wrote the tasks
    assert [c[0] for c in policy.calls] == ["reasoner"]  # the policy only answered them
    assert {r["challenger_mode"] for r in result.records if r["kind"] == "challenger"} == {"model"}
    assert not any(r["trained"] for r in result.records if r["kind"] == "challenger")
