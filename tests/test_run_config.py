"""RUN/config.json (run/config_file.py): written at the start, compared on --resume."""
import json

import pytest

from spice_megatron.entry import UserError
from spice_megatron.run.config_file import record_run_config


def test_a_resume_with_another_config_is_refused_naming_the_field_unless_forced(tmp_path):
    from recipes import resolve_recipe

    def cfg(*overrides):
        c = resolve_recipe("tiny_cpu", list(overrides))
        c.run.output_dir, c.run.model = str(tmp_path / "run"), "/models/m"
        return c

    line = record_run_config(cfg("optim.lr=1e-3"), "tiny_cpu", ["optim.lr=1e-3"], resume=False)
    assert line == f"config: {tmp_path}/run/config.json (recipe tiny_cpu; overrides: optim.lr=1e-3)"
    written = json.load(open(tmp_path / "run" / "config.json"))
    assert written["recipe"] == "tiny_cpu" and written["config"]["optim"]["lr"] == 1e-3
    # more iterations, other engine addresses, how many checkpoints are kept, the kill switch's
    # thresholds: a resume may change those
    keep = ["optim.lr=1e-3", "run.iterations=9", "run.keep_last=5", "run.patience=1", "run.min_valid_task_rate=0.5"]
    c = cfg(*keep)
    c.rollout.engines = ["http://node7:8100"]
    assert record_run_config(c, "tiny_cpu", keep, resume=True).endswith(f"overrides: {' '.join(keep)})")
    with pytest.raises(UserError, match=r"the config differs from the run's .*: optim.lr: 0.001 -> 0.002; .*"
                                        "--force-config"):
        record_run_config(cfg("optim.lr=2e-3"), "tiny_cpu", ["optim.lr=2e-3"], resume=True)
    line = record_run_config(cfg("optim.lr=2e-3"), "tiny_cpu", ["optim.lr=2e-3"], resume=True, force=True)
    assert line.endswith("1 changed value(s) accepted (--force-config))")
    assert json.load(open(tmp_path / "run" / "config.json"))["config"]["optim"]["lr"] == 2e-3
    (tmp_path / "run" / "config.json").write_text("{torn")
    with pytest.raises(UserError, match="config.json: unreadable"):
        record_run_config(cfg(), "tiny_cpu", [], resume=True)


def _recorded_run(tmp_path, overrides=("run.iterations=2",)):
    """A run directory as `spice train --recipe tiny_cpu` leaves it: config.json, a checkpoint, a metrics row."""
    import json

    from recipes import resolve_recipe
    from spice_megatron.run.config_file import record_run_config

    run = tmp_path / "run"
    cfg = resolve_recipe("tiny_cpu", list(overrides))
    cfg.run.output_dir = str(run)
    cfg.run.model = str(tmp_path / "model")
    record_run_config(cfg, "tiny_cpu", list(overrides), resume=False)
    (run / "checkpoints" / "step_00000002").mkdir(parents=True)
    (run / "metrics.jsonl").write_text(json.dumps({"iteration": 1}) + "\n" + json.dumps({"iteration": 2}) + "\n")
    return run


