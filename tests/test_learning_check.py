"""tools/checks/learning_check.py's pieces (the check itself runs for ~25-60 minutes: docs/learning.md)."""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "checks"))

import learning_check  # noqa: E402


def test_train_and_heldout_tasks_are_disjoint_and_valid(tmp_path):
    from spice_megatron.selfplay.task_pool import TaskPool

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


def _scored(values: list[float], frontier: list[float]) -> list[dict]:
    return [{"doc_id": f"heldout/{i}/0", "variance_reward": v, "frontier_share": f, "pass_rates": []}
            for i, (v, f) in enumerate(zip(values, frontier))]


def test_the_challenger_verdict_pools_every_seeds_stories_against_the_base_models_tasks():
    """Each trained run's last held-out evaluation against its own iteration 0 (the base model's
    tasks with the same sampling seeds: what a frozen control writes), paired per story; learned
    when the variance reward's gain pooled over the seeds is above 0, whatever one seed shows."""
    from learning_check import challenger_verdict

    runs = {"trained_a": {"seed": 1}, "trained_b": {"seed": 2}}
    base = _scored([0.2] * 12, [0.1] * 12)
    better = _scored([0.2 + 0.05 * (i % 3 + 1) for i in range(12)], [0.1] * 12)  # above on every document
    noisy = _scored([0.2 + (0.12 if i % 2 else -0.08) for i in range(12)], [0.1] * 12)  # +0.02, the CI spans 0
    scores = {"trained_a": {0: base, 4: better}, "trained_b": {0: base, 4: noisy}}
    v = challenger_verdict(runs, scores)
    diff, lo, hi = v["per_seed"]["trained_a"]["variance_reward"]
    assert diff == pytest.approx(0.1) and 0 < lo <= diff <= hi
    assert v["per_seed"]["trained_b"]["variance_reward"][1] < 0  # not shown on its own
    assert v["learned"]  # pooled over 24 stories: +0.06, above 0
    assert "pooled over 2 seed(s), 24 stories: variance reward +0.060" in v["line"]
    assert "trained_a (seed 1, iteration 4) variance reward 0.200 -> 0.300" in v["line"]
    scores["trained_a"][4] = _scored([0.2 + (0.3 if i % 2 else -0.3) for i in range(12)], [0.1] * 12)
    assert not challenger_verdict(runs, scores)["learned"]
    assert not challenger_verdict(runs, {})["learned"]  # nothing evaluated shows nothing


def test_held_out_challenger_tasks_are_scored_per_document_by_a_fixed_reasoner():
    from types import SimpleNamespace

    from spice_megatron.eval.challenger_eval import paired_bootstrap, score_tasks, summarise
    from spice_megatron.wire.types import Completion

    written = [{"doc_id": "d0", "tasks": [{"question": "2+2?", "answer": "4", "answer_type": "integer"}, None],
                "reasons": ["", "no answer tag"]},
               {"doc_id": "d1", "tasks": [{"question": "3+3?", "answer": "7", "answer_type": "integer"},
                                          {"question": "1+1?", "answer": "2", "answer_type": "integer"}],
                "reasons": ["", ""]}]
    answers = {"2+2?": ["4", "4", "5", "5"], "3+3?": ["6"] * 4, "1+1?": ["2"] * 4}

    def generate(prompts, spec):
        return [[Completion(f"\\boxed{{{a}}}", [1]) for a in answers[next(q for q in answers if q in p)]]
                for p in prompts]

    class Verifier:
        def verify_batch(self, items):
            return [pred == gold for pred, gold, _ in items]

    cfg = SimpleNamespace(template="plain", prompt_dir="", group_size=4, reasoner_temperature=0.5, top_p=1.0,
                          reasoner_max_tokens=8, reasoner_stop=[])
    scored = score_tasks(generate, written, None, cfg, Verifier(), seed=1, gold={"d0": "4", "d1": "6"}.get)
    assert [d["pass_rates"] for d in scored] == [[0.5, None], [0.0, 1.0]]
    assert scored[0]["valid_rate"] == 0.5 and scored[0]["frontier_share"] == 0.5 and scored[0]["gold_right"] == 0.5
    assert scored[1]["frontier_share"] == 0.0 and scored[1]["gold_right"] == 0.0
    assert scored[0]["variance_reward"] == pytest.approx(0.5)  # p = 0.5: reward 1, the invalid attempt 0
    summary = summarise(scored)
    assert summary["pass_rate_histogram"] == [1, 0, 0, 0, 0, 1, 0, 0, 0, 1] and summary["documents"] == 2
    assert paired_bootstrap([1.0, 2.0], [1.0, 2.0]) == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="paired"):
        paired_bootstrap([1.0], [])


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


# ----------------------------------------------------------------------------- --ablation

