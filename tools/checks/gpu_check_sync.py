#!/usr/bin/env python3
"""tools/checks/gpu_check.py's weight-sync checks: the sync to a receiver over gloo and NCCL, one receiving
thread per worker taking every stage in one order, NCCL with one rank, the versions and checksums
an engine reports, the stream handover, and two stage senders and two receivers issuing their
collectives in one order. `--receiver`, `--stage-sender` and `--order-member` are the processes the
checks start."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
from gpu_tiny import learner  # noqa: E402

from spice_megatron.torchrun import free_port  # noqa: E402


def _receiver(port: int, backend: str, out: str) -> None:
    from spice_megatron.bridge.sync_integrity import ReceivedManifest, verify_checksums
    from spice_megatron.bridge.weight_receive import receive_all
    from spice_megatron.bridge.weight_sync import WeightSyncGroup

    group = WeightSyncGroup("127.0.0.1", port, 1, 1, 1, backend=backend, timeout_s=120)
    received, manifest = {}, ReceivedManifest()
    for bucket in receive_all(group, manifest):
        received.update({k: t.cpu().clone() for k, t in bucket})
    verify_checksums(received.items(), manifest)
    group.close()
    torch.save(received, out)


def check_weight_sync(model_dir: str, work: str, backend: str) -> tuple[bool, str]:
    """The learner's stage sender (bf16 on the GPU) to a receiver in another process: over gloo the
    receiver is on CPU; over NCCL it needs a second GPU (NCCL refuses two ranks on one GPU)."""
    from spice_megatron.bridge.export import gathered_hf_state_dict
    from spice_megatron.bridge.weight_sync import WeightSyncGroup, send_learner_weights

    if backend == "nccl" and torch.cuda.device_count() < 2:
        return None, "needs 2 GPUs (NCCL refuses two ranks on one GPU); the gloo row covers the GPU-side gather"
    port, out = free_port(), os.path.join(work, f"received_{backend}.pt")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "1" if backend == "nccl" else ""}
    child = subprocess.Popen([sys.executable, __file__, "--receiver", str(port), backend, out], env=env,
                             stderr=subprocess.PIPE)
    lr = learner(model_dir, "bf16", 1e-6)
    group = WeightSyncGroup("127.0.0.1", port, 0, 1, 1, backend=backend, timeout_s=120)
    t0 = time.perf_counter()
    report = send_learner_weights(lr, group, version=1, bucket_bytes=1 << 20)
    seconds = time.perf_counter() - t0
    group.close()
    _, err = child.communicate(timeout=300)
    if child.returncode:
        return False, f"receiver failed: {err.decode()[-500:]}"
    received, sent = torch.load(out), gathered_hf_state_dict(lr)
    same = received.keys() == sent.keys() and all(torch.equal(received[k], sent[k].cpu()) for k in sent)
    return same, f"{report.tensors} tensors, {report.bytes / 2**20:.1f} MiB in {report.buckets} buckets, " \
                 f"{seconds:.2f}s, identical and checksummed: {same}"


def _stage_sender(port: int, stage: int) -> None:
    """A CPU stage sender of G2: 16 bf16 tensors of 8 MiB."""
    from spice_megatron.bridge.weight_sync import BucketSender, WeightSyncGroup

    group = WeightSyncGroup("127.0.0.1", port, stage, 2, 1, backend="gloo", timeout_s=120)
    g = torch.Generator().manual_seed(stage)
    sender = BucketSender(group, version=1, bucket_bytes=64 << 20)
    for i in range(16):
        t = torch.randn(4 << 20, generator=g).to(torch.bfloat16)
        sender.reserve([(f"stage{stage}.t{i}", tuple(t.shape), t.dtype)])[0].copy_(t)
    sender.close()
    group.close()


def check_concurrent_receive(on_gpu: bool) -> tuple[bool, str]:
    """G2: two stage senders (gloo, CPU processes) into one receiver whose buckets land on the GPU
    (gloo's CUDA broadcast orders only the receiving thread's stream, as NCCL's does), received
    concurrently and checksummed on the consumer's own stream, as an engine worker does; once with
    StreamHandover turned off (the race in the real code) and once as shipped. On CPU (the smoke
    run) the same path with CPU buckets, where there is no stream to race."""
    from spice_megatron.bridge.stream_handover import StreamHandover
    from spice_megatron.bridge.sync_integrity import ReceivedManifest, tensor_checksum
    from spice_megatron.bridge.weight_receive import receive_all
    from spice_megatron.bridge.weight_sync import WeightSyncGroup

    results = {}
    for with_handover in (False, True):
        port = free_port()
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
        senders = [subprocess.Popen([sys.executable, __file__, "--stage-sender", str(port), str(stage)], env=env,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for stage in (0, 1)]
        group = WeightSyncGroup("127.0.0.1", port, 2, 2, 1, backend="gloo", timeout_s=120)
        if on_gpu:
            group.device = torch.device("cuda", 0)
            torch.cuda.set_stream(torch.cuda.Stream())  # vLLM's worker reads on a stream of its own
        original = StreamHandover.to_current_stream
        if not with_handover:
            StreamHandover.to_current_stream = lambda self, tensors: None
        try:
            manifest, held = ReceivedManifest(), {}
            for bucket in receive_all(group, manifest, concurrent=True):
                held.update({name: tensor_checksum(t) for name, t in bucket})
        finally:
            StreamHandover.to_current_stream = original
            if on_gpu:
                torch.cuda.synchronize()
                torch.cuda.set_stream(torch.cuda.default_stream())
            group.close()
            for p in senders:
                p.wait(120)
        results[with_handover] = (sum(held.get(n) != c for n, c in manifest.checksums.items()), len(manifest.checksums))
    (bad_off, n), (bad_on, _) = results[False], results[True]
    return bad_on == 0 and n == 32, (f"{n} tensors (2 stages x 16 x 8 MiB bf16) received concurrently onto "
                                     f"{'the GPU' if on_gpu else 'CPU'}: "
                                     f"{bad_off} checksum mismatches without the stream handover, {bad_on} with it")


def check_nccl_one_rank(model_dir: str) -> tuple[bool, str]:
    """G6: the sync's raw ProcessGroupNCCL (its Options, timeout and shutdown) on a real CUDA torch:
    a group of the sender alone, the learner's weights through it, then close()."""
    from spice_megatron.bridge.weight_sync import WeightSyncGroup, send_learner_weights

    lr = learner(model_dir, "bf16", 1e-6)
    group = WeightSyncGroup("127.0.0.1", free_port(), 0, 1, 0, backend="nccl", timeout_s=60)
    report = send_learner_weights(lr, group, version=1, bucket_bytes=1 << 20)
    group.close()
    return report.tensors > 0, (f"{report.tensors} tensors in {report.buckets} buckets through a 1-rank NCCL "
                                "group, closed")


def check_versions_and_checksums(on_gpu: bool) -> tuple[bool, str]:
    """G0 of the review: the APIs the sync relies on, and checksums equal on GPU and CPU (the engines
    checksum what they load on their device, the senders on theirs)."""
    import torch.distributed as dist
    from megatron.core.optimizer import USING_PYTORCH_OPTIMIZER

    from spice_megatron.bridge.sync_integrity import tensor_checksum
    from spice_megatron.policy.model import have_transformer_engine

    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(n, generator=g).to(dtype) for n in (1, 3, 4099, 65_537, (1 << 21) + 5, 1 << 22)
               for dtype in (torch.float32, torch.bfloat16)]
    device = "cuda" if on_gpu else "cpu"
    equal = sum(tensor_checksum(t.to(device)) == tensor_checksum(t) for t in tensors)
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if on_gpu else "-"
    options = hasattr(dist, "ProcessGroupNCCL") and hasattr(dist.ProcessGroupNCCL, "Options")
    return equal == len(tensors), (f"checksums {device} == cpu {equal}/{len(tensors)} (up to 16 MiB, fp32/bf16); "
                                   f"nccl {nccl}; ProcessGroupNCCL.Options {options}; TE {have_transformer_engine()}; "
                                   f"torch optimizer fallback {USING_PYTORCH_OPTIMIZER}")


