"""Helpers of the end-to-end trainer tests (test_trainer*.py): a tiny random model, a corpus, and
`spice train` as a subprocess. Two test files so that pytest-xdist (--dist loadfile) runs them on
both workers."""
import json
import os
import subprocess
import sys
import time

import pytest
from safetensors.torch import load_file

from spice_megatron.data.offline_assets import make_tiny_engine_model

PARA = ("The Eiffel Tower was built for the 1889 World's Fair in Paris. It is 330 metres tall and was the "
        "tallest man-made structure in the world for 41 years, until the Chrysler Building was finished.")


def write_corpus(path) -> str:
    """Twelve short documents, one JSON record a line: the tiny runs' corpus."""
    with open(path, "w") as f:
        f.write("".join(json.dumps({"text": f"Document {i}. {PARA}"}) + "\n" for i in range(12)))
    return str(path)


def make_setup(root):
    model = make_tiny_engine_model(str(root / "model"), "qwen3", seed=4)
    return str(model), write_corpus(root / "corpus.jsonl"), root


# The tiny_cpu recipe made small for a tiny random model (a run of a few iterations in about a minute).
TINY_RUN = ("corpus.max_docs=12", "corpus.min_doc_tokens=8", "selfplay.batch_docs=3", "selfplay.group_size=2",
            "selfplay.max_attempts=2", "selfplay.attempts_per_round=2", "selfplay.challenger_max_tokens=24",
            "selfplay.reasoner_max_tokens=16", "train.max_gen_len=24", "rollout.kv_cache_gib=0.25",
            "rollout.max_model_len=1024", "run.export_hf=true",
            # a random model writes no valid task, so every advantage is 0: decoupled weight decay
            # still moves the weights at each optimiser step, so a skipped or repeated step shows
            "optim.weight_decay=0.1", "optim.lr=1e-3")


def spice_train(model, corpus, out, *overrides, resume=False, wait=True):
    args = [sys.executable, "-m", "spice_megatron.cli", "train", "--recipe", "tiny_cpu", "--model", model,
            "--output-dir", out, "--corpus", corpus, *(["--resume"] if resume else []), *TINY_RUN, *overrides]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if not wait:
        return proc
    out_text, _ = proc.communicate(timeout=900)
    return proc.returncode, out_text


def untimed(rows: list[dict]) -> list[dict]:
    """Audit records without when their request ran (`request_s`: the one field two runs of the
    same seeds do not share)."""
    return [{k: v for k, v in r.items() if k != "request_s"} for r in rows]


def records(path, when=False):
    """A JSONL file's records (audit records `untimed` unless `when`)."""
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    return rows if when else untimed(rows)


def weights(out):
    d = os.path.join(out, "hf_final")
    index = json.load(open(os.path.join(d, "model.safetensors.index.json")))["weight_map"]
    w = {}
    for f in set(index.values()):
        w.update(load_file(os.path.join(d, f)))
    return w


def wait_for_first_iteration(proc, out: str) -> str:
    """Wait until the run in `out` has logged its first iteration; returns its metrics path."""
    metrics_path = os.path.join(out, "metrics.jsonl")
    deadline = time.monotonic() + 600
    while not (os.path.exists(metrics_path) and open(metrics_path).read().count("\n") >= 1):
        if proc.poll() is not None:
            raise AssertionError("the run ended before its first iteration:\n" + proc.stdout.read()[-4000:])
        assert time.monotonic() < deadline, "no first iteration after 600 s"
        time.sleep(0.05)
    return metrics_path


def kill_after_second_checkpoint(proc, out: str) -> str:
    """kill -9 the run `proc` once its second checkpoint is complete; returns that checkpoint's
    trainer_state.json."""
    import signal

    state = os.path.join(out, "checkpoints", "step_00000002", "trainer_state.json")
    deadline = time.monotonic() + 600
    while not os.path.exists(state):
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before its second checkpoint"
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait(60)
    return state


def engine_pids(proc) -> list[str]:
    """The rollout engines the run `proc` started (itself, or its driver process: run.driver=process)."""
    children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    return [pid for parent in [str(proc.pid), *children]
            for pid in subprocess.run(["pgrep", "-f",
                                       f"spice_megatron.rollout.serve.*--exit-with-parent {parent}( |$)"],
                                      capture_output=True, text=True).stdout.split()]


def engine_token(pid: str) -> str:
    """The job's secret, as the engine `pid` (a child of the run: the same user) was given it."""
    with open(f"/proc/{pid}/environ", "rb") as f:
        env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
    return env[b"SPICE_ROLLOUT_TOKEN"].decode()


@pytest.fixture(scope="module")
def setup(module_dir):
    """A test module's tiny model, corpus and folder (imported by the test_trainer*.py files)."""
    return make_setup(module_dir)


@pytest.fixture(scope="module")
def straight(setup):
    """4 iterations without interruption: the reference for the resume tests (its last three
    checkpoints kept, for the damaged-checkpoint test)."""
    model, corpus, root = setup
    out = str(root / "straight")
    rc, text = spice_train(model, corpus, out, "run.iterations=4", "run.keep_last=3")
    assert rc == 0, text[-3000:]
    return out
