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
  header + trailer   {"checksums": [per tensor], "mac": HMAC(sync key, version|stage|bucket|tensors|checksums)}
  ...
  header + meta      {"version", "stage", "end": true, "buckets": count, "checksums": {name: checksum}, "mac"}

The engines' side receives (bridge/weight_receive.py). A receiver checks each bucket's tensors
against its trailer, and the trailer's MAC with the sync's key (wire/auth.sync_key: derived from
the job's token and a nonce the trainer sent over the signed HTTP plane), before it hands the
bucket on: a process that joined the group without the token can make a sync fail, never load
weights. The rendezvous store listens on the address the engines are given only, not on every
interface.

The bucket is two half-size buffers: one is on the wire while the other fills, so the sender holds
at most one bucket plus the tensor being gathered, and filling overlaps sending. The TP gather
writes shards straight into their bucket slots (offsets aligned to 64 bytes), so a gathered
tensor is never copied again. A parameter whose tensors exceed half a bucket goes out in a buffer
of its own. Checksums are computed while the bucket is in flight and sent last; the engine checks
what it loaded against them. No pickle crosses the wire.
"""
from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from spice_megatron.bridge.sync_integrity import WeightSyncError, check_membership, tensor_checksum
from spice_megatron.torchrun import listen_on
from spice_megatron.wire.auth import mac

log = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 512 * 2**20
# the dtypes a bucket entry may name (wire name -> dtype)
DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32)}
_ALIGN = 64  # bytes: every tensor in a bucket starts aligned, so it can be viewed as any dtype


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
        self.sync_rank, self.num_stages = sync_rank, num_stages
        self.num_receivers, self.backend = num_receivers, backend
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        timeout = timedelta(seconds=timeout_s)
        # the store owns the socket from here (it closes the fd): Python's object lets go of it
        listen_fd = listen_on(host, port).detach() if sync_rank == 0 else None
        store = dist.TCPStore(host, port, num_stages + num_receivers, is_master=sync_rank == 0, timeout=timeout,
                              master_listen_fd=listen_fd)
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

    def stage_group(self, stage: int):
        if stage not in self.pgs:
            raise WeightSyncError(f"the weight-sync group is closed (stage {stage})")
        return self.pgs[stage]

    def broadcast(self, tensor: torch.Tensor, stage: int, async_op: bool = False):
        opts = dist.BroadcastOptions()
        opts.rootRank = 0  # the stage's sender
        work = self.stage_group(stage).broadcast([tensor], opts)
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
        # released here, not at interpreter exit (a store server torn down then can abort the process)
        self.pgs, self._store = {}, None


# ----------------------------------------------------------------------------- sending

def _send_meta(group: WeightSyncGroup, stage: int, meta: dict, async_op: bool = False) -> list:
    """Blocking, or with async_op the two broadcasts' works (their tensors stay alive with them)."""
    data = torch.frombuffer(bytearray(json.dumps(meta).encode()), dtype=torch.uint8).to(group.device)
    length = torch.tensor([data.numel()], dtype=torch.long, device=group.device)
    works = [(group.broadcast(t, stage, async_op=True), t) for t in (length, data)]
    if not async_op:
        for work, _ in works:
            work.wait()
    return works


def signed_fields(key: bytes | None, *fields) -> str:
    return mac(key, json.dumps(fields, separators=(",", ":")).encode()) if key else ""


# a bucket's metadata (~100 bytes per tensor): its length is unsigned, so it is capped before allocating
MAX_META_BYTES = 64 * 2**20


def recv_meta(group: WeightSyncGroup, stage: int) -> dict:
    n = torch.zeros(1, dtype=torch.long, device=group.device)
    group.broadcast(n, stage)
    if not 0 < int(n.item()) <= MAX_META_BYTES:
        raise WeightSyncError(f"stage {stage}: a bucket's metadata of {int(n.item())} bytes (at most "
                              f"{MAX_META_BYTES}): "
                              "refused before allocating")
    buf = torch.empty(int(n.item()), dtype=torch.uint8, device=group.device)
    group.broadcast(buf, stage)
    return json.loads(bytes(buf.cpu().numpy()).decode())


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


TensorSpec = tuple[str, tuple[int, ...], torch.dtype]  # (hf_name, shape, dtype)


def _layout(start: int, specs: list[TensorSpec]) -> tuple[list, int]:
    """Bucket entries [name, dtype, shape, offset, nbytes] for tensors placed from byte `start`, and the end."""
    entries, end = [], start
    for name, shape, dtype in specs:
        offset = _aligned(end)
        nbytes = math.prod(shape) * dtype.itemsize
        entries.append([name, str(dtype), list(shape), offset, nbytes])
        end = offset + nbytes
    return entries, end


def bucket_views(payload: torch.Tensor, entries: list) -> list[torch.Tensor]:
    views = []
    for name, dtype, shape, offset, nbytes in entries:
        if dtype not in DTYPES:
            raise WeightSyncError(f"tensor {name!r}: unsupported dtype {dtype}")
        views.append(payload[offset:offset + nbytes].view(DTYPES[dtype]).view(shape))
    return views


class BucketSender:
    """One stage's side of a sync: fills the two half buckets and sends them.

    `reserve` hands out bucket slots that the caller writes into (the TP gather places shards
    there directly, so a gathered tensor is never copied again). A reserved slot is sent once the
    next reservation, or `close`, shows that the caller has finished writing it. If sending
    fails (a receiver died), reservations keep being served from scratch memory so that the
    caller's collectives stay in step, and `close` raises the error.
    """

    def __init__(self, group: WeightSyncGroup, version: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 key: bytes | None = None):
        self.group, self.stage, self.key = group, group.sync_rank, key
        self.report = SyncReport(version)
        self.half = max(bucket_bytes // 2, 1)
        self.buffers = group.buffers("send", 2, self.half)
        self.in_flight: list = [None, None]  # per half: its broadcasts, until they complete
        self.current, self.used, self.entries = 0, 0, []
        self.own: tuple | None = None  # a reservation too large for a half bucket: (buffer, entries)
        self.error: BaseException | None = None
        self._t0 = time.perf_counter()
        try:
            check_membership(group, self.stage, key)
        except Exception as e:  # noqa: BLE001 - kept and raised by close(): the caller's gathers stay in step
            self.error = e

    # -- public
    def reserve(self, specs: list[TensorSpec]) -> list[torch.Tensor]:
        """Bucket slots for tensors the caller will write (all in the same bucket)."""
        if self.error is None:
            try:
                return self._reserve(specs)
            except Exception as e:  # noqa: BLE001 - kept and raised by close()
                self.error = e
        return [torch.empty(shape, dtype=dtype, device=self.group.device) for _, shape, dtype in specs]

    def close(self) -> SyncReport:
        """Send what is left, then the checksums; raises if any send failed."""
        if self.error is None:
            try:
                self._send_own()
                self._flush()
                self._settle(0)
                self._settle(1)
                version, buckets = self.report.version, self.report.buckets
                _send_meta(self.group, self.stage, {
                    "version": version, "stage": self.stage, "end": True, "buckets": buckets,
                    "checksums": self.report.checksums,
                    "mac": signed_fields(self.key, version, self.stage, "end", buckets, self.report.checksums)})
            except Exception as e:  # noqa: BLE001 - raised below
                self.error = e
        if self.error is not None:
            raise self.error
        self.report.seconds = time.perf_counter() - self._t0
        return self.report

    # -- internals
    def _reserve(self, specs: list[TensorSpec]) -> list[torch.Tensor]:
        self._send_own()
        self.report.tensors += len(specs)
        entries, need = _layout(0, specs)
        if need > self.half:
            self._flush()
            buffer = torch.empty(need, dtype=torch.uint8, device=self.group.device)
            self.own = (buffer, entries)
            return bucket_views(buffer, entries)
        if _aligned(self.used) + need > self.half:
            self._flush()
        entries, self.used = _layout(self.used, specs)
        self.entries += entries
        return bucket_views(self.buffers[self.current], entries)

    def _send_own(self) -> None:
        if self.own is not None:
            (buffer, entries), self.own = self.own, None
            self._flush()
            self._settle(1 - self.current)
            for work, _ in self._launch(buffer, entries):
                work.wait()

    def _launch(self, payload: torch.Tensor, entries: list) -> list:
        version, index = self.report.version, self.report.buckets
        _send_meta(self.group, self.stage, {"version": version, "stage": self.stage, "end": False, "tensors": entries})
        works = [(self.group.broadcast(payload, self.stage, async_op=True), payload)]
        # overlaps the transfer; only reads. Keyed with the sync's key: authenticates the bytes
        checksums = [tensor_checksum(view, self.key) for view in bucket_views(payload, entries)]
        self.report.checksums.update((entry[0], c) for entry, c in zip(entries, checksums))
        # queued behind the payload on the same group: receivers take them in this order
        works += _send_meta(self.group, self.stage, {
            "checksums": checksums, "mac": signed_fields(self.key, version, self.stage, index, entries, checksums)},
            async_op=True)
        self.report.buckets += 1
        self.report.bytes += payload.numel()
        return works

    def _settle(self, i: int) -> None:
        if self.in_flight[i] is not None:
            works, self.in_flight[i] = self.in_flight[i], None
            for work, _ in works:
                work.wait()

    def _flush(self) -> None:
        """Send the current half and make the other one ready to be filled."""
        if self.entries:
            self.in_flight[self.current] = self._launch(self.buffers[self.current][:self.used], self.entries)
            self.current = 1 - self.current
            self._settle(self.current)
        self.used, self.entries = 0, []


# ----------------------------------------------------------------------------- receiving

def send_learner_weights(learner, group: WeightSyncGroup | None, version: int,
                         bucket_bytes: int = DEFAULT_BUCKET_BYTES, key: bytes | None = None) -> SyncReport | None:
    """Collective over the learner: every rank calls it. The TP ranks of data-parallel rank 0 (and
    for experts the EP x ETP ranks of expert-data-parallel rank 0) gather each stage's tensors
    onto the stage's TP rank 0 of DP rank 0 (its member of the sync group), which
    places them straight into its send buckets. Returns the stage sender's report (None on other
    ranks). A failed send is raised only after the stage's gathers have all run, so that the
    learner stays in step and can retry."""
    from spice_megatron.bridge.export import gather_stage_tensors, holds_unique_weights

    lay = learner.layout
    if not holds_unique_weights(lay, learner.spec):
        return None
    if lay.tp_rank != 0 or not lay.first_replica:
        for _ in gather_stage_tensors(learner):  # sends this rank's shards
            pass
        return None
    if group is None or group.sync_rank != lay.pp_rank:
        raise WeightSyncError(f"stage {lay.pp_rank}'s sender needs a WeightSyncGroup with sync_rank {lay.pp_rank}")
    sender = BucketSender(group, version, bucket_bytes, key)
    for _ in gather_stage_tensors(learner, allocate=sender.reserve):
        pass
    return sender.close()
