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
- attention: the shared-prefix core attention alone (8 heads, 2 KV groups, head dim 64, fp32) on
  GPU-shaped rows: two groups of 4 x (600 prompt + 300) packed to a multiple
  of 1 and of 128 (the pads under sequence parallelism): backward time at pad_to=128 over
  pad_to=1 (target <= 1.25); and one long-prefix unit, 2,400 + 3 x 300: what its backward keeps
  (autograd's saved tensors, q/k/v and the projection's input included) over the planner's
  attention terms for its tokens (target <= 1.3).
Each (case, mode) runs in a fresh process: one warm-up step, then the median of --repeats steps.
Printed per row: step seconds, tokens through the forward, logits computed, the largest set of
activations one micro-batch keeps for its backward (autograd's saved tensors, parameters aside,
each storage once), and the process's peak resident memory; then the ratios.

  python tools/bench/bench_learner.py [--cases demo,paper,attention] [--repeats 3]
"""
from __future__ import annotations

import os
import resource
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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
    from spice_megatron.data.offline_assets import make_tiny_hf_model, smollm2_dir, tiny_hf_config

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
    from spice_megatron.bridge.hf_io import learner_from_hf
    from spice_megatron.config import OptimConfig, ParallelConfig, PolicyTrainConfig

    groups, budget = CASES[case]
    model_dir = _model_dir(case, work)
    learner = learner_from_hf(model_dir, ParallelConfig(), OptimConfig(lr=1e-6),
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


def _attention_module(heads: int, groups: int, dim: int):
    from types import SimpleNamespace

    from spice_megatron.policy.shared_prefix import SharedPrefixAttention

    config = SimpleNamespace(context_parallel_size=1, num_attention_heads=heads, num_query_groups=groups,
                             kv_channels=dim, apply_query_key_layer_scaling=False, attention_dropout=0.0)
    return SharedPrefixAttention(config, 1, pg_collection=SimpleNamespace(tp=SimpleNamespace(size=lambda: 1)))


def long_prefix_saved(dtype: torch.dtype) -> tuple[int, float, int]:
    """(bytes the backward keeps, the planner's attention terms in bytes, tokens) of one long-prefix
    unit, 2,400 + 3 x 300, through the shared-prefix attention: saved tensors each storage once,
    q/k/v and the projection's input (the output) included. tests/test_shared_prefix.py holds it."""
    from types import SimpleNamespace

    from spice_megatron.policy.activation_memory import ActivationFlags, activation_terms
    from spice_megatron.policy.batching import TrainSequence
    from spice_megatron.policy.packing import collate_packed

    heads, groups, dim = 8, 2, 64
    seqs = [TrainSequence(list(range(1, 2401)), list(range(300)), 1.0) for _ in range(3)]
    mb = collate_packed(seqs, [[0, 1, 2]])
    s = mb.tokens.shape[1]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(s, 1, n, dim, generator=g, dtype=dtype).requires_grad_() for n in (heads, groups, groups))
    kept = SavedActivations([])  # q, k and v are inputs here, not parameters: counted
    with torch.autograd.graph.saved_tensors_hooks(kept.pack, kept.unpack):
        out = _attention_module(heads, groups, dim).train()(q, k, v, mb.attention_mask)
    saved = kept.peak + out.numel() * out.element_size()
    spec = SimpleNamespace(hidden_size=heads * dim, head_dim=dim, num_heads=heads, num_kv_heads=groups,
                           ffn_hidden_size=4 * heads * dim, qk_norm=False)
    terms = activation_terms(spec, 1, ActivationFlags(False, True, "off", (), True, shared_prefix=True))
    per_token = (terms["flash attention q, k, v"] + terms["attention output (= projection input)"]
                 + terms["shared-prefix attention pieces + log-sum-exps"])
    return saved, s * per_token * out.element_size() / 2, s  # the planner's bytes are bf16's


