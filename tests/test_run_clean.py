"""`spice clean RUN` (run/clean.py): a run's older checkpoints removed, what a resume reads kept."""
import pytest

from spice_megatron.cli import main
from spice_megatron.entry import UserError
from spice_megatron.run.clean import clean_run, footprint_line
from spice_megatron.run.lock import RunDirLocked, RunLock


def _run(tmp_path):
    ckpts = tmp_path / "run" / "checkpoints"
    for name in ("step_00000002", "step_00000004", "step_00000006", "damaged.step_00000008"):
        (ckpts / name).mkdir(parents=True)
        (ckpts / name / "layout.json").write_text("{}")
        (ckpts / name / "__0_0.distcp").write_bytes(b"x" * 1000)
    (ckpts / "step_00000009.partial").mkdir()  # a save a kill interrupted
    (ckpts / "hf").mkdir()
    (ckpts / "hf" / "config.json").write_text("{}")
    (ckpts / "latest").write_text("step_00000006\n")
    (tmp_path / "run" / "hf_final").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("{}\n")
    return tmp_path / "run", ckpts


def test_clean_keeps_the_newest_checkpoint_and_what_a_resume_reads(tmp_path, capsys):
    run, ckpts = _run(tmp_path)
    assert main(["clean", str(run), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.count("would remove") == 4 and "step_00000006" not in out and "would free" in out
    assert len(list(ckpts.iterdir())) == 7  # nothing removed
    assert "of it checkpoints (spice clean" in footprint_line(str(run))
    assert main(["clean", str(run)]) == 0
    assert sorted(p.name for p in ckpts.iterdir()) == ["hf", "latest", "step_00000006"]
    assert (run / "hf_final").is_dir() and (run / "metrics.jsonl").exists()
    assert "freed" in capsys.readouterr().out


def test_clean_refuses_a_run_in_progress_and_what_is_not_a_run(tmp_path):
    run, ckpts = _run(tmp_path)
    with RunLock(str(run), wait_s=0):
        with pytest.raises(RunDirLocked):
            clean_run(str(run), 1, dry_run=False)
    assert len(list(ckpts.iterdir())) == 7
    with pytest.raises(UserError, match="not a run directory"):
        clean_run(str(tmp_path), 1, dry_run=False)
    clean_run(str(run), 2, dry_run=False)
    assert sorted(p.name for p in ckpts.iterdir()) == ["hf", "latest", "step_00000004", "step_00000006"]
