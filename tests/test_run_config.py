"""RUN/config.json (run_config.py): written at the start, compared on --resume."""
import json

import pytest

from spice_megatron.entry import UserError
from spice_megatron.run_config import record_run_config


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