def attention_case(repeats: int) -> list[str]:
    """The `attention` case's lines (in this process: no learner, no process group)."""
    from spice_megatron.policy.batching import TrainSequence
    from spice_megatron.policy.packing import collate_packed

    heads, groups, dim = 8, 2, 64
    attention = _attention_module(heads, groups, dim)
    seqs = [TrainSequence(list(range(1 + u, 601 + u)), list(range(300)), 1.0) for u in range(2) for _ in range(4)]
    backward = {}
    for pad_to in (1, 128):
        mb = collate_packed(seqs, [[0, 1, 2, 3], [4, 5, 6, 7]], pad_to=pad_to)
        s = mb.tokens.shape[1]
        times = []
        for rep in range(repeats + 1):
            g = torch.Generator().manual_seed(rep)
            q, k, v = (torch.randn(s, 1, n, dim, generator=g).requires_grad_() for n in (heads, groups, groups))
            out = attention(q, k, v, mb.attention_mask.clone())
            t0 = time.perf_counter()
            out.sum().backward()
            times.append(time.perf_counter() - t0)
        backward[pad_to] = (s, statistics.median(times[1:]))
    saved, planned, s = long_prefix_saved(torch.float32)
    (s1, t1), (s128, t128) = backward[1], backward[128]
    return [f"attention: backward {t1 * 1e3:.0f} ms at pad_to=1 ({s1:,} tokens), {t128 * 1e3:.0f} ms at pad_to=128 "
            f"({s128:,}): {t128 / t1:.2f}x (target <= 1.25)",
            f"attention: a {s:,}-token long-prefix unit keeps {saved / 2**20:.1f} MiB for its backward, the planner's "
            f"attention terms {planned / 2**20:.1f} MiB: {saved / planned:.2f}x (target <= 1.3)"]


def main() -> int:
    from spice_megatron.entry import ArgumentParser, positive_int

    ap = ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="demo,paper,attention")
    ap.add_argument("--repeats", type=positive_int, default=3)
    args = ap.parse_args()
    unknown = sorted(set(args.cases.split(",")) - set(CASES) - {"attention"})
    if unknown:
        from spice_megatron.entry import UserError

        raise UserError(f"--cases: unknown {unknown}; cases: {', '.join([*CASES, 'attention'])}")
    from spice_megatron.torchrun import free_port

    learner_cases = [c for c in args.cases.split(",") if c in CASES]
    ctx = mp.get_context("spawn")
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for case in learner_cases:
            for mode in ("off", "on"):
                q = ctx.Queue()
                p = ctx.Process(target=_run, args=(case, mode, args.repeats, work, free_port(), q))
                p.start()
                p.join()
                if p.exitcode != 0:
                    print(f"{case} shared_prefix={mode}: exited with {p.exitcode}", file=sys.stderr)
                    return 1
                rows.append(q.get())
    if "attention" in args.cases.split(","):
        print("\n".join(attention_case(args.repeats)))
    if not learner_cases:
        return 0
    print(f"{'case':6} {'shared_prefix':13} {'step s':>8} {'tokens run':>10} {'logits':>8} {'saved MiB':>10} "
          f"{'peak RSS MiB':>12}")
    for r in rows:
        print(f"{r['case']:6} {r['mode']:13} {r['seconds']:8.2f} {r['tokens_run']:10,} {r['logits']:8,} "
              f"{r['saved_mib']:10.1f} {r['rss_mib']:12.0f}")
    for case in learner_cases:
        off, on = (next(r for r in rows if r["case"] == case and r["mode"] == m) for m in ("off", "on"))
        print(f"{case}: step {off['seconds'] / on['seconds']:.2f}x faster, {off['tokens_run'] / on['tokens_run']:.2f}x "
              f"fewer tokens run, {off['logits'] / on['logits']:.2f}x fewer logits, "
              f"{off['saved_mib'] / on['saved_mib']:.2f}x less saved activation memory")
    return 0


if __name__ == "__main__":
    from spice_megatron.entry import run_entry_point

    run_entry_point(main)
