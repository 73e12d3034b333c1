"""Helpers of the end-to-end trainer tests (test_trainer*.py): a tiny random model, a corpus, and
`spice train` as a subprocess. Two test files so that pytest-xdist (--dist loadfile) runs them on
both workers."""
import json
import os
import subprocess
import sys

from safetensors.torch import load_file

from spice_megatron.offline_assets import make_tiny_engine_model

PARA = ("The Eiffel Tower was built for the 1889 World's Fair in Paris. It is 330 metres tall and was the "
        "tallest man-made structure in the world for 41 years, until the Chrysler Building was finished.")


def make_setup(tmp_path_factory):
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
