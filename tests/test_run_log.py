"""Metrics to JSONL, TensorBoard and (offline) Weights & Biases; a resumed run keeps its W&B run."""
import glob
import json
import os

from spice_megatron.run.log import MetricsLogger


def test_metrics_reach_jsonl_tensorboard_and_wandb(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = str(tmp_path)
    m = MetricsLogger(out, wandb_project="spice-test", run_name="t", config={"selfplay": {"group_size": 8}})
    m.log(1, {"valid_task_rate": 0.5, "train/loss": 0.1})
    offset = m.jsonl.offset()
    m.log(2, {"valid_task_rate": 0.75, "train/loss": float("nan")})
    run_id = m.wandb.id
    m.close()
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert [r["iteration"] for r in rows] == [1, 2]
    assert glob.glob(os.path.join(out, "tensorboard", "events.out.tfevents.*"))
    runs = glob.glob(os.path.join(out, "wandb", f"offline-run-*-{run_id}"))
    assert runs and glob.glob(os.path.join(runs[0], "*.wandb"))
    # resume at the first step's offset: the JSONL is cut back, the W&B run id is the same
    m = MetricsLogger(out, resume_at=offset, wandb_project="spice-test", run_name="t")
    assert m.wandb.id == run_id
    m.log(2, {"valid_task_rate": 0.8})
    m.close()
    assert [json.loads(line)["valid_task_rate"] for line in open(os.path.join(out, "metrics.jsonl"))] == [0.5, 0.8]


def test_a_resumed_run_hides_the_tensorboard_events_of_the_iterations_it_runs_again(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = str(tmp_path)
    m = MetricsLogger(out)
    m.log(1, {"train/loss": 1.0})
    offset = m.jsonl.offset()
    m.log(2, {"train/loss": 2.0})
    m.log(3, {"train/loss": 3.0})
    m.close()
    m = MetricsLogger(out, resume_at=offset)  # the checkpoint held iteration 1: 2 and 3 run again
    m.log(2, {"train/loss": 20.0})
    m.close()
    acc = EventAccumulator(os.path.join(out, "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(1, 1.0), (2, 20.0)]
