import os
import subprocess
import sys

import pytest

from spice_megatron.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_help_lists_subcommands():
    out = subprocess.run([sys.executable, "-m", "spice_megatron.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "prepare" in out.stdout and "corpus" in out.stdout


def test_corpus_from_explicit_source(tmp_path, capsys):
    src = tmp_path / "docs.jsonl"
    src.write_text('{"text": "The speed of light in vacuum is 299,792,458 metres per second exactly, by definition of '
                   'the metre. It was fixed in 1983, when the metre was redefined as the distance light travels in '
                   '1/299,792,458 of a second."}\n'
                   '{"oops": 1}\n')
    assert main(["corpus", "--source", str(src), "--show", "1"]) == 0
    assert '"doc_id": "docs/0/0"' in capsys.readouterr().out


def test_corpus_reports_missing_file(tmp_path, capsys):
    assert main(["corpus", "--source", str(tmp_path / "missing.jsonl")]) == 2
    assert "missing.jsonl" in capsys.readouterr().err


def test_audit_filters_records(tmp_path, capsys):
    import json

    rows = [{"kind": "challenger", "iteration": 0, "doc_id": "math/1/0", "rollout_version": 0, "valid": True,
             "trained": True, "task": {"question": "How many?"}, "reward": 0.8},
            {"kind": "reasoner", "iteration": 0, "doc_id": "math/1/0", "rollout_version": 0, "extracted": "4",
             "trained": True, "reward": 1.0},
            {"kind": "challenger", "iteration": 1, "doc_id": "wiki/2/0", "rollout_version": 1, "valid": False,
             "trained": False, "reason": "no_question"}]
    (tmp_path / "audit.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + "{torn\n")
    assert main(["audit", str(tmp_path), "--kind", "challenger", "--valid"]) == 0
    out = capsys.readouterr()
    assert "How many?" in out.out and "wiki/2/0" not in out.out and "not valid JSON" in out.err
    assert main(["audit", str(tmp_path), "--version", "1", "--full"]) == 0
    assert json.loads(capsys.readouterr().out)["reason"] == "no_question"


def test_a_bad_value_is_one_line_before_anything_starts(tmp_path):
    # into a directory of its own: the outcome must not depend on a run the main job left in runs/tiny_cpu
    out = subprocess.run([sys.executable, "-m", "spice_megatron.cli", "train", "--recipe", "tiny_cpu", "--model", ".",
                          "--output", str(tmp_path), "train.max_staleness=3"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip() == "error: train.max_staleness: must be 0 (on-policy) or 1 (one step off)", out.stderr
    assert out.stdout == ""


def test_megatron_start_up_dump_is_for_verbose_only():
    import logging

    from spice_megatron.cli import quiet_libraries

    quiet_libraries()
    assert logging.getLogger("megatron.core.distributed.param_and_grad_buffer").getEffectiveLevel() == logging.WARNING
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        quiet_libraries()
        warnings.warn("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.", UserWarning)
        warnings.warn("something else", UserWarning)
    assert [str(w.message) for w in caught] == ["something else"]


def test_audit_shows_a_task_with_its_document_and_answers(tmp_path, capsys):
    import json

    rows = [{"kind": "document", "iteration": 1, "doc_id": "stories/3/0", "rollout_version": 0,
             "text": "Gus had 5 cards. A friend gave Gus 8 more cards. Now Gus has 13 cards."},
            {"kind": "challenger", "iteration": 1, "doc_id": "stories/3/0", "rollout_version": 0, "valid": True,
             "trained": True, "reward": 0.5, "advantage": 0.25,
             "task": {"question": "Gus had 5 cards and got 8 more. How many now?", "answer": "13",
                      "answer_type": "integer"}},
            *[{"kind": "reasoner", "iteration": 1, "doc_id": "stories/3/0", "rollout_version": 0,
               "challenger_record": 1,
               "extracted": x, "correct": x == "13", "trained": True, "reward": float(x == "13"),
               "advantage": float(x == "13") - 0.5} for x in ("13", "12")]]
    (tmp_path / "audit.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["audit", str(tmp_path), "--trained"]) == 0
    out = capsys.readouterr().out
    assert "document: Gus had 5 cards." in out and "question: Gus had 5 cards and got 8 more" in out
    assert "gold:     13 (integer)" in out and "answers:  13+ 12-" in out and "pass=1/2" in out
    assert "reasoner (trained): 1/+0.50 0/-0.50" in out
    assert out.count("it=1") == 1  # the answers are inside the task's block, not repeated as lines


def test_a_printing_command_piped_into_head_ends_quietly(tmp_path):
    """`spice audit RUN --trained | head` ended in a BrokenPipeError traceback."""
    import json

    rows = [{"kind": "document", "iteration": 1, "doc_id": f"d{i}", "text": "x" * 2000} for i in range(3000)]
    (tmp_path / "audit.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = subprocess.run(f"{sys.executable} -m spice_megatron.cli audit {tmp_path} --full | head -n 1", shell=True,
                       capture_output=True, text=True, timeout=120)
    assert r.stdout.count("\n") == 1 and "Traceback" not in r.stderr and "BrokenPipe" not in r.stderr, r.stderr


def test_audit_leaks_shows_tasks_whose_answer_stands_in_the_question(tmp_path, capsys):
    import json

    def task(doc, question, answer, answer_type, options=()):
        return {"kind": "challenger", "iteration": 0, "doc_id": doc, "rollout_version": 0, "valid": True,
                "trained": True, "reward": 0.1, "advantage": 0.0,
                "task": {"question": question, "answer": answer, "answer_type": answer_type, "options": list(options)}}

    rows = [task("s/1/0", "Raj collected 21 apples. How many apples did Raj collect?", "21", "integer"),
            task("s/2/0", "Gus had 5 cards and got 8 more. How many now?", "13", "integer"),
            task("s/3/0", "Which metal?", "C", "multiple_choice", ("Tin", "Iron", "Lead", "Zinc Correct: C"))]
    (tmp_path / "audit.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["audit", str(tmp_path), "--leaks"]) == 0
    out = capsys.readouterr().out
    assert "s/1/0" in out and "s/3/0" in out and "s/2/0" not in out
    assert out.count("LEAK: the answer can be read off the question") == 2


def test_a_document_read_again_is_stored_once_and_shown_with_its_text(tmp_path, capsys):
    """The trail holds a document's text with its first record only (a paper run rereads documents);
    `spice audit` shows it for every reading, and a resumed run goes on from the trail's hashes."""
    import json

    from spice_megatron.run.audit import compact_documents, written_document_hashes
    from spice_megatron.run.log import read_jsonl

    text = "Gus had 5 cards. A friend gave Gus 8 more cards. Now Gus has 13 cards."

    def iteration(i):
        return [{"kind": "document", "iteration": i, "doc_id": "stories/3/0", "doc_sha256": "abc", "rollout_version": 0,
                 "text": text},
                {"kind": "challenger", "iteration": i, "doc_id": "stories/3/0", "rollout_version": 0, "valid": True,
                 "trained": True, "reward": 0.5, "advantage": 0.25,
                 "task": {"question": f"Question {i}?", "answer": "13", "answer_type": "integer"}}]

    written: set[str] = set()
    path = tmp_path / "audit.jsonl"
    with open(path, "w") as f:
        for i in (1, 2, 3):
            f.write("".join(json.dumps(r) + "\n" for r in compact_documents(iteration(i), written)))
    stored = [r for r in read_jsonl(str(path)) if r["kind"] == "document"]
    assert ["text" in r for r in stored] == [True, False, False] and path.read_text().count(text) == 1
    assert written_document_hashes(read_jsonl(str(path))) == {"abc"}
    assert main(["audit", str(tmp_path), "--valid"]) == 0
    assert capsys.readouterr().out.count("document: Gus had 5 cards.") == 3


def test_plan_takes_the_cpu_recipes_and_names_the_answer_when_a_layout_does_not_fit(capsys):
    """`spice plan --recipe tiny_cpu` failed (its model is filled in at
    train time); a recipe too big for the nodes asked about said what the recipe already had. A CPU
    recipe is planned on GPUs only when asked for them (F1: without, it planned the demo on 8 GPUs)."""
    for recipe in ("tiny_cpu", "tiny_cpu_deepseek"):
        assert main(["plan", "--recipe", recipe, "--gpus-per-node", "8"]) == 0
        assert "tokens/s/GPU" in capsys.readouterr().out
        assert main(["plan", "--recipe", recipe]) == 2
        assert "runs on one machine without a GPU: there is no layout to plan" in capsys.readouterr().err
    assert main(["plan", "--recipe", "qwen3_8b", "--nodes", "1"]) == 2
    assert capsys.readouterr().err.strip().endswith("on one node: --recipe qwen3_8b_1node (learner and engines "
                                                    "colocated), or --choose")
    assert main(["plan", "--recipe", "qwen3_32b", "--nodes", "1", "--gpu-memory-gib", "24"]) == 2
    assert capsys.readouterr().err.strip().endswith("spice plan --recipe qwen3_32b --nodes 1 --choose")


def test_audit_says_when_an_iteration_or_kind_is_not_in_the_run_and_counts_iterations_from_1(tmp_path, capsys):
    """`spice audit RUN --iteration 3` printed nothing, exit 0, and the
    trail counted iterations from 0 where the metrics count from 1; a trail written so is read
    shifted (its first record says iteration 0)."""
    import json

    for first, name in ((1, "new"), (0, "old")):
        run = tmp_path / name
        run.mkdir()
        rows = [{"kind": "document", "iteration": first + i, "doc_id": f"d{i + 1}"} for i in range(3)]
        (run / "audit.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        assert main(["audit", str(run), "--iteration", "4"]) == 1
        assert "--iteration 4 (this run's audit has iterations 1-3)" in capsys.readouterr().err
        assert main(["audit", str(run), "--kind", "task"]) == 1
        assert "--kind task (this run's records are document)" in capsys.readouterr().err
        assert main(["audit", str(run), "--iteration", "3"]) == 0
        out = capsys.readouterr().out
        assert "it=3 " in out and "d3" in out and "d2" not in out


def test_every_command_says_its_options_alike_with_their_defaults_and_plans_every_recipe(capsys):
    """One spelling per option (--output, --data, --model, --recipe) with
    the older ones still taken, defaults and recipe names in --help; `spice plan` for every recipe."""
    from recipes import DEFAULT_RECIPE, recipe_names
    from spice_megatron.cli import build_parser

    commands = build_parser()._subparsers._group_actions[0].choices
    for name in commands:
        if name == "launch":
            continue
        with pytest.raises(SystemExit) as e:
            main([name, "--help"] if name != "convert" else [name, "to-hf", "--help"])
        assert e.value.code == 0
        text = capsys.readouterr().out
        for old in ("--output-dir", "--out ", "--save", "--eval-data", "--ckpt", "--hf "):
            assert old not in text, (name, old)
        if name in ("train", "coevolution"):
            assert f"(default: {DEFAULT_RECIPE}" in text and "qwen3_8b_1node" in text, name
    with pytest.raises(SystemExit):
        main(["launch", "--help"])
    launch = capsys.readouterr().out  # the same metavars as every other command
    assert "--output OUTPUT" in launch and "--model MODEL" in launch and "--data DATA" in launch
    assert "_DIR" not in launch.split("options:")[0] and "Launch a recipe's SPICE run" in launch
    parser = build_parser()
    for argv, dest, value in ((["train", "--output-dir", "r"], "output", "r"), (["train", "--eval-data", "d"], "data",
                                                                                "d"),
                              (["prepare", "--out", "d"], "data", "d"), (["curves", "r", "--out", "p"], "output", "p"),
                              (["corpus", "--save", "p"], "output", "p"),
                              (["eval", "--model", "m", "--source", "hub"], "benchmark_source", "hub"),
                              (["convert", "to-hf", "--ckpt", "c", "--out", "o"], "model", "c")):
        assert getattr(parser.parse_args(argv), dest) == value, argv
    from recipes import CPU_RECIPES

    for recipe in recipe_names():  # a CPU recipe is one line, not a plan on eight GPUs
        assert main(["plan", "--recipe", recipe]) == (2 if recipe in CPU_RECIPES else 0), recipe
    assert main(["plan", "--recipe", "tiny_cpu", "--gpus-per-node", "8"]) == 0
    assert "tokens/s/GPU" in capsys.readouterr().out


def test_a_near_miss_gets_the_one_close_match(capsys):
    """No "did you mean" for a recipe, an override field or a command."""
    from spice_megatron.cli import main

    for argv, want in ((["train", "--recipe", "tiny-cpu"], "--recipe 'tiny-cpu' is unknown, did you mean tiny_cpu?"),
                       (["train", "train.max_stalenes=1"], "train.max_stalenes: no such config field, did you mean "
                                                             "train.max_staleness?"),
                       (["train", "iterations=5"], "iterations: no such config field, did you mean run.iterations?"),
                       (["plan", "run.iteratons=5"], "did you mean run.iterations?")):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert want in err and err.count("\n") == 1, (argv, err)
    with pytest.raises(SystemExit) as e:
        main(["trian"])
    assert e.value.code == 2 and capsys.readouterr().err.strip().endswith("did you mean train?")


def test_spice_says_its_version_and_a_failed_start_leaves_no_run_directory(tmp_path, capsys):
    """`spice --version` was unknown, and a refused start left an empty run directory."""
    from spice_megatron.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("spice-megatron ")
    out = tmp_path / "run"
    assert main(["train", "--model", str(tmp_path / "nope"), "--output", str(out)]) == 2
    assert "run.model" in capsys.readouterr().err and not out.exists()


def test_the_summary_prints_counts_as_integers_and_small_values_with_their_digits():
    """A count printed as 3.0000, a log-prob gap of 1.87e-06 as 0.0000."""
    from spice_megatron.cli.train import shown

    assert [shown(v) for v in (3.0, 3, 1.87e-06, 0.0, 0.39123, -2.5e-05, 12.5)] == [
        "3", "3", "1.87e-06", "0", "0.3912", "-2.5e-05", "12.5000"]


def test_the_job_script_run_by_hand_or_without_its_settings_is_one_spice_line():
    """`bash slurm/spice_8b.sbatch` ended in `!name: unbound variable`, exit 1."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MODEL_DIR"))}
    r = subprocess.run(["bash", os.path.join(ROOT, "slurm", "spice_8b.sbatch")], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr == ("spice: SLURM_JOB_ID is unset: submit this file with sbatch (or try it "
                                              "on tools/env/slurm_box.sh)\n")
    r = subprocess.run(["bash", os.path.join(ROOT, "slurm", "spice_8b.sbatch")], env={**env, "SLURM_JOB_ID": "7"},
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.startswith("spice: set MODEL_DIR to the HF directory")


def test_audit_filters_that_match_nothing_say_so_like_the_iteration_filter(tmp_path, capsys):
    """`--version 3`, `--doc nope` (and filters that match nothing together)
    printed nothing and exited 0, where `--iteration 4` named what the run has."""
    import json

    # a trail written before the generating version was named rollout_version (F3) reads the same
    rows = [{"kind": "challenger", "iteration": 1, "doc_id": "stories/1/0", "weights_version": 0, "valid": False},
            {"kind": "challenger", "iteration": 2, "doc_id": "stories/2/0", "rollout_version": 1, "valid": False}]
    (tmp_path / "audit.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["audit", str(tmp_path), "--version", "3"]) == 1
    assert "--version 3 (this run's records were generated by policy versions 0-1)" in capsys.readouterr().err
    assert main(["audit", str(tmp_path), "--version", "0"]) == 0 and "v=0 challenger" in capsys.readouterr().out
    assert main(["audit", str(tmp_path), "--doc", "nope"]) == 1
    assert "--doc nope (no record of this run names it" in capsys.readouterr().err
    assert main(["audit", str(tmp_path), "--valid"]) == 1
    assert capsys.readouterr().err.strip() == "no record matches these filters together"


def test_every_option_of_every_command_says_what_it_is():
    """About 20 of spice's options printed no description."""
    import argparse

    from spice_megatron.cli import build_parser

    parser = build_parser()
    silent = [("spice", a.option_strings) for a in parser._actions
              if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)) and not a.help]
    for name, sub in parser._subparsers._group_actions[0].choices.items():
        silent += [(name, a.option_strings or a.dest) for a in sub._actions
                   if not isinstance(a, argparse._HelpAction) and a.help in (None, "", "(default: %(default)s)")]
    assert not silent, silent
    # F13: `spice corpus --max-docs 10` read the whole corpus first, which its help did not say
    corpus = parser._subparsers._group_actions[0].choices["corpus"]
    (max_docs,) = [a for a in corpus._actions if "--max-docs" in a.option_strings]
    assert "every source is read and segmented first" in max_docs.help


def test_the_converter_wrappers_answer_like_spice_in_one_line():
    """Tools/convert_to_hf.py printed 8 lines of megatron's import warnings before
    its error line, where `spice convert to-hf` printed the line alone."""
    for tool, argv in (("convert_to_hf.py", ["--ckpt", "x", "--out", "y"]),
                       ("convert_from_hf.py", ["--hf", "x", "--out", "y"])):
        env = {k: v for k, v in os.environ.items() if k != "SPICE_DEBUG"}
        r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", tool), *argv], capture_output=True, text=True,
                           timeout=120, env=env)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and r.stderr.startswith("error: "), (tool, r.stderr)


def test_choose_says_where_its_layout_stands_in_the_ranking():
    """`--choose --rank 5` recommended the third of its own ranking (14% slower
    than the first) without saying so."""
    from spice_megatron.plan.report import choice_in_ranking

    ranked = [("a", {"tokens_per_s_per_gpu": 1526.0}), ("b", {"tokens_per_s_per_gpu": 1380.0}),
              ("c", {"tokens_per_s_per_gpu": 1336.0})]
    assert choice_in_ranking("a", ranked) == "--choose's layout is the fastest of the ranking (#1)"
    line = choice_in_ranking("c", ranked)
    assert line.startswith("--choose's layout is #3 of the ranking, 12% below #1: --choose takes the first layout")
    assert "not the fastest planned" in choice_in_ranking("z", ranked)


def test_audit_lines_print_rewards_and_advantages_with_three_decimals():
    """Challenger advantages came with 16 decimals (-0.4079527002175556), the
    task blocks' with 3."""
    from spice_megatron.run.audit import one_line

    line = one_line({"iteration": 1, "rollout_version": 0, "kind": "challenger", "doc_id": "stories/1/0",
                     "reward": -0.5, "advantage": -0.4079527002175556, "reason": "no_question"})
    assert "reward=-0.500 adv=-0.408 ::" in line
    assert "reward=- adv=- ::" in one_line({"iteration": 1, "kind": "document", "doc_id": "d"})
