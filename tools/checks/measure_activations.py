#!/usr/bin/env python3
"""What one learner micro-batch saves for the backward pass, measured, against the planner's terms.

A forward with gradients through the real Learner model under `torch.autograd.graph.saved_tensors_hooks`
records every tensor autograd keeps; parameters are left out and a storage counted once. Measured
at two sequence lengths (batch 1), the bytes per layer fit a*s + b*s^2: `a` is what the planner
calls activations per token per layer (printed in units of the hidden size h), `b * s^2` the
attention scores, which the local layer spec used on CPU keeps and flash attention (Transformer
Engine, on GPU) does not. The embedding and output layer are measured with one layer and taken out.

Each mode is a learner setting (policy/activation_memory.py): plain, the fused SwiGLU, selective
recompute of the MLP / of core attention, full recompute; `--tp 2` runs two gloo ranks
with sequence parallelism. The planner's sum for the same flags is printed beside each (target:
within 15%), and with `--terms` its terms.

  python tools/checks/measure_activations.py [--model Qwen/Qwen3-4B-Base] [--hidden 256] [--tp 2] [--modes plain,full]

CPU: Transformer Engine's fused layers save a different set on GPU, which tools/checks/gpu_check.py measures.
"""
from __future__ import annotations

import argparse
import os
import sys
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

MODES = {  # name -> PolicyTrainConfig fields
    "plain": dict(fused_swiglu="off"),
    "fused_swiglu": dict(fused_swiglu="on"),
    "recompute_mlp": dict(fused_swiglu="off", recompute="selective", recompute_modules=["mlp"]),
    "recompute_core_attn": dict(fused_swiglu="off", recompute="selective", recompute_modules=["core_attn"]),
    "recompute_full": dict(fused_swiglu="off", recompute="full"),
}


def saved_bytes(learner, seq: int) -> int:
    """Bytes autograd saves in one forward of a [1, seq] micro-batch (parameters excluded);
    `learner`: what `build` returns (or a Learner)."""
    from spice_megatron.policy import cpu_compat

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
    tokens, positions = tokens.to(learner.device), torch.arange(seq, device=learner.device).unsqueeze(0)
    learner.model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), cpu_compat.cuda_to_cpu():
        out = learner.model(tokens, positions, attention_mask=None)
    del out
    return total


