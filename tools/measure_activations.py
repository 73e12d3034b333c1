#!/usr/bin/env python3
"""What one learner micro-batch saves for the backward pass, measured, against the planner's term.

A forward with gradients through the real Learner model under `torch.autograd.graph.saved_tensors_hooks`
records every tensor autograd keeps; parameters are left out and a storage counted once. Measured
at two sequence lengths (batch 1), the bytes per layer fit a*s + b*s^2: `a` is what the planner
calls activations per token per layer (printed in units of the hidden size h), `b * s^2` the
attention scores, which the local layer spec used on CPU keeps and flash attention (Transformer
Engine, on GPU) does not. The embedding and output layer are measured with zero layers and taken out.

  python tools/measure_activations.py [--moe] [--dtype bf16] [--hidden 256]

CPU, one rank, TP=1: Transformer Engine's fused layers save a different set on GPU (the review's
breakdown in shared/notes/review-cluster-path-2.md); this measures the torch layers the CPU path runs.
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402


def saved_bytes(learner, seq: int) -> int:
    """Bytes autograd saves in one forward of a [1, seq] micro-batch (parameters excluded)."""
    params = {p.data_ptr() for p in learner.model.parameters()}
    seen: set[int] = set()
    total = 0

    def pack(t: torch.Tensor):
        nonlocal total
        try:
            ptr = t.untyped_storage().data_ptr()
        except RuntimeError:  # a tensor without storage (e.g. a view of a sparse one)
            return t
        if ptr not in params and ptr not in seen:
            seen.add(ptr)
            total += t.untyped_storage().nbytes()
        return t

    tokens = torch.randint(0, learner.spec.vocab_size, (1, seq), generator=torch.Generator().manual_seed(seq))
    positions = torch.arange(seq).unsqueeze(0)
    learner.model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        from spice_megatron.policy import cpu_compat

        with cpu_compat.cuda_to_cpu():
            out = learner.model(tokens, positions, attention_mask=None)
    del out
    return total


def build(hidden: int, layers: int, moe: bool, dtype: str, model: str = ""):
    """A few layers of `model`'s widths (a known hub id or an HF directory), or a small Qwen3."""
    from spice_megatron.config import OptimConfig, ParallelConfig, PolicyTrainConfig
    from spice_megatron.offline_assets import tiny_hf_config
    from spice_megatron.policy.learner import Learner
    from spice_megatron.policy.model import model_spec_from_hf

    if model:
        from spice_megatron.planner import model_spec

        cfg = dict(model_spec(model).hf_config, num_hidden_layers=layers, vocab_size=1024, tie_word_embeddings=False)
    else:
        heads = max(4, hidden // 64)
        cfg = tiny_hf_config("qwen3_moe" if moe else "qwen3", vocab_size=1024, hidden_size=hidden, num_layers=layers,
                             num_heads=heads, num_kv_heads=heads // 4 or 1, head_dim=64, intermediate_size=3 * hidden,
                             num_experts=16, top_k=4, moe_intermediate_size=hidden // 2)
    return Learner(model_spec_from_hf(cfg), ParallelConfig(), OptimConfig(),
                   PolicyTrainConfig(dtype=dtype, routing_replay="off"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--moe", action="store_true", help="Qwen3-MoE layers (16 experts of hidden/2, top-4)")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16")
    ap.add_argument("--model", default="", help="a recipe model's widths, e.g. Qwen/Qwen3-4B-Base (planner's "
                    "known models) or an HF directory; --hidden and --moe are then ignored")
    args = ap.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    from spice_megatron.launch import free_port
    from spice_megatron.planner import learner_memory

    os.environ.setdefault("MASTER_PORT", str(free_port()))
    torch.set_num_threads(1)
    if args.layers < 2:
        ap.error("--layers: at least 2 (one layer's model is the baseline taken out)")
    s1, s2 = 64, 128
    full = build(args.hidden, args.layers, args.moe, args.dtype, args.model)
    spec = full.spec
    measured = {s: saved_bytes(full, s) for s in (s1, s2)}
    # embedding, final norm and logits: the same in a one-layer model, removed by the difference
    one = build(args.hidden, 1, args.moe, args.dtype, args.model)
    base = {s: saved_bytes(one, s) for s in (s1, s2)}
    y1, y2 = ((measured[s] - base[s]) / (args.layers - 1) for s in (s1, s2))
    b = (y2 / s2 - y1 / s1) / (s2 - s1)  # y = a s + b s^2 through both points
    a = y1 / s1 - b * s1
    h = spec.hidden_size
    in_bf16 = a if args.dtype == "bf16" else a / 2  # the planner counts bf16 activations
    planned = learner_memory(spec, 1, 1, 1, 1).activations * 2**30 / spec.num_layers
    print(f"{args.model or ('Qwen3-MoE' if args.moe else 'Qwen3')} hidden {h}, {args.dtype}: per token per layer {a:.0f} bytes "
          f"({in_bf16 / h:.1f} h in bf16); attention scores {b:.1f} bytes x s^2 (none with flash attention)")
    print(f"planner: {planned:.0f} bytes = {planned / h:.1f} h per token per layer; measured / planned "
          f"{in_bf16 / planned:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