def check_stream_handover() -> tuple[bool, str]:
    """G1: a bucket written on the receiving thread's stream (NCCL's broadcast, modelled by a sleep
    then a fill) and read on another thread's current stream (vLLM's worker). Without the handover
    the read races the write; with StreamHandover it waits."""
    import queue
    import threading

    from spice_megatron.bridge.stream_handover import StreamHandover

    def race(handover: bool) -> bool:
        box: queue.Queue = queue.Queue()

        def receive() -> None:
            x = torch.zeros(1 << 24, device="cuda")
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                torch.cuda._sleep(200_000_000)  # the broadcast still writing
                x.fill_(1)
            torch.cuda.current_stream().wait_stream(side)  # what work.wait() does: this thread's stream only
            box.put((x, StreamHandover.mark(x.device)))

        torch.cuda.set_stream(torch.cuda.Stream())  # the consumer's own stream, as vLLM's worker has
        t = threading.Thread(target=receive)
        t.start()
        x, mark = box.get()
        t.join()
        if handover:
            mark.to_current_stream([x])
        ok = x.sum().item() == x.numel()
        torch.cuda.synchronize()
        torch.cuda.set_stream(torch.cuda.default_stream())
        return ok

    raced, handed = race(False), race(True)
    return handed and not raced, (f"read without the handover complete: {raced} (expected False: the race is real); "
                                  f"with StreamHandover: {handed}")


def _order_member(port: int, rank: int, syncs: int, backend: str, out: str) -> None:
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
    """Two stage senders and two receivers (four GPUs, NCCL) through 200 syncs of small buckets,
    each receiver emptying the allocator's cache after every bucket: no hang, the same issue order on
    both receivers. Fewer than four GPUs: the same over gloo on CPU, 20 syncs (the order only)."""
    nccl = torch.cuda.is_available() and torch.cuda.device_count() >= 4
    backend, syncs = ("nccl", 200) if nccl else ("gloo", 20)
    port = free_port()
    outs = [os.path.join(work, f"sync_member_{r}.json") for r in range(4)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    if not nccl:
        env["CUDA_VISIBLE_DEVICES"] = ""
    procs = [subprocess.Popen([sys.executable, __file__, "--order-member", str(port), str(r), str(syncs), backend,
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


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--receiver", nargs=3)
    ap.add_argument("--stage-sender", nargs=2, type=int)
    ap.add_argument("--order-member", nargs=5)
    args = ap.parse_args()
    if args.receiver:
        _receiver(int(args.receiver[0]), args.receiver[1], args.receiver[2])
    elif args.stage_sender:
        _stage_sender(*args.stage_sender)
    elif args.order_member:
        port, rank, syncs, backend, out = args.order_member
        _order_member(int(port), int(rank), int(syncs), backend, out)