def hf_config(hidden: int, layers: int, moe: bool, model: str = "", tp: int = 1, family: str = "qwen3") -> dict:
    """A few layers of `model`'s widths (a known hub id or an HF directory), or a small Qwen3 or
    Llama (with at least `tp` key-value heads)."""
    from spice_megatron.data.offline_assets import tiny_hf_config

    if model:
        from spice_megatron.plan.planner import model_spec

        return dict(model_spec(model).hf_config, num_hidden_layers=layers, vocab_size=1024, tie_word_embeddings=False)
    heads = max(4, hidden // 64)
    return tiny_hf_config("qwen3_moe" if moe else family, vocab_size=1024, hidden_size=hidden, num_layers=layers,
                          num_heads=heads, num_kv_heads=max(heads // 4, tp), head_dim=64, intermediate_size=3 * hidden,
                          num_experts=16, top_k=4, moe_intermediate_size=hidden // 2)


def build(config: dict, tp: int, dtype: str, train: dict) -> SimpleNamespace:
    """The learner's model as the Learner builds it (the same flags, config and layer spec), without
    its gradient buffers and optimizer, so that real widths fit in host memory (Llama-3-70B's two
    layers are 1.7B parameters: 3.4 GB in bf16, 17 GB with the learner's fp32 buffers)."""
    from spice_megatron.config import ParallelConfig, PolicyTrainConfig
    from spice_megatron.families import model_spec_from_hf
    from spice_megatron.policy.learner import resolve_dtype
    from spice_megatron.policy.model import build_policy_model
    from spice_megatron.policy.parallel import current_layout, init_distributed

    parallel, train_cfg = ParallelConfig(tensor_parallel=tp), PolicyTrainConfig(dtype=dtype, shared_prefix="off",
                                                                                **train)
    train_cfg.validate()
    init_distributed(parallel)
    spec = model_spec_from_hf(config)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    # the values do not matter for what is saved: no initialisation (megatron's CPU one makes fp32
    # master copies of every weight, 14 GB for Llama-3-70B's two layers)
    model, _, flags = build_policy_model(spec, parallel, train_cfg, current_layout(), resolve_dtype(dtype), device,
                                         perform_initialization=False)
    return SimpleNamespace(model=model, spec=spec, device=device, activation_flags=flags)


def measure(config: dict, tp: int, dtype: str, train: dict, lengths: tuple[int, int] = (64, 128)) -> dict:
    """On this rank (a world of `tp` ranks): per token per layer bytes `a`, the s^2 coefficient `b`,
    and the planner's terms for the learner's flags."""
    from spice_megatron.policy.activation_memory import activation_terms

    layers = config["num_hidden_layers"]
    per = {}
    for n in (layers, 1):  # embedding, final norm and logits: the same in a one-layer model
        model = build(dict(config, num_hidden_layers=n), tp, dtype, train)
        per[n] = {s: saved_bytes(model, s) for s in lengths}
        flags, spec = model.activation_flags, model.spec
        del model
    s1, s2 = lengths
    y1, y2 = ((per[layers][s] - per[1][s]) / (layers - 1) for s in lengths)
    b = (y2 / s2 - y1 / s1) / (s2 - s1)  # y = a s + b s^2 through both points
    a = y1 / s1 - b * s1
    return {"a": a, "b": b, "terms": activation_terms(spec, tp, flags), "hidden": spec.hidden_size,
            "flags": flags}


def _rank(rank: int, tp: int, port: int, config: dict, dtype: str, modes: list[str], out: dict) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(tp), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    results = {m: measure(config, tp, dtype, MODES[m]) for m in modes}
    if rank == 0:
        out.update(results)


def run(config: dict, tp: int, dtype: str, modes: list[str]) -> dict:
    # megatron compiles its fused SwiGLU with torch.compile (~20 s per new length on CPU); what it
    # saves is the same eager, so the fuser is turned off before megatron's modules are imported
    from megatron.core import jit

    jit.disable_jit_fuser()
    from spice_megatron.torchrun import free_port

    if tp == 1:
        out: dict = {}
        _rank(0, 1, free_port(), config, dtype, modes, out)
        return out
    import torch.multiprocessing as mp

    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank, args=(tp, free_port(), config, dtype, modes, out), nprocs=tp)
        return dict(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--moe", action="store_true", help="Qwen3-MoE layers (16 experts of hidden/2, top-4)")
    ap.add_argument("--family", choices=["qwen3", "llama"], default="qwen3", help="the small model's (no --model)")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16")
    ap.add_argument("--model", default="", help="a recipe model's widths, e.g. Qwen/Qwen3-4B-Base (planner's "
                    "known models) or an HF directory; --hidden and --moe are then ignored")
    ap.add_argument("--tp", type=int, default=1, help="tensor parallel ranks (gloo); > 1: sequence parallel")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated: {', '.join(MODES)}")
    ap.add_argument("--terms", action="store_true", help="print the planner's terms of each mode")
    args = ap.parse_args()
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        ap.error(f"--modes: unknown {unknown}")
    if args.layers < 2:
        ap.error("--layers: at least 2 (one layer's model is the baseline taken out)")
    torch.set_num_threads(1)
    config = hf_config(args.hidden, args.layers, args.moe, args.model, args.tp, args.family)
    results = run(config, args.tp, args.dtype, modes)
    what = args.model or ("Qwen3-MoE" if args.moe else args.family)
    print(f"{what} hidden {config['hidden_size']}, {args.dtype}, TP={args.tp}"
          f"{' (sequence parallel)' if args.tp > 1 else ''}: bytes saved per token per layer on one rank, "
          "in units of h, bf16")
    worst = 0.0
    for mode in modes:
        r = results[mode]
        h = r["hidden"]
        measured = r["a"] if args.dtype == "bf16" else r["a"] / 2  # the planner counts bf16 activations
        planned = sum(r["terms"].values())
        ratio = measured / planned
        worst = max(worst, abs(ratio - 1))
        print(f"  {mode:20s} measured {measured / h:6.1f} h   planner {planned / h:6.1f} h   measured / planned "
              f"{ratio:.2f}   attention scores {r['b']:.1f} bytes x s^2")
        if args.terms:
            for name, value in r["terms"].items():
                print(f"      {name:45s} {value / h:6.2f} h")
    if args.moe:
        print("  (MoE layers: the planner's expert term is Korthikanti-style, not per saved tensor; not held to 15%)")
    print(f"largest |measured / planned - 1|: {worst:.2f} (target <= 0.15)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
