"""tools/learning_check.py's pieces (the check itself runs for ~25-60 minutes: docs/learning.md)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))

import learning_check  # noqa: E402


def test_train_and_heldout_tasks_are_disjoint_and_valid(tmp_path):
    from spice_megatron.task_pool import TaskPool

    train, held = learning_check.make_tasks(7, 200)
    assert len(held) == 200 and len(train) > 250
    assert not {t["question"] for t in train} & {t["question"] for t in held}
    assert not {"What is 2 + 5?", "What is 3 times 4?"} & {t["question"] for t in train + held}  # the prompt's
    assert learning_check.make_tasks(7, 200) == (train, held)  # seeded
    path = learning_check._write_jsonl(str(tmp_path / "t.jsonl"), train)
    pool = TaskPool(path)
    assert len(pool.documents) == len(train) and not pool.skipped
    assert all(str(eval(t.task.question[8:-1].replace("times", "*"))) == t.task.answer for t in pool.documents)


def test_wilson_interval():
    lo, hi = learning_check.wilson(27, 200)
    assert lo == pytest.approx(9.46, abs=0.05) and hi == pytest.approx(18.94, abs=0.05)
    lo, hi = learning_check.wilson(0, 50)
    assert lo == pytest.approx(0.0, abs=1e-9) and 0 < hi < 10


def test_the_challenger_verdict_compares_the_last_third_with_the_control():
    from learning_check import challenger_verdict

    def run(name, rewards, frontier):
        return {"name": name, "challenger_reward": rewards, "frontier_share": frontier}

    control = run("control_a", [0.1, 0.1, 0.1, 0.1, 0.2, 0.1], [0.1] * 6)
    learned = run("trained_a", [0.1, 0.1, 0.2, 0.3, 0.4, 0.5], [0.1, 0.1, 0.1, 0.1, 0.1, 0.1])
    flat = run("trained_b", [0.1, 0.1, 0.1, 0.1, 0.1, 0.1], [0.1, 0.1, 0.1, 0.1, 0.1, 0.05])
    v = challenger_verdict([learned], control)
    assert v["learned"] and v["trained"][0]["challenger_reward"] == pytest.approx(0.45)
    assert v["control"]["challenger_reward"] == pytest.approx(0.15)
    assert not challenger_verdict([learned, flat], control)["learned"]  # every trained run must beat it
    assert not challenger_verdict([learned], None)["learned"]
    nan = float("nan")  # an iteration without the metric does not count
    assert challenger_verdict([run("t", [0.1, 0.1, 0.1, 0.1, 0.9, nan], [0.1] * 6)], control)["learned"]


def test_a_finished_run_is_reused_only_under_the_same_settings(tmp_path, capsys):
    settings = {"iterations": 4, "lr": 1e-5, "extra": ["selfplay.invalid_penalty=-0.5"]}
    assert learning_check._finished(str(tmp_path), "trained_b", settings) is None
    learning_check._keep(str(tmp_path), "trained_b", settings, {"after": 32.5})
    assert learning_check._finished(str(tmp_path), "trained_b", settings) == {"after": 32.5}
    assert learning_check._finished(str(tmp_path), "trained_b", {**settings, "lr": 2e-5}) is None
    assert "has other settings" in capsys.readouterr().out
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]  # written whole, then renamed


def test_story_task_curves_follow_the_gold_and_the_numbers_per_iteration(tmp_path):
    import json

    def task(iteration, doc, question, answer, valid=True):
        return {"kind": "challenger", "iteration": iteration, "doc_id": doc, "valid": valid,
                "task": {"question": question, "answer": answer, "answer_type": "integer"} if valid else None}

    rows = [{"kind": "document", "iteration": 0, "doc_id": "d1", "text": "Ann had 12 pens. She got 3 more. Now 15."},
            task(0, "d1", "Ann had 12 pens and got 3 more. How many?", "15"),  # right, numbers kept
            task(0, "d1", "Ann had 12 pens. How many now?", "15"),  # right, a number lost
            task(0, "d1", "Ann had 12 pens and got 3 more. How many?", "36"),  # computed wrong
            task(0, "d1", "", "", valid=False),  # invalid attempts do not count
            {"kind": "document", "iteration": 1, "doc_id": "d2", "text": "Bo filled 4 boxes of 5. So 20 in all."},
            task(1, "d2", "Bo filled 4 boxes of 5 each. How many in all?", "20")]
    path = tmp_path / "audit.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    curves = learning_check.story_task_curves(str(path))
    assert curves["gold_right"] == pytest.approx([2 / 3, 1.0])
    assert curves["numbers_kept"] == pytest.approx([2 / 3, 1.0])


def test_a_changed_prompt_or_recipe_does_not_reuse_kept_runs(tmp_path):
    prompts = tmp_path / "prompts"
    prompts.mkdir()
    (prompts / "reasoner.txt").write_text("Q: {question}\nA:")
    recipe = tmp_path / "tiny_cpu.py"
    recipe.write_text("ITERATIONS = 3\n")
    before = learning_check.content_hash([str(recipe), str(prompts)])
    settings = {"iterations": 4, "content": before}
    learning_check._keep(str(tmp_path), "trained_a", settings, {"accuracy": 40.0})
    assert learning_check._finished(str(tmp_path), "trained_a", settings) == {"accuracy": 40.0}
    (prompts / "reasoner.txt").write_text("Answer: {question}\n")
    after = learning_check.content_hash([str(recipe), str(prompts)])
    assert after != before
    assert learning_check._finished(str(tmp_path), "trained_a", {**settings, "content": after}) is None
    recipe.write_text("ITERATIONS = 4\n")
    assert learning_check.content_hash([str(recipe), str(prompts)]) not in (before, after)
