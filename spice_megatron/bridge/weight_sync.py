"""Streaming the learner's weights to the rollout engines.

A weight-sync process group, created outside the learner's torch.distributed world (its own
TCPStore rendezvous at an address/port the engines are given), joins one sending rank per
pipeline stage (ranks 0..PP-1) and every rollout-engine worker (ranks PP..). Each stage in turn
broadcasts its weights, converted to HF names and full (TP-gathered) tensors, in buckets:

  header   int64[1]  length of the metadata
  meta     uint8[n]  JSON: {"version", "stage", "end", "tensors": [[name, dtype, shape, offset, nbytes, checksum]]}
  payload  uint8[m]  the tensors' bytes, back to back (absent when "end")

The payload is one flat buffer per bucket, reused across buckets, so the sender holds at most one
bucket plus the tensor being gathered. Receivers yield (name, tensor) pairs bucket by bucket and
check every tensor's checksum on arrival; the checksums also let the engine verify, after
loading, that it holds exactly the learner's weights. No pickle crosses the wire.
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
_BLOCK = 1 << 24  # words per float64 block


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


class WeightSyncGroup:
    """A process group of its own: does not touch torch.distributed's default world."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, backend: str = "auto",
                 timeout_s: float = 600.0):
        backend = ("nccl" if torch.cuda.is_available() else "gloo") if backend == "auto" else backend
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout)
        store = dist.PrefixStore("spice_weight_sync", store)
        self._store = store
        if backend == "gloo":
            self.pg = dist.ProcessGroupGloo(store, rank, world_size, timeout)
        elif backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(store, rank, world_size, opts)
        else:
            raise ValueError(f"backend: unknown {backend!r} (gloo, nccl)")

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self.pg.broadcast([tensor], opts).wait()

    def barrier(self) -> None:
        self.broadcast(torch.zeros(1, device=self.device), 0)

    def close(self) -> None:
        try:
            self.pg.shutdown()
        except Exception:  # already torn down by the peer; nothing left to release
            pass


# ----------------------------------------------------------------------------- sending

def _send_meta(group: WeightSyncGroup, src: int, meta: dict) -> None:
    data = torch.frombuffer(bytearray(json.dumps(meta).encode()), dtype=torch.uint8).to(group.device)
    group.broadcast(torch.tensor([data.numel()], dtype=torch.long, device=group.device), src)
    group.broadcast(data, src)


def _recv_meta(group: WeightSyncGroup, src: int) -> dict:
    n = torch.zeros(1, dtype=torch.long, device=group.device)
    group.broadcast(n, src)
    buf = torch.empty(int(n.item()), dtype=torch.uint8, device=group.device)
    group.broadcast(buf, src)
    return json.loads(bytes(buf.cpu().numpy()).decode())


def send_stage(group: WeightSyncGroup, stage: int, pairs: Iterable[tuple[str, torch.Tensor]], version: int,
               bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> SyncReport:
    """Broadcast one stage's (hf_name, tensor) pairs from sync rank `stage`, packing each tensor
    into the bucket buffer as soon as it is produced."""
    report = SyncReport(version)
    t0 = time.perf_counter()
    buffer = torch.empty(bucket_bytes, dtype=torch.uint8, device=group.device)
    entries: list[list] = []
    used = 0

    def flush(end: bool) -> None:
        nonlocal entries, used
        if entries:
            _send_meta(group, stage, {"version": version, "stage": stage, "end": False, "tensors": entries})
            group.broadcast(buffer[:used], stage)
            report.buckets += 1
            report.bytes += used
        if end:
            _send_meta(group, stage, {"version": version, "stage": stage, "end": True, "tensors": []})
        entries, used = [], 0

    for name, tensor in pairs:
        t = tensor.detach().contiguous()
        nbytes = t.numel() * t.element_size()
        if used and used + nbytes > buffer.numel():
            flush(end=False)
        if nbytes > buffer.numel():  # a tensor larger than the bucket travels alone
            buffer = torch.empty(nbytes, dtype=torch.uint8, device=group.device)
        buffer[used:used + nbytes].copy_(t.view(-1).view(torch.uint8).to(group.device))
        checksum = tensor_checksum(t)
        entries.append([name, str(t.dtype), list(t.shape), used, nbytes, checksum])
        report.checksums[name] = checksum
        report.tensors += 1
        used += nbytes
        del t, tensor
    flush(end=True)
    report.seconds = time.perf_counter() - t0
    return report


def relay_stage(group: WeightSyncGroup, stage: int) -> None:
    """A sender of another stage takes part in stage `stage`'s broadcasts (and drops them)."""
    for _ in receive_stage(group, stage, verify=False):
        pass


# ----------------------------------------------------------------------------- receiving

def receive_stage(group: WeightSyncGroup, stage: int, verify: bool = True) -> Iterator[list[tuple[str, torch.Tensor, int]]]:
    """Buckets of (name, tensor, checksum) from stage `stage`'s sender."""
    while True:
        meta = _recv_meta(group, stage)
        if meta["end"]:
            return
        size = max(e[3] + e[4] for e in meta["tensors"])
        payload = torch.empty(size, dtype=torch.uint8, device=group.device)
        group.broadcast(payload, stage)
        bucket = []
        for name, dtype, shape, offset, nbytes, checksum in meta["tensors"]:
            if dtype not in _DTYPES:
                raise WeightSyncError(f"tensor {name!r}: unsupported dtype {dtype}")
            t = payload[offset:offset + nbytes].view(_DTYPES[dtype]).view(shape)
            if verify and tensor_checksum(t) != checksum:
                raise WeightSyncError(f"tensor {name!r}: checksum mismatch after transfer (version {meta['version']})")
            bucket.append((name, t, checksum))
        yield bucket


def receive_all(group: WeightSyncGroup, num_stages: int) -> Iterator[list[tuple[str, torch.Tensor, int]]]:
    """Every stage's buckets, in stage order (what an engine worker consumes)."""
    for stage in range(num_stages):
        yield from receive_stage(group, stage)


def send_learner_weights(learner, group: WeightSyncGroup | None, version: int,
                         bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> SyncReport | None:
    """Collective over the learner: every rank calls it. The TP ranks of data-parallel rank 0
    gather each stage's tensors; the stage's TP rank 0 (the member of the sync group) sends.
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
    report = None
    for stage in range(lay.pp):
        if stage == lay.pp_rank:
            report = send_stage(group, stage, pairs, version, bucket_bytes)
        else:
            relay_stage(group, stage)
    return report
