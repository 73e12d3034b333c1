"""The engines' side of the weight sync (bridge/weight_sync.py has the wire format and the
learner's side): each engine worker receives every pipeline stage's buckets, checks each bucket's
checksums and MAC before it hands the tensors on, and takes the stages' buckets in one fixed
interleave so that every worker issues its collectives in the same order (NCCL's rule)."""
from __future__ import annotations

import hmac
import queue
import threading
from typing import Callable, Iterator

import torch

from spice_megatron.bridge.stream_handover import StreamHandover
from spice_megatron.bridge.sync_integrity import ReceivedManifest, WeightSyncError, check_membership, tensor_checksum
from spice_megatron.bridge.weight_sync import WeightSyncGroup, bucket_views, recv_meta, signed_fields


def receive_stage(group: WeightSyncGroup, stage: int, manifest: ReceivedManifest | None = None,
                  reuse_buffer: bool = False, before_alloc: Callable[[int], None] | None = None,
                  key: bytes | None = None, max_bytes: int = 0) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Buckets of (name, tensor) from one stage's sender; the tensors are views of the bucket.
    Each bucket is handed on only after its tensors matched the sender's trailer and, with `key`,
    the trailer's MAC held (the checksums go to manifest.received). With reuse_buffer, one receive
    buffer serves every bucket: a bucket's tensors are valid only until the next one arrives (an
    engine that loads each bucket as it comes needs no more). `before_alloc(nbytes)` is called
    before a fresh bucket is allocated (it may wait). `max_bytes`: the largest bucket the engine
    takes (the trainer's figure over the signed HTTP plane; 0: no cap), checked before allocating:
    the metadata that sizes it is unsigned until its trailer arrives."""
    check_membership(group, stage, key)
    index = 0
    while True:
        meta = recv_meta(group, stage)
        version = meta["version"]
        if manifest is not None:
            manifest.version = version
        if meta["end"]:
            _check_mac(key, meta.get("mac"), f"stage {stage}'s end of version {version}", version, stage, "end",
                       meta.get("buckets"), meta["checksums"])
            if meta.get("buckets") != index:
                raise WeightSyncError(f"stage {stage} ended version {version} after {meta.get('buckets')} buckets, "
                                      f"{index} arrived")
            if manifest is not None:
                manifest.checksums.update(meta["checksums"])
            return
        entries = meta["tensors"]
        size = max(e[3] + e[4] for e in entries)
        if max_bytes and size > max_bytes:
            raise WeightSyncError(f"stage {stage}: a bucket of {size} bytes announced, this engine takes at most "
                                  f"{max_bytes}: refused before allocating")
        if before_alloc is not None:
            before_alloc(size)
        payload = (group.buffers("recv", 1, size)[0][:size] if reuse_buffer
                   else torch.empty(size, dtype=torch.uint8, device=group.device))
        group.broadcast(payload, stage)
        trailer = recv_meta(group, stage)
        what = f"stage {stage}'s bucket {index} of version {version}"
        _check_mac(key, trailer.get("mac"), what, version, stage, index, entries, trailer["checksums"])
        views = bucket_views(payload, entries)
        checksums = [tensor_checksum(v, key) for v in views]
        for entry, got, sent in zip(entries, checksums, trailer["checksums"], strict=True):
            if got != sent:
                raise WeightSyncError(f"{what}: tensor {entry[0]!r} arrived different from what its sender sent; "
                                      "the bucket is refused")
        if manifest is not None:
            manifest.received.update((e[0], c) for e, c in zip(entries, checksums))
        index += 1
        yield list(zip((e[0] for e in entries), views))


def _check_mac(key: bytes | None, given: object, what: str, *fields) -> None:
    if key is not None and not (isinstance(given, str) and hmac.compare_digest(given, signed_fields(key, *fields))):
        raise WeightSyncError(f"{what} is not signed with this sync's key (a sender without the job's token?): "
                              "refused before loading")


# Concurrent receive: buckets received but not yet consumed, across all stages (each a bucket of
# rollout.bucket_mb on the engine GPU, beyond the 15% vLLM leaves free); two keep the engine's link
# busy while the consumer loads the one it holds.
RECEIVE_AHEAD = 2


class _BucketSlots:
    """At most `limit` buckets received and not yet consumed; the receiving thread waits for a slot
    before it allocates the next bucket. `close` releases it (the consumer is gone)."""

    def __init__(self, limit: int):
        self.limit, self.held, self.most, self.closed = limit, 0, 0, False
        self.cond = threading.Condition()

    def acquire(self, _nbytes: int = 0) -> None:
        with self.cond:
            while self.held >= self.limit and not self.closed:
                self.cond.wait()
            if self.closed:
                raise WeightSyncError("the consumer of the received weights stopped")
            self.held += 1
            self.most = max(self.most, self.held)

    def release(self) -> None:
        with self.cond:
            self.held -= 1
            self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()


def _interleaved(streams: dict[int, Iterator]) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The stages' buckets in one fixed order: stage 0's next bucket, stage 1's, ... round and
    round, a stage leaving the rotation once its end message arrived. Every receiver gets the same
    bucket counts, so every receiver issues the same collectives in the same order (NCCL's rule for
    several communicators on one device: ranks that issue them in different orders can deadlock)."""
    while streams:
        for stage in list(streams):
            try:
                yield next(streams[stage])
            except StopIteration:
                del streams[stage]


def receive_all(group: WeightSyncGroup, manifest: ReceivedManifest | None = None, reuse_buffer: bool = False,
                concurrent: bool = False, ahead: int = RECEIVE_AHEAD, key: bytes | None = None,
                max_bytes: int = 0) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Every stage's buckets (what an engine worker consumes): stage by stage, or with `concurrent`
    interleaved by bucket on one receiving thread (_interleaved: the same issue order on every
    worker), yielded as they arrive, at most `ahead` received before the consumer is done with them
    (a bucket is done when the consumer asks for the next), so receiving overlaps loading and every
    stage's sender keeps sending. Concurrent is for NCCL across nodes, where the stages' senders sit
    on different machines; on one CPU (gloo) it measured slower, so the engines use it only with NCCL."""
    if not concurrent or group.num_stages == 1:
        for stage in range(group.num_stages):
            yield from receive_stage(group, stage, manifest, reuse_buffer, key=key, max_bytes=max_bytes)
        return
    import queue

    done = object()
    arrived: queue.Queue = queue.Queue()  # bounded by the slots: at most `ahead` buckets
    slots = _BucketSlots(max(1, ahead))

    def receive() -> None:
        try:
            # reuse_buffer would let the next bucket overwrite one not consumed yet: fresh buffers here
            streams = {stage: receive_stage(group, stage, manifest, reuse_buffer=False, before_alloc=slots.acquire,
                                            key=key, max_bytes=max_bytes) for stage in range(group.num_stages)}
            for bucket in _interleaved(streams):
                arrived.put((bucket, StreamHandover.mark(group.device)))
            arrived.put(done)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, which raises it
            arrived.put(e)

    thread = threading.Thread(target=receive, daemon=True, name="spice-recv")
    thread.start()
    try:
        while True:
            item = arrived.get()
            if item is done:
                break
            if isinstance(item, BaseException):
                raise item
            bucket, handover = item
            handover.to_current_stream([t for _, t in bucket])
            yield bucket
            del bucket, item  # done with it: its slot goes to the next bucket
            slots.release()
    finally:
        slots.close()
        if manifest is not None:
            manifest.most_buffered = slots.most
    thread.join()
