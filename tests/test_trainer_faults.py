"""SPICE end to end, the other half (a second file so that both xdist workers run trainer tests):
the SmolLM2 demo run, engine death and restart, the paper protocol's groups, rollout batches."""
import json
import os
import signal
import subprocess
import sys

import pytest
from e2e import PARA, engine_pids, records, setup, spice_train, wait_for_first_iteration  # noqa: F401 (fixture)

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def test_the_smollm2_demo_run_and_what_a_newcomer_reads_of_it(tmp_path, capsys):
    """The README's main job, shortened: SmolLM2-135M-Instruct on real offline documents; then the
    newcomer's path through its output: the summary, the config, the metrics and
    their glossary, the curves, the audit trail from iteration 1, its footprint and `spice clean`."""
    from spice_megatron.data.offline_assets import smollm2_dir

    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"Fact {i}. {PARA}"}) + "\n" for i in range(6)))
    out = str(tmp_path / "demo")
    args = [sys.executable, "-m", "spice_megatron.cli", "train", "--recipe", "tiny_cpu", "--model", smollm2_dir(),
            "--output", out, "--corpus", str(corpus), "run.iterations=1", "selfplay.batch_docs=2",
            "selfplay.max_attempts=2", "selfplay.attempts_per_round=2", "selfplay.challenger_max_tokens=64",
            "selfplay.reasoner_max_tokens=64", "corpus.min_doc_tokens=8", "rollout.kv_cache_gib=0.5"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "SPICE run finished" in proc.stdout
    (m,) = records(os.path.join(out, "metrics.jsonl"))
    assert m["weights_version"] == 1 and m["train/logprob_gap"] < 1e-3 and m["tokens/challenger"] > 0
    assert os.path.exists(os.path.join(out, "hf_final", "model.safetensors.index.json"))
    assert os.path.exists(os.path.join(out, "hf_final", "tokenizer.json"))
    # the exported model records its training prompts: `spice eval --model RUN` evaluates with them
    from spice_megatron.data.story_corpus import PROMPT_DIR
    from spice_megatron.eval.harness import EvalSettings
    from spice_megatron.eval.run import with_training_prompts

    settings = with_training_prompts(EvalSettings(template=""), os.path.join(out, "hf_final"))
    assert (settings.template, settings.prompt_dir, settings.stop) == ("plain", PROMPT_DIR, ("\nQ:",))

    from spice_megatron.cli import main
    from spice_megatron.metric_names import SUMMARY, describe, twins

    printed = proc.stdout
    assert [k for k in SUMMARY if f"  {k} " not in printed] == []  # the summary: the contract's names
    assert "docs/metrics.md" in printed and "on disk: " in printed and f"spice clean {out}" in printed
    assert f"config: {out}/config.json (recipe tiny_cpu; overrides: run.iterations=1 " in printed
    assert json.load(open(os.path.join(out, "config.json")))["config"]["selfplay"]["batch_docs"] == 2
    assert [k for k in m if describe(k) is None] == [] and twins(list(m)) == []
    assert main(["curves", out]) == 0 and os.path.getsize(os.path.join(out, "training_curves.png")) > 10_000
    capsys.readouterr()
    assert main(["audit", out, "--iteration", "1", "--kind", "challenger"]) == 0
    assert capsys.readouterr().out.startswith("it=1 ")
    head = subprocess.run(f"{sys.executable} -m spice_megatron.cli audit {out} --full | head -1", shell=True,
                          capture_output=True, text=True, timeout=120)
    assert head.returncode == 0 and head.stdout.startswith("{") and "Traceback" not in head.stderr
    assert main(["clean", out, "--dry-run"]) == 0 and "would free" in capsys.readouterr().out


def test_an_engine_dying_mid_run_is_replaced_and_restarted(setup):
    """One step off policy, so the kill lands while the next iteration's rollouts run beside a
    learner step. (On-policy, a lost engine's restart with the current weights is
    test_trainer_resilience's lost-only-engine run, which ends with the uninterrupted run's weights.)"""
    model, corpus, root = setup
    out, marker = str(root / "engine_death"), root / "sync_fault_marker"
    # besides the kill below, the first engine to receive weights version 3 exits in the middle of it
    os.environ["SPICE_FAULT_DIE_IN_SYNC"] = f"3:{marker}"
    try:
        proc = spice_train(model, corpus, out, "run.iterations=4", "rollout.local_engines=2", "rollout.sync_timeout=20",
                           "train.max_staleness=1", wait=False)
    finally:
        del os.environ["SPICE_FAULT_DIE_IN_SYNC"]
    metrics_path = wait_for_first_iteration(proc, out)
    engines = engine_pids(proc)
    assert len(engines) == 2
    os.kill(int(engines[0]), signal.SIGKILL)  # during iteration 2's rollouts
    text, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, text[-3000:]
    assert "died; restarting it" in text
    assert "weight sync of version 3 failed" in text and marker.exists()
    metrics = records(metrics_path)
    assert [m["iteration"] for m in metrics] == [1, 2, 3, 4]
    assert [m["weight_sync/retries"] for m in metrics] == [0, 0, 1, 0]
    assert [m["rollout_version"] for m in metrics] == [0, 0, 1, 2]  # every batch from iteration 2 one version old


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
    assert m["selection_valid_rate"] is not None and m["train/steps"] == 2  # 16 trajectories in 2 updates of 8
    audit = [r for r in records(os.path.join(out, "audit.jsonl")) if r["kind"] == "challenger"]
    trained = [r for r in audit if r["trained"]]
    assert len(audit) == 16 and len(trained) == 16
    assert {r["doc_id"] for r in trained} and all(sum(t["doc_id"] == d for t in trained) == 8
                                                  for d in {r["doc_id"] for r in trained})
    from recipes.tiny_cpu import tiny_cpu

    rho = tiny_cpu().selfplay.invalid_penalty  # the recipe's penalty for an invalid attempt
    assert all("advantage" in r and r["reward"] == rho or r["valid"] for r in trained)


def test_a_rollout_batch_survives_json_and_its_lag_is_per_role():
    from spice_megatron.loop.interfaces import RolloutBatch
    from spice_megatron.policy.batching import TrainSequence
    from spice_megatron.trainer import _iteration_stats

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


def test_a_cluster_engine_restarted_by_its_node_script_gets_the_current_weights():
    """slurm/rollout_node.sh restarts an engine that dies, with the base model: the driver sees it
    down, then back at weights version 0 among engines at the current one, and has every engine
    join a fresh sync group and take the current weights (no requeue)."""
    from types import SimpleNamespace

    from spice_megatron.loop.driver import Driver

    class Fleet:
        def __init__(self, states):
            self.states, self.waited = list(states), 0

        def health(self):
            return self.states[0] if len(self.states) == 1 else self.states.pop(0)

        def wait_until_healthy(self, timeout):
            self.waited += 1
            self.states = [self.states[-1]]

    driver = object.__new__(Driver)
    driver.engines = []  # a cluster's engines: none started by this driver
    driver.cfg = SimpleNamespace(rollout=SimpleNamespace(health_timeout=5.0))
    steady = {"http://a:8100": {"version": "3"}, "http://b:8101": {"version": "3"}}
    driver.fleet = Fleet([steady])
    assert driver.restart_dead_engines() is False and driver.fleet.waited == 0
    driver.fleet = Fleet([{"http://a:8100": {"version": "3"}, "http://b:8101": None}, steady])  # b restarting
    assert driver.restart_dead_engines() is True and driver.fleet.waited == 1
    driver.fleet = Fleet([{"http://a:8100": {"version": "3"}, "http://b:8101": {"version": "0"}}])  # b came back
    assert driver.restart_dead_engines() is True


def test_an_engine_that_misses_a_health_check_is_given_time_before_it_is_killed(monkeypatch):
    """A CPU engine under load can miss one 10 s /status: it is probed again for
    HUNG_ENGINE_GRACE_S and kept if it answers; one silent past that is killed and restarted."""
    import subprocess
    import sys
    from types import SimpleNamespace

    import spice_megatron.loop.driver as driver_module
    import spice_megatron.rollout.local as local
    from spice_megatron.loop.driver import Driver
    from spice_megatron.rollout.local import LocalEngine

    class Fleet:
        def __init__(self, answers_after, url="http://a:8100"):
            self.probes, self.answers_after, self.url = 0, answers_after, url

        def health(self):
            return {self.url: None if self.answers_after else {"version": "0"}}

        def serves(self, url):
            return url == self.url

        def probe(self, url):
            assert url == self.url
            self.probes += 1
            return {"version": "1"} if self.probes > self.answers_after else None

        def wait_until_healthy(self, timeout=None):
            pass

    monkeypatch.setattr(driver_module.time, "sleep", lambda s: None)
    restarted = []
    monkeypatch.setattr(local, "restart", lambda e, token: restarted.append(e.url) or e)
    monkeypatch.setattr(local, "wait_healthy", lambda engines: None)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        driver = object.__new__(Driver)
        driver.engines = [LocalEngine("http://a:8100", proc, "", [])]
        driver.token, driver.cfg = "t", SimpleNamespace(rollout=SimpleNamespace(health_timeout=5.0))
        driver.fleet, driver.challenger_fleet = Fleet(answers_after=2), None
        assert driver.restart_dead_engines() is False and proc.poll() is None and not restarted
        # a local fixed challenger's engine answers in its own fleet: not taken for a dead policy engine
        driver.engines = [LocalEngine("http://c:8200", proc, "", [])]
        driver.challenger_fleet = Fleet(answers_after=0, url="http://c:8200")
        assert driver.restart_dead_engines() is False and proc.poll() is None and not restarted
        driver.engines, driver.challenger_fleet = [LocalEngine("http://a:8100", proc, "", [])], None
        driver.fleet = Fleet(answers_after=10**9)
        monkeypatch.setattr(driver_module, "HUNG_ENGINE_GRACE_S", 0.0)
        assert driver.restart_dead_engines() is True and restarted == ["http://a:8100"]
        assert proc.poll() is not None  # the silent one was killed
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