def test_the_ablation_pairs_arms_with_spice_on_the_same_items_and_words_its_verdicts(tmp_path):
    import learning_ablation as ab

    from spice_megatron.eval.run import items_file_name

    bench = f"file:{tmp_path}/heldout.jsonl:math"

    def write(run, iteration, correct):
        d = tmp_path / run / "eval" / f"iteration_{iteration:04d}"
        d.mkdir(parents=True)
        (d / items_file_name(bench)).write_text("".join(json.dumps({"id": f"q{i}", "correct": c}) + "\n"
                                                        for i, c in enumerate(correct)))

    spice = [True] * 30 + [False] * 70  # 30%
    write("spice_1", 2, [False] * 100)  # an earlier evaluation: not the last
    (tmp_path / "spice_1" / "eval" / "iteration_0004").mkdir()
    (tmp_path / "spice_1" / "eval" / "iteration_0004" / items_file_name(bench)).write_text(
        "".join(json.dumps({"id": f"q{i}", "correct": c}) + "\n" for i, c in enumerate(spice)))
    write("worse_1", 4, [True] * 10 + [False] * 90)  # 10%: every item spice missed it missed too
    iteration, items = ab.last_items(str(tmp_path / "spice_1"), bench)
    assert iteration == 4 and sum(r["correct"] for r in items) == 30
    # what a .done.json keeps: the comparisons and the challenger's scoring read no run directory
    (tmp_path / "spice_1" / "challenger_eval").mkdir()
    for it in (2, 4):
        (tmp_path / "spice_1" / "challenger_eval" / f"iteration_{it:04d}.json").write_text(
            json.dumps({"iteration": it, "documents": [{"doc_id": "d", "tasks": [f"task {it}"]}]}))
    kept = ab.kept_evaluation(str(tmp_path / "spice_1"), bench)
    assert kept["iteration"] == 4 and [r["correct"] for r in kept["items"]] == spice
    assert kept["challenger_tasks"]["iteration"] == 4
    import shutil
    shutil.rmtree(tmp_path / "spice_1" / "challenger_eval")
    assert learning_check._written_tasks(str(tmp_path), "spice_1", {"kept": kept}, last_only=True) == [
        kept["challenger_tasks"]]
    _, worse = ab.last_items(str(tmp_path / "worse_1"), bench)
    d, lo, hi = ab.paired_points(worse, items, seed=1)
    assert d == pytest.approx(-20.0) and lo < d < hi < 0
    assert ab.verdict(lo, hi) == "SPICE better"
    assert ab.verdict(-3.0, 4.0) == "no measurable difference" and ab.verdict(1.0, 9.0) == "arm better"
    assert ab.paired_points(items, items, seed=1) == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="different held-out items"):
        ab.paired_points(worse[:50], items, seed=1)
    run = {"seconds": 120.0}
    fig = ab.seed_figures(run, worse, items, 1)
    assert fig["accuracy"] == pytest.approx(10.0) and fig["ci"][0] < 10.0 < fig["ci"][1]
    pooled = ab.arm_summary("ungrounded", {1: fig, 2: ab.seed_figures(run, worse, items, 2)})
    assert pooled["verdict"] == "SPICE better" and pooled["diff"][0] == pytest.approx(-20.0)
    assert ab.verdict_line(pooled).startswith("ungrounded: SPICE better (held-out accuracy ungrounded - spice -20.0 "
                                              "points, 95% CI -")
    for f in (fig,):
        f.pop("item_correct"), f.pop("spice_item_correct")
    table = ab.markdown_table({"arms": {"spice": {"verdict": "reference", "seeds": [{**fig, "paired": (0, 0, 0)}]},
                                        "ungrounded": {"verdict": "SPICE better", "seeds": [fig],
                                                       "diff": pooled["diff"]}}})
    assert "| ungrounded | 1 | 10.0 (" in table and "| -20.0 (" in table and "SPICE better |" in table
    assert "| ungrounded | pooled | - | -20.0 (" in table


def test_a_stopped_check_stops_its_run_before_it_exits(tmp_path):
    """SIGTERM to the check (a scancel, a pytest timeout): the run it started gets SIGTERM and is
    waited for, so nothing it started outlives it."""
    import signal
    import subprocess
    import time

    tools = os.path.dirname(learning_check.__file__)
    pid_file = tmp_path / "run.pid"
    script = tmp_path / "check.py"
    run = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(300)"
    script.write_text(
        "import signal, sys\n"
        f"sys.path.insert(0, {tools!r})\n"
        "import learning_check\n"
        "signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))\n"
        f"with open({str(tmp_path / 'run.log')!r}, 'w') as log:\n"
        f"    learning_check.run_to_end([sys.executable, '-c', {run!r}], log)\n")
    check = subprocess.Popen([sys.executable, str(script)])
    deadline = time.monotonic() + 120
    while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.2)
    run_pid = int(pid_file.read_text())
    check.send_signal(signal.SIGTERM)
    assert check.wait(60) == 143
    with pytest.raises(ProcessLookupError):  # reaped by the check: gone, not a zombie
        os.kill(run_pid, 0)
