#!/usr/bin/env python3
"""tools/checks/gpu_check.py's context-parallel checks: one CP rank's attention without Transformer
Engine (the memory of the causal form against a boolean mask), and Transformer Engine's context
parallelism against one rank. `--cp-rank` is one rank of the second, under torchrun."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))


def _peak_gib(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def check_cp_attention_without_te() -> tuple[bool | None, str]:
    """One CP rank's attention (CP=2, Qwen3-8B's 32 query and 8 KV heads, an 8,192-token row,
    bf16) forward and backward: the old boolean-mask form (SDPA's math kernel on CUDA: it keeps the
    probabilities) against the two lower-right causal calls the learner runs now. On CPU, the same
    at 512 tokens for the values only."""
    import torch.nn.functional as F

    from spice_megatron.policy.context_parallel import causal_attention_over_gathered_keys, rank_positions

    on_gpu = torch.cuda.is_available()
    seq, cp, hq, hkv, d = (8192 if on_gpu else 512), 2, 32, 8, 128
    dev, dtype = ("cuda", torch.bfloat16) if on_gpu else ("cpu", torch.float32)
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(1, hq, seq // cp, d, device=dev, dtype=dtype, generator=g).requires_grad_()
    k = torch.randn(1, hkv, seq, d, device=dev, dtype=dtype, generator=g).requires_grad_()
    v = torch.randn(1, hkv, seq, d, device=dev, dtype=dtype, generator=g).requires_grad_()
    key_pos = torch.cat([rank_positions(seq, cp, r) for r in range(cp)]).to(dev)
    visible = key_pos.unsqueeze(0) <= rank_positions(seq, cp, 0).to(dev).unsqueeze(1)
    out = {}

    def mask_form():
        out["mask"] = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, enable_gqa=True)
        out["mask"].float().sum().backward()

    def causal_form():
        out["causal"] = causal_attention_over_gathered_keys(q, k, v, cp, 0, None, 0.0, True)
        out["causal"].float().sum().backward()

    if not on_gpu:
        mask_form()
        causal_form()
        diff = (out["mask"] - out["causal"]).abs().max().item()
        return diff < 1e-5, f"{seq} tokens CP=2 on CPU: max |causal form - mask form| {diff:.1e} (memory: needs a GPU)"
    before, after = _peak_gib(mask_form), _peak_gib(causal_form)
    diff = (out["mask"].float() - out["causal"].float()).abs().max().item()
    return diff < 3e-2 and after < before / 4, (f"one CP rank of {seq} tokens (CP=2, 32/8 heads, bf16), forward + "
                                                f"backward: mask form {before:.2f} GiB, causal form {after:.2f} GiB; "
                                                f"max |diff| {diff:.1e}")


def _cp_rank(model_dir: str, out: str) -> None:
    """One of two ranks of check_te_context_parallel: log-probs at CP=1 (DP=2), then at CP=2."""
    import torch.distributed as dist
    from gpu_tiny import batch

    from spice_megatron.bridge.hf_io import learner_from_hf
    from spice_megatron.config import OptimConfig, ParallelConfig, PolicyTrainConfig

    train = PolicyTrainConfig(max_gen_len=16, micro_batch_tokens=256, dtype="bf16", shared_prefix="off")
    got = {}
    for cp in (1, 2):
        learner = learner_from_hf(model_dir, ParallelConfig(context_parallel=cp), OptimConfig(lr=1e-6), train)
        got[cp] = learner.compute_logprobs(batch())
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
    if dist.get_rank() == 0:
        diff = max(abs(x - y) for a, b in zip(got[1], got[2]) for x, y in zip(a, b))
        with open(out, "w") as f:
            json.dump({"max_diff": diff}, f)


def check_te_context_parallel(model_dir: str, work: str) -> tuple[bool | None, str]:
    """Transformer Engine's context parallelism (two GPUs): the tiny Qwen3's log-probs at CP=2
    against CP=1 within bf16 tolerance."""
    from spice_megatron.policy.model import have_transformer_engine

    if not (torch.cuda.is_available() and torch.cuda.device_count() >= 2 and have_transformer_engine()):
        return None, "needs 2 GPUs and Transformer Engine"
    out = os.path.join(work, "te_cp.json")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", __file__, "--cp-rank",
                        model_dir, out], capture_output=True, text=True, timeout=400)
    if r.returncode != 0:
        return False, f"torchrun exit {r.returncode}: {r.stderr[-500:]!r}"
    diff = json.load(open(out))["max_diff"]
    return diff < 5e-2, f"log-probs CP=2 (TE) vs CP=1, bf16: max |diff| {diff:.1e}"


if __name__ == "__main__" and sys.argv[1:2] == ["--cp-rank"]:
    sys.path.insert(0, HERE)
    import torch.distributed as dist

    dist.init_process_group("nccl")
    torch.cuda.set_device(dist.get_rank())
    _cp_rank(sys.argv[2], sys.argv[3])
    dist.destroy_process_group()
