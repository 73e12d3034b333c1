#!/usr/bin/env python3
"""The learner's step with shared-prefix packing (train.shared_prefix, policy/packing.py) against
one padded row per sequence (shared_prefix off, the learner before packing), side by side.

Two cases, each a real Learner on one gloo rank, fp32:
- demo: SmolLM2-135M (the CPU demo's model) on the demo's batch shapes: two documents, each a
  challenger group of 8 x (295 prompt + 50 completion tokens) and a reasoner group of
  8 x (146 + 20), micro_batch_tokens 2048 (recipes/tiny_cpu.py);
- paper: one paper-shaped challenger group 8 x (3,300 + 600) and one reasoner group 8 x (300 +
  1,000) through a small-width Qwen3 (hidden 64, 2 layers, 32,768 vocabulary), micro_batch_tokens
  8192.
Each (case, mode) runs in a fresh process: one warm-up step, then the median of --repeats steps.
Printed per row: step seconds, tokens through the forward, logits computed, the largest set of
activations one micro-batch keeps for its backward (autograd's saved tensors, parameters aside,
each storage once), and the process's peak resident memory; then the ratios.

  python tools/bench_learner.py [--cases demo,paper] [--repeats 3]
"""
from __future__ import annotations

import os
import resource
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

CASES = {
    # name: (groups of (prompt tokens, completion tokens, count), micro_batch_tokens)
    "demo": ([(295, 50, 8), (146, 20, 8), (295, 50, 8), (146, 20, 8)], 2048),
    "paper": ([(3300, 600, 8), (300, 1000, 8)], 8192),
}


def _batch(groups, vocab: int):
    from spice_megatron.policy.batching import TrainSequence

    g = torch.Generator().manual_seed(0)
    seqs = []
    for k, (p, c, n) in enumerate(groups):
        prompt = torch.randint(0, vocab, (p,), generator=g).tolist()
        for i in range(n):  # completions of a group vary in length around c
            length = max(1, c + (i - n // 2) * max(1, c // 20))
            seqs.append(TrainSequence(prompt, torch.randint(0, vocab, (length,), generator=g).tolist(),
                                      advantage=(-1) ** i * 0.5, role="challenger" if k % 2 == 0 else "reasoner"))
    return seqs


def _model_dir(case: str, work: str) -> str:
    from spice_megatron.offline_assets import make_tiny_hf_model, smollm2_dir, tiny_hf_config

    if case == "demo":
        return smollm2_dir()
    config = tiny_hf_config("qwen3", vocab_size=32768)
    config["max_position_embeddings"] = 8192
    return make_tiny_hf_model(os.path.join(work, "paper_shaped"), config, seed=0)


class SavedActivations:
    """Bytes autograd keeps for the backward, per forward (reset when its backward starts)."""

    def __init__(self, params):
        self.params = {p.untyped_storage().data_ptr() for p in params}
        self.current: dict[int, int] = {}
        self.peak = 0
        self.backward_started = False

    def pack(self, t):
        if self.backward_started:
            self.current, self.backward_started = {}, False
        ptr = t.untyped_storage().data_ptr()
        if ptr not in self.params:
            self.current[ptr] = t.untyped_storage().nbytes()
            self.peak = max(self.peak, sum(self.current.values()))
        return t

    def unpack(self, t):
        self.backward_started = True
        return t


def _run(case: str, mode: str, repeats: int, work: str, port: int, out) -> None:
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from spice_megatron.config import OptimConfig, ParallelConfig, PolicyTrainConfig
    from spice_megatron.policy.learner import Learner

    groups, budget = CASES[case]
    model_dir = _model_dir(case, work)
    learner = Learner.from_hf(model_dir, ParallelConfig(), OptimConfig(lr=1e-6),
                              PolicyTrainConfig(max_gen_len=1024, micro_batch_tokens=budget, dtype="fp32",
                                                temperature=0.5, shared_prefix=mode))
    seqs = _batch(groups, learner.spec.vocab_size)
    saved = SavedActivations(learner.model.parameters())
    learner.train_on_batch(seqs)  # warm-up
    times, run = [], 0
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
        for _ in range(repeats):
            t0 = time.perf_counter()
            (m,) = learner.train_on_batch(seqs)
            times.append(time.perf_counter() - t0)
            run = m.tokens_run
    out.put(dict(case=case, mode=mode, seconds=statistics.median(times), tokens_run=run,
                 logits=sum(len(x.completion_ids) for x in seqs) if mode == "on" else sum(len(x) for x in seqs),
                 sequences=len(seqs), saved_mib=saved.peak / 2**20,
                 rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024))


def main() -> int:
    from spice_megatron.entry import ArgumentParser, positive_int

    ap = ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="demo,paper")
    ap.add_argument("--repeats", type=positive_int, default=3)
    args = ap.parse_args()
    unknown = sorted(set(args.cases.split(",")) - set(CASES))
    if unknown:
        from spice_megatron.entry import UserError

        raise UserError(f"--cases: unknown {unknown}; cases: {', '.join(CASES)}")
    from spice_megatron.launch import free_port

    ctx = mp.get_context("spawn")
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for case in args.cases.split(","):
            for mode in ("off", "on"):
                q = ctx.Queue()
                p = ctx.Process(target=_run, args=(case, mode, args.repeats, work, free_port(), q))
                p.start()
                p.join()
                if p.exitcode != 0:
                    print(f"{case} shared_prefix={mode}: exited with {p.exitcode}", file=sys.stderr)
                    return 1
                rows.append(q.get())
    print(f"{'case':6} {'shared_prefix':13} {'step s':>8} {'tokens run':>10} {'logits':>8} {'saved MiB':>10} "
          f"{'peak RSS MiB':>12}")
    for r in rows:
        print(f"{r['case']:6} {r['mode']:13} {r['seconds']:8.2f} {r['tokens_run']:10,} {r['logits']:8,} "
              f"{r['saved_mib']:10.1f} {r['rss_mib']:12.0f}")
    for case in args.cases.split(","):
        off, on = (next(r for r in rows if r["case"] == case and r["mode"] == m) for m in ("off", "on"))
        print(f"{case}: step {off['seconds'] / on['seconds']:.2f}x faster, {off['tokens_run'] / on['tokens_run']:.2f}x "
              f"fewer tokens run, {off['logits'] / on['logits']:.2f}x fewer logits, "
              f"{off['saved_mib'] / on['saved_mib']:.2f}x less saved activation memory")
    return 0


if __name__ == "__main__":
    from spice_megatron.entry import run_entry_point

    run_entry_point(main)