def test_a_second_start_into_a_run_directory_refuses_and_touches_nothing(tmp_path):
    """`spice train` into a directory holding a run, without --resume, started over
    silently (config.json overwritten, the logs renamed aside, the old checkpoints left until
    overwritten). Now one line naming what is there and the two ways on, exit 2, before anything loads."""
    import subprocess
    import sys

    run = _recorded_run(tmp_path)
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    r = subprocess.run([sys.executable, "-m", "spice_megatron.cli", "train", "--recipe", "tiny_cpu", "--output",
                        str(run), "--model", str(tmp_path / "model")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert (f"error: {run} holds a run (recipe tiny_cpu, 2 iteration(s) logged, checkpoint step_00000002); nothing "
            "was touched: --resume to continue it, or another --output") in r.stderr
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


def test_a_resume_takes_the_runs_recipe_and_overrides_and_compares_new_ones_first(tmp_path):
    """--resume made the user retype the recipe and every override (else tiny_cpu's
    defaults were assumed), and the comparison came after 33 s of start-up. `spice train --resume
    --output RUN` takes RUN/config.json's recipe and overrides; a new override is compared before any
    model or data is loaded, every differing field named, unless --force-config."""
    import subprocess
    import sys

    run = _recorded_run(tmp_path, ("run.iterations=2", "selfplay.group_size=4"))
    r = subprocess.run([sys.executable, "-m", "spice_megatron.cli", "train", "--resume", "--output", str(run),
                        "selfplay.group_size=2", "optim.lr=0.5"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "--resume: the config differs from the run's" in r.stderr
    assert "optim.lr: " in r.stderr and "-> 0.5" in r.stderr and "selfplay.group_size: 4 -> 2" in r.stderr
    from spice_megatron.run.config_file import recorded_run, refuse_changed_config

    recorded = recorded_run(str(run))
    assert (recorded["recipe"], recorded["overrides"]) == ("tiny_cpu", ["run.iterations=2", "selfplay.group_size=4"])
    from recipes import resolve_recipe

    same = resolve_recipe(recorded["recipe"], recorded["overrides"] + ["run.iterations=5"])  # a resume may go on longer
    same.run.output_dir = str(run)
    refuse_changed_config(same, force=False)  # what cmd_train runs before anything loads: nothing to refuse


def test_a_resume_takes_the_runs_evaluation_options_unless_the_command_line_gives_its_own(tmp_path):
    """The command line's options that are no config field (the evaluations, the corpus) went missing on
    `spice train --resume --output RUN`: the main job resumed so evaluated nothing and its summary had no
    held-out line. config.json records them and a resume takes them back, saying so, where its command
    line leaves one at its default."""
    import argparse
    import subprocess
    import sys

    from recipes import resolve_recipe
    from spice_megatron.cli.train import RUN_OPTIONS, _take_the_runs_options
    from spice_megatron.run.config_file import recorded_run

    run = tmp_path / "run"
    cfg = resolve_recipe("tiny_cpu", [])
    cfg.run.output_dir, cfg.run.model = str(run), str(tmp_path / "model")
    options = {**RUN_OPTIONS, "eval_benchmarks": "stories", "eval_limit": 200}
    record_run_config(cfg, "tiny_cpu", [], resume=False, options=options)
    assert recorded_run(str(run))["options"] == options
    args = argparse.Namespace(**{**RUN_OPTIONS, "eval_limit": 50})  # the command line's own limit stays
    _take_the_runs_options(args, options, say=False)
    assert (args.eval_benchmarks, args.eval_limit, args.corpus) == ("stories", 50, None)
    # through `spice train`: said before the refusal of a changed override, which comes before anything loads
    r = subprocess.run([sys.executable, "-m", "spice_megatron.cli", "train", "--resume", "--output", str(run),
                        "optim.lr=0.5"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "optim.lr: " in r.stderr, r.stderr
    assert "resume: the run's options: --eval-benchmarks stories --eval-limit 200" in r.stdout


def test_the_main_job_called_again_keeps_the_first_run_under_a_new_name_and_says_so(tmp_path):
    """The README's main job (tools/env/run_main.sh) run a second time started over
    in runs/tiny_cpu. Now it keeps the first run as runs/tiny_cpu.1 (then .2 ...) and says so; with
    --resume it continues the run in place. Run on a copy of the script with stand-ins for the setup
    and for `spice`, which record what they were asked."""
    import os
    import shutil
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    repo = tmp_path / "repo"
    (repo / "tools" / "env").mkdir(parents=True)
    shutil.copy(os.path.join(root, "tools", "env", "run_main.sh"), repo / "tools" / "env" / "run_main.sh")
    (repo / "tools" / "env" / "setup_cpu_env.sh").write_text("exit 0\n")
    (repo / ".venv" / "bin").mkdir(parents=True)
    spice = repo / ".venv" / "bin" / "spice"
    spice.write_text('#!/bin/sh\necho "spice $*" >> calls.log\n'
                     'if [ "$1" = train ]; then mkdir -p runs/tiny_cpu && echo {} > runs/tiny_cpu/config.json; fi\n')
    spice.chmod(0o755)

    def main_job(*args: str) -> str:
        r = subprocess.run(["bash", str(repo / "tools" / "env" / "run_main.sh"), *args], capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        return r.stdout

    assert "run_main:" not in main_job()
    second = main_job()
    assert "run_main: runs/tiny_cpu held an earlier run: kept as runs/tiny_cpu.1" in second
    assert "spice train --resume --output runs/tiny_cpu.1" in second
    assert (repo / "runs" / "tiny_cpu.1" / "config.json").exists() and (repo / "runs" / "tiny_cpu").exists()
    assert "kept as runs/tiny_cpu.2" in main_job()
    assert "run_main:" not in main_job("--resume")  # continued in place
    calls = (repo / "calls.log").read_text().splitlines()
    assert calls[-1] == ("spice train --recipe tiny_cpu --output runs/tiny_cpu --eval-benchmarks stories "
                         "--eval-limit 200 --resume")
