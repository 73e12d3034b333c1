"""Streaming the learner's weights to the rollout engines.

The weight-sync group lives outside the learner's torch.distributed world: its own TCPStore
rendezvous at an address/port the engines are given. Its members are one sending rank per
pipeline stage (sync ranks 0..PP-1) and every rollout-engine worker (sync ranks PP..). Each stage
has a process group of its own ({its sender} + all receivers), so the stages pack and send
concurrently and no sender relays another stage's bytes. A stage sends its weights, converted to
HF names and full (TP-gathered) tensors, as a sequence of messages:

  header   int64[1]  length of the metadata
  meta     uint8[n]  JSON {"version", "stage", "end": false, "tensors": [[name, dtype, shape, offset, nbytes]]}
  payload  uint8[m]  the tensors' bytes, back to back
  ...
  header + meta      {"version", "stage", "end": true, "checksums": {name: checksum}}

The bucket is two half-size buffers: one is on the wire while the other fills, so the sender holds
at most one bucket plus the tensor being gathered, and packing overlaps sending. Tensors larger
than half a bucket go out directly from their own memory. Checksums are computed while the
bucket is in flight and sent last; the engine checks what it loaded against them. No pickle
crosses the wire.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Iterable, Iterator

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 512 * 2**20
_DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32)}
_MOD = 2**31 - 1
_CHUNK = 1 << 14
_BLOCK = 1 << 20  # words per float64 block: 8 MiB of temporaries


class WeightSyncError(RuntimeError):
    pass


def tensor_checksum(t: torch.Tensor) -> int:
    """A position-sensitive checksum of a tensor's bytes, exact on any device and in any
    summation order: 16-bit words times small weights summed in float64 stay integers below
    2^53, so BLAS may add them in any order and still agree bit for bit."""
    raw = t.detach().contiguous().view(-1).view(torch.uint8)
    nbytes = raw.numel()
    if nbytes % 2:
        raw = torch.cat([raw, raw.new_zeros(1)])
    words = raw.view(torch.int16)
    inner = ((torch.arange(_CHUNK, dtype=torch.float64, device=words.device) * 40503) % 251) + 1
    total = 0
    for start in range(0, words.numel(), _BLOCK):  # bounded float64 temporaries
        block = words[start:start + _BLOCK]
        pad = (-block.numel()) % _CHUNK
        if pad:
            block = torch.cat([block, block.new_zeros(pad)])
        sums = block.view(-1, _CHUNK).to(torch.float64) @ inner  # each < 2^15 * 2^8 * 2^14
        idx = torch.arange(sums.numel(), dtype=torch.float64, device=sums.device) + start // _CHUNK
        weights = (idx * 2909 % 251) + 1  # partial sums stay below 2^31 * 2^8 * 2^10 < 2^53
        total = (total + int(torch.remainder(torch.remainder(sums, _MOD) * weights, _MOD).sum().item())) % _MOD
    return total ^ (nbytes << 31)


@dataclass
class SyncReport:
    version: int
    seconds: float = 0.0
    bytes: int = 0
    buckets: int = 0
    tensors: int = 0
    checksums: dict[str, int] = field(default_factory=dict)

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds else 0.0


def _make_pg(store, prefix: str, rank: int, size: int, backend: str, timeout: timedelta):
    store = dist.PrefixStore(prefix, store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, opts)
    raise ValueError(f"backend: unknown {backend!r} (gloo, nccl)")


class WeightSyncGroup:
    """Per-stage process groups of the weight sync; does not touch torch.distributed's default world.

    sync_rank < num_stages: the sender of that stage; otherwise a receiver (an engine worker).
    """

    def __init__(self, host: str, port: int, sync_rank: int, num_stages: int, num_receivers: int,
                 backend: str = "auto", timeout_s: float = 600.0):
        backend = ("nccl" if torch.cuda.is_available() else "gloo") if backend == "auto" else backend
        if not 0 <= sync_rank < num_stages + num_receivers:
            raise ValueError(f"sync_rank {sync_rank} outside [0, {num_stages + num_receivers})")
        self.sync_rank, self.num_stages, self.num_receivers, self.backend = sync_rank, num_stages, num_receivers, backend
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore(host, port, num_stages + num_receivers, is_master=sync_rank == 0, timeout=timeout)
        size = num_receivers + 1
        self.pgs: dict[int, object] = {}  # stage -> process group (sender is its rank 0)
        if sync_rank < num_stages:
            self.pgs[sync_rank] = _make_pg(store, f"spice_sync_stage{sync_rank}", 0, size, backend, timeout)
        else:
            for stage in range(num_stages):
                self.pgs[stage] = _make_pg(store, f"spice_sync_stage{stage}", 1 + sync_rank - num_stages, size,
                                           backend, timeout)
        self._store = store
        self._buffers: dict[str, list[torch.Tensor]] = {}

    @property
    def is_sender(self) -> bool:
        return self.sync_rank < self.num_stages

    def broadcast(self, tensor: torch.Tensor, stage: int, async_op: bool = False):
        opts = dist.BroadcastOptions()
        opts.rootRank = 0  # the stage's sender
        work = self.pgs[stage].broadcast([tensor], opts)
        return work if async_op else work.wait()

    def buffers(self, kind: str, count: int, nbytes: int) -> list[torch.Tensor]:
        """Byte buffers kept across syncs: fresh allocations would page-fault on every sync."""
        cached = self._buffers.get(kind, [])
        if len(cached) != count or cached[0].numel() < nbytes:
            cached = [torch.empty(nbytes, dtype=torch.uint8, device=self.device) for _ in range(count)]
            self._buffers[kind] = cached
        return cached

    def barrier(self) -> None:
        for stage in sorted(self.pgs):
            self.broadcast(torch.zeros(1, device=self.device), stage)

    def close(self) -> None:
        self._buffers.clear()
        for pg in self.pgs.values():
            try:
                pg.shutdown()
            except Exception:  # already torn down by a peer; nothing left to release
                pass


# ----------------------------------------------------------------------------- sending

def _send_meta(group: WeightSyncGroup, stage: int, meta: dict) -> None:
    data = torch.frombuffer(bytearray(json.dumps(meta).encode()), dtype=torch.uint8).to(group.device)
    group.broadcast(torch.tensor([data.numel()], dtype=torch.long, device=group.device), stage)
    group.broadcast(data, stage)


def _recv_meta(group: WeightSyncGroup, stage: int) -> dict:
    n = torch.zeros(1, dtype=torch.long, device=group.device)
    group.broadcast(n, stage)
    buf = torch.empty(int(n.item()), dtype=torch.uint8, device=group.device)
    group.broadcast(buf, stage)
    return json.loads(bytes(buf.cpu().numpy()).decode())


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1).view(torch.uint8)


def send_stage(group: WeightSyncGroup, pairs: Iterable[tuple[str, torch.Tensor]], version: int,
               bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> SyncReport:
    """Send one stage's (hf_name, tensor) pairs; each tensor is packed as soon as it is produced."""
    stage = group.sync_rank
    report = SyncReport(version)
    t0 = time.perf_counter()
    half = max(bucket_bytes // 2, 1)
    buffers = group.buffers("send", 2, half)
    in_flight: list = [None, None]  # per buffer: (work, entries) still on the wire
    current, used, entries = 0, 0, []

    def settle(i: int) -> None:
        """Wait for buffer i's broadcast (its checksums were computed while it was sent)."""
        if in_flight[i] is not None:
            in_flight[i].wait()
            in_flight[i] = None

    def launch(payload: torch.Tensor, items: list, views: list[torch.Tensor]) -> object:
        _send_meta(group, stage, {"version": version, "stage": stage, "end": False, "tensors": items})
        work = group.broadcast(payload, stage, async_op=True)
        for item, view in zip(items, views):  # overlaps the transfer; the bytes are only read
            report.checksums[item[0]] = tensor_checksum(view)
        report.buckets += 1
        report.bytes += payload.numel()
        return work

    def flush() -> None:
        nonlocal current, used, entries
        if entries:
            buf = buffers[current]
            views = [buf[e[3]:e[3] + e[4]].view(_DTYPES[e[1]]).view(e[2]) for e in entries]
            in_flight[current] = launch(buf[:used], entries, views)
            current = 1 - current
            settle(current)  # the other half must be free before it is refilled
        used, entries = 0, []

    for name, tensor in pairs:
        t = tensor.detach()
        nbytes = t.numel() * t.element_size()
        entry = [name, str(t.dtype), list(t.shape), 0, nbytes]
        if nbytes > half:  # too large for a half bucket: send it from its own memory
            flush()
            settle(1 - current)
            t = t.contiguous()
            launch(_as_bytes(t).to(group.device), [entry], [t]).wait()
        else:
            if used + nbytes > half:
                flush()
            entry[3] = used
            # one strided copy straight into the bucket (q/k/v and gate/up arrive as views)
            buffers[current][used:used + nbytes].view(t.dtype).view(t.shape).copy_(t)
            entries.append(entry)
            used += nbytes
        report.tensors += 1
        del t, tensor
    flush()
    settle(0)
    settle(1)
    _send_meta(group, stage, {"version": version, "stage": stage, "end": True, "checksums": report.checksums})
    report.seconds = time.perf_counter() - t0
    return report


# ----------------------------------------------------------------------------- receiving

@dataclass
class ReceivedManifest:
    """What the senders said they sent: the checksums arrive after each stage's last bucket."""

    version: int | None = None
    checksums: dict[str, int] = field(default_factory=dict)


def receive_stage(group: WeightSyncGroup, stage: int, manifest: ReceivedManifest | None = None,
                  reuse_buffer: bool = False) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Buckets of (name, tensor) from one stage's sender; the tensors are views of the bucket.
    With reuse_buffer, one receive buffer serves every bucket: a bucket's tensors are valid only
    until the next one arrives (an engine that loads each bucket as it comes needs no more)."""
    while True:
        meta = _recv_meta(group, stage)
        if manifest is not None:
            manifest.version = meta["version"]
        if meta["end"]:
            if manifest is not None:
                manifest.checksums.update(meta["checksums"])
            return
        size = max(e[3] + e[4] for e in meta["tensors"])
        payload = (group.buffers("recv", 1, size)[0][:size] if reuse_buffer
                   else torch.empty(size, dtype=torch.uint8, device=group.device))
        group.broadcast(payload, stage)
        bucket = []
        for name, dtype, shape, offset, nbytes in meta["tensors"]:
            if dtype not in _DTYPES:
                raise WeightSyncError(f"tensor {name!r}: unsupported dtype {dtype}")
            bucket.append((name, payload[offset:offset + nbytes].view(_DTYPES[dtype]).view(shape)))
        yield bucket


def receive_all(group: WeightSyncGroup, manifest: ReceivedManifest | None = None, reuse_buffer: bool = False
                ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Every stage's buckets, stage by stage (what an engine worker consumes)."""
    for stage in range(group.num_stages):
        yield from receive_stage(group, stage, manifest, reuse_buffer)


def verify_checksums(held: Iterable[tuple[str, torch.Tensor]], manifest: ReceivedManifest) -> int:
    """Compare the tensors a receiver holds with the senders' checksums; raises naming the first
    mismatching or missing tensor. Returns the number checked."""
    return compare_checksums({name: tensor_checksum(t) for name, t in held}, manifest)


def compare_checksums(held: dict[str, int], manifest: ReceivedManifest) -> int:
    """The same check from checksums already computed (an engine checksums each tensor as it loads it)."""
    for name, checksum in held.items():
        expected = manifest.checksums.get(name)
        if expected is None:
            raise WeightSyncError(f"tensor {name!r} is held by the engine but was not sent (version {manifest.version})")
        if checksum != expected:
            raise WeightSyncError(f"tensor {name!r} differs from the learner's after the sync "
                                  f"(version {manifest.version})")
    missing = sorted(set(manifest.checksums) - set(held))
    if missing:
        raise WeightSyncError(f"tensor {missing[0]!r} was sent but the engine does not hold it "
                              f"({len(missing)} missing, version {manifest.version})")
    return len(held)


def send_learner_weights(learner, group: WeightSyncGroup | None, version: int,
                         bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> SyncReport | None:
    """Collective over the learner: every rank calls it. The TP ranks of data-parallel rank 0
    gather each stage's tensors; the stage's TP rank 0 (its member of the sync group) sends.
    Returns the stage sender's report (None on other ranks)."""
    from spice_megatron.bridge.export import gather_stage_tensors

    lay = learner.layout
    if lay.dp_rank != 0:
        return None
    pairs = gather_stage_tensors(learner)
    if lay.tp_rank != 0:
        for _ in pairs:  # take part in the TP gathers only
            pass
        return None
    if group is None or group.sync_rank != lay.pp_rank:
        raise WeightSyncError(f"stage {lay.pp_rank}'s sender needs a WeightSyncGroup with sync_rank {lay.pp_rank}")
    try:
        return send_stage(group, pairs, version, bucket_bytes)
    except Exception:
        # A receiver died mid-sync. The other TP ranks are still inside the stage's gathers: take
        # part in the rest of them, so that the learner stays in step and can retry.
        for _ in pairs:
            pass
        raise
