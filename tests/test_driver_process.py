"""The driver in a process of its own (run.driver=process) against the in-thread driver, over a
stand-in engine service (tools/bench/bench_overlap.py: the engine's HTTP contract, generation modelled)."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from e2e import untimed

from spice_megatron.config import SourceConfig, apply_overrides
from spice_megatron.data.offline_assets import make_tiny_engine_model
from spice_megatron.loop.driver import Driver, KillSwitch
from spice_megatron.loop.driver_process import DriverProcess
from spice_megatron.rollout.fleet import RolloutFleet
from spice_megatron.torchrun import free_port

pytestmark = [pytest.mark.multiprocess]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def job_token(monkeypatch):  # the stand-in's secret: engines started elsewhere share the job's
    monkeypatch.setenv("SPICE_ROLLOUT_TOKEN", "test")


@pytest.fixture(scope="module")
def standin(tmp_path_factory):
    root = tmp_path_factory.mktemp("driver_process")
    model = make_tiny_engine_model(str(root / "model"), "qwen3", seed=4)
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"Document {i}. The tower is {300 + i} metres tall."}) + "\n"
                              for i in range(12)))
    port = free_port()
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "tools", "bench", "bench_overlap.py"),
                             "--serve-standin", str(model), str(port), "100000"], cwd=ROOT, env={**os.environ,
                                                                              "SPICE_ROLLOUT_TOKEN": "test"})
    probe = RolloutFleet([f"http://127.0.0.1:{port}"], "test")
    try:
        probe.wait_until_healthy(120)
        yield str(model), str(corpus), f"http://127.0.0.1:{port}", root
    finally:
        probe.close()
        proc.terminate()
        proc.wait(30)


def config(model, corpus, url, out):
    from recipes.tiny_cpu import tiny_cpu

    cfg = tiny_cpu(model=model, output_dir=out)
    cfg.corpus.sources = [SourceConfig(path=corpus, name="docs")]
    return apply_overrides(cfg, [f"rollout.engines={url}", "corpus.max_docs=12",
                                 "corpus.min_doc_tokens=4", "selfplay.batch_docs=2", "selfplay.group_size=2",
                                 "selfplay.max_attempts=2", "selfplay.attempts_per_round=2"])


def test_the_driver_process_gives_the_in_thread_drivers_batches_logs_and_state(standin):
    """Same config, same engines: the process hands rank 0 the same batches (one synchronous, one
    started in the background while rank 0 logs), writes the same audit trail and reports the same
    state; the kill switch crosses the pipe as itself."""
    from transformers import AutoTokenizer

    model, corpus, url, root = standin
    results = {}
    for mode in ("thread", "process"):
        out = str(root / mode)
        cfg = config(model, corpus, url, out)
        stop_file = os.path.join(out, "STOP")
        driver = (DriverProcess(cfg, None, stop_file) if mode == "process" else
                  Driver(cfg, AutoTokenizer.from_pretrained(model), None))
        sent = []
        if mode == "process":  # what crosses the pipe: the records of a batch the process made stay there
            call = driver._call
            driver._call = lambda name, *args: sent.append((name, args)) or call(name, *args)
        try:
            assert driver.fleet.num_receivers == 1
            first = driver.selfplay(0, 0)
            future, snapshot = driver.start_selfplay(1, 0)
            driver.log(1, {**first.stats, "valid_task_rate": 1.0}, first.records)
            second = future.result(timeout=120)
            state = driver.state()
            with pytest.raises(KillSwitch, match="non-finite loss"):
                driver.check_kill_switch({"valid_task_rate": 1.0, "challenger/reward_mean": 0.0}, float("nan"), 1.0)
        finally:
            driver.close()
        with open(os.path.join(out, "audit.jsonl")) as f:
            audit = [json.loads(line) for line in f]
        results[mode] = (first, second, snapshot, state, audit)
        if mode == "process":
            (logged,) = [args for name, args in sent if name.startswith("log")]
            assert [name for name, _ in sent if name.startswith("log")] == ["log_held"] and logged[2] == 0
    (a1, a2, snap_a, state_a, audit_a), (b1, b2, snap_b, state_b, audit_b) = results["thread"], results["process"]
    for x, y in ((a1, b1), (a2, b2)):
        assert (x.iteration, x.version, untimed(x.records)) == (y.iteration, y.version, untimed(y.records))
        assert [(s.prompt_ids, s.completion_ids, s.advantage, s.role) for s in x.seqs] == \
            [(s.prompt_ids, s.completion_ids, s.advantage, s.role) for s in y.seqs]
        assert x.seqs
    assert json.dumps(snap_a) == json.dumps(snap_b)
    # the offsets of the same records (their request times differ in width, so in bytes)
    assert state_a["sampler"] == state_b["sampler"] and state_a["audit_offset"] > 0 and state_b["audit_offset"] > 0
    assert [state["audit_offset"] for state in (state_a, state_b)] == \
        [os.path.getsize(str(root / mode / "audit.jsonl")) for mode in ("thread", "process")]
    assert untimed(audit_a) == untimed(audit_b) == untimed(a1.records)


def test_a_driver_process_that_dies_fails_the_waiting_call_with_its_exit_code(standin):
    """Ctrl-C and SIGTERM reach the process group: the driver process leaves them to rank 0 (which
    needs its state for the checkpoint); a driver process that dies fails the call that waits."""
    model, corpus, url, root = standin
    driver = DriverProcess(config(model, corpus, url, str(root / "dies")), None, str(root / "dies" / "STOP"))
    try:
        for sig in (signal.SIGINT, signal.SIGTERM):
            os.kill(driver.process.pid, sig)
        time.sleep(0.5)
        assert driver.state()["audit_offset"] == 0
        driver.process.kill()
        time.sleep(0.5)
        with pytest.raises(RuntimeError, match=r"the driver process ended \(exit code -9\)"):
            driver.state()
    finally:
        driver.close()


def test_a_driver_that_cannot_start_raises_its_error_on_rank_0(standin, tmp_path):
    model, corpus, url, root = standin
    cfg = config(model, str(tmp_path / "missing.jsonl"), url, str(tmp_path / "out"))
    with pytest.raises(Exception, match="missing.jsonl"):
        DriverProcess(cfg, None, str(tmp_path / "STOP"))
