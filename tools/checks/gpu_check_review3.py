"""gpu_check's checks of GPU review 3 (issue 62, ../shared/notes/review-gpu-3.md section 9): context
parallelism without Transformer Engine (memory), the FP8 engine guard, the weight sync's receive
order over NCCL, and TE's context parallelism against one rank. Each returns (ok | None for skipped,
figures); tools/checks/gpu_check.py prints them. Run as a script, it is one member of the NCCL receive check
(`--sync-member`) or one rank of the TE context-parallel check (`--cp-rank`)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _peak_gib(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def check_cp_attention_without_te() -> tuple[bool | None, str]:
    """G1: one CP rank's attention (CP=2, Qwen3-8B's 32 query and 8 KV heads, an 8,192-token row,
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


def check_fp8_engine_guard(work: str) -> tuple[bool | None, str]:
    """G2: a tiny Qwen3 saved with block-FP8 weights (the published Qwen3-*-FP8 form): the engine guard
    refuses it, `spice convert bf16` writes the copy the engines serve, and that copy's weights are
    what the learner imports (dequantized on this device)."""
    from gpu_tiny import TINY, make_tiny_qwen3
    from safetensors.torch import load_file, save_file

    from spice_megatron.bridge.dequantize import QuantizedEngineModel, check_engine_model
    from spice_megatron.bridge.hf_io import HFCheckpointReader

    src = make_tiny_qwen3(os.path.join(work, "fp8_src"))
    fp8, bf16 = os.path.join(work, "fp8"), os.path.join(work, "fp8_bf16")
    os.makedirs(fp8)
    block, tensors = 32, {}
    for name, w in load_file(os.path.join(src, "model.safetensors")).items():
        if w.dim() == 2 and ".layers." in name:
            blocks = w.view(w.shape[0] // block, block, w.shape[1] // block, block)
            scale = blocks.abs().amax(dim=(1, 3)) / 448.0
            tensors[name] = (blocks / scale[:, None, :, None]).view_as(w).to(torch.float8_e4m3fn)
            tensors[name + "_scale_inv"] = scale.float()
        else:
            tensors[name] = w
    save_file(tensors, os.path.join(fp8, "model.safetensors"))
    with open(os.path.join(fp8, "config.json"), "w") as f:
        json.dump({**TINY, "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                                                   "weight_block_size": [block, block]}}, f)
    try:
        check_engine_model(fp8)
        return False, "the guard let an FP8 engine directory through"
    except QuantizedEngineModel:
        pass
    r = subprocess.run([sys.executable, "-m", "spice_megatron.cli", "convert", "bf16", "--model", fp8, "--output",
                        bf16],
                       capture_output=True, text=True, timeout=300, cwd=os.path.dirname(HERE))
    if r.returncode != 0:
        return False, f"spice convert bf16 failed: {r.stderr[-500:]}"
    check_engine_model(bf16)
    reader, copy = HFCheckpointReader(fp8), load_file(os.path.join(bf16, "model.safetensors"))
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    wrong = [n for n in copy if not torch.equal(copy[n].to(dev), reader.read(n, None, None, None).to(dev))]
    return not wrong, (f"FP8 directory refused for the engines; bf16 copy of {len(copy)} tensors, "
                       f"{len(wrong)} differing from the learner's import")


def _sync_member(port: int, rank: int, syncs: int, backend: str, out: str) -> None:
    """One member of check_receive_order: ranks 0-1 stage senders, 2-3 receivers (GPU `rank`)."""
    from spice_megatron.bridge import weight_sync
    from spice_megatron.bridge.weight_receive import receive_all
    from spice_megatron.bridge.weight_sync import BucketSender, WeightSyncGroup

    if backend == "nccl":
        torch.cuda.set_device(rank)
    group = WeightSyncGroup("127.0.0.1", port, rank, 2, 2, backend=backend, timeout_s=60)
    order, received = [], 0
    if rank >= 2:
        original = weight_sync.WeightSyncGroup.broadcast

        def recorded(self, tensor, stage, async_op=False):
            order.append(stage)
            return original(self, tensor, stage, async_op)

        weight_sync.WeightSyncGroup.broadcast = recorded
    for version in range(1, syncs + 1):
        if rank < 2:
            sender = BucketSender(group, version, bucket_bytes=256 << 10)
            for i in range(8):
                sender.reserve([(f"stage{rank}.t{i}", (16 << 10,), torch.float32)])[0].fill_(version + i)
            sender.close()
        else:
            for bucket in receive_all(group, concurrent=True):
                received += len(bucket)
                if backend == "nccl":
                    torch.cuda.empty_cache()  # a device-synchronising call between the collectives
    group.close()
    with open(out, "w") as f:
        json.dump({"order": order, "received": received}, f)


def check_receive_order(work: str) -> tuple[bool | None, str]:
    """G3: two stage senders and two receivers (four GPUs, NCCL) through 200 syncs of small buckets,
    each receiver emptying the allocator's cache after every bucket: no hang, the same issue order on
    both receivers. Fewer than four GPUs: the same over gloo on CPU, 20 syncs (the order only)."""
    nccl = torch.cuda.is_available() and torch.cuda.device_count() >= 4
    backend, syncs = ("nccl", 200) if nccl else ("gloo", 20)
    port = _free_port()
    outs = [os.path.join(work, f"sync_member_{r}.json") for r in range(4)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), HERE, os.environ.get("PYTHONPATH", "")])}
    if not nccl:
        env["CUDA_VISIBLE_DEVICES"] = ""
    procs = [subprocess.Popen([sys.executable, __file__, "--sync-member", str(port), str(r), str(syncs), backend,
                               outs[r]], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
             for r in range(4)]
    try:
        codes = [p.wait(240) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        return False, f"{backend}: the sync hung (no end within 240 s)"
    if any(codes):
        failed = procs[codes.index(next(c for c in codes if c))]
        return False, f"{backend}: member exit codes {codes}: {failed.stderr.read()[-400:]!r}"
    a, b = (json.load(open(outs[r])) for r in (2, 3))
    same = a["order"] == b["order"]
    note = "" if nccl else " (fewer than 4 GPUs: gloo on CPU)"
    return same and a["received"] == b["received"] == 16 * syncs, (
        f"{backend}, {syncs} syncs{note}: {a['received']} tensors per receiver, {len(a['order'])} collectives each, "
        f"issue orders {'the same' if same else 'DIFFERENT'}")


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
    """G4: Transformer Engine's context parallelism (two GPUs): the tiny Qwen3's log-probs at CP=2
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


if __name__ == "__main__":
    if sys.argv[1] == "--sync-member":
        _sync_member(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6])
    elif sys.argv[1] == "--cp-rank":
        sys.path.insert(0, HERE)
        import torch.distributed as dist

        dist.init_process_group("nccl")
        torch.cuda.set_device(dist.get_rank())
        _cp_rank(sys.argv[2], sys.argv[3])
        dist.destroy_process_group()
    else:
        with tempfile.TemporaryDirectory() as d:
            print(check_receive_order(d))
