"""What a weight sync must deliver, checked: a checksum of every tensor the senders sent (computed
while the buckets are in flight, sent last), and the receiver's comparison of what it holds with
them. The transport is bridge/weight_sync.py."""
from __future__ import annotations

import functools
import hashlib
import hmac
from dataclasses import dataclass, field
from typing import Iterable

import torch

_MOD = 2**31 - 1
_CHUNK = 1 << 12  # 32-bit words per dot product
_BLOCK = 1 << 20  # words per float64 block: 8 MiB of temporaries


class WeightSyncError(RuntimeError):
    pass


def _words(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """A tensor's bytes as int32 words, its last 1-3 bytes zero-padded to one more word (or None), and its size."""
    raw = t.detach().contiguous().view(-1).view(torch.uint8)
    if raw.storage_offset() % 4:  # a 32-bit view needs 4-byte alignment
        raw = raw.clone()
    nbytes = raw.numel()
    whole = nbytes - nbytes % 4
    tail = torch.cat([raw[whole:], raw.new_zeros(4 - nbytes % 4)]).view(torch.int32) if nbytes % 4 else None
    return raw[:whole].view(torch.int32), tail, nbytes


@functools.lru_cache(maxsize=8)  # one sync's key serves every tensor of it
def _coefficients(key: bytes, device: torch.device) -> torch.Tensor:
    """KEYED_ROUNDS secret vectors of _CHUNK coefficients in [1, 2^10), derived from the sync key."""
    stream = hashlib.shake_256(b"spice-keyed-checksum\n" + key).digest(2 * _CHUNK * KEYED_ROUNDS)
    values = torch.frombuffer(bytearray(stream), dtype=torch.int16).to(torch.float64).abs() % 1023 + 1
    return values.view(_CHUNK, KEYED_ROUNDS).to(device)


def tensor_checksum(t: torch.Tensor, key: bytes | None = None) -> int:
    """A position-sensitive checksum of a tensor's bytes, exact on any device and in any
    summation order: 32-bit words times small weights, summed in float64 over chunks of 2^12,
    stay integers below 2^51, so BLAS may add them in any order and still agree bit for bit.
    With a sync `key`: keyed_checksum, which a rewrite in flight cannot keep (docs/cluster.md, "The
    weight sync only with the job's members")."""
    if key is not None:
        return keyed_checksum(t, key)
    raw = t.detach().contiguous().view(-1).view(torch.uint8)
    if raw.storage_offset() % 4:  # a 32-bit view needs 4-byte alignment
        raw = raw.clone()
    nbytes = raw.numel()
    whole = nbytes - nbytes % 4
    words = raw[:whole].view(torch.int32)
    blocks = [(start, words[start:start + _BLOCK]) for start in range(0, words.numel(), _BLOCK)]
    if nbytes % 4:  # the last 1-3 bytes, zero-padded, as one more chunk after the words
        tail = torch.cat([raw[whole:], raw.new_zeros(4 - nbytes % 4)]).view(torch.int32)
        blocks.append((-(-words.numel() // _CHUNK) * _CHUNK, tail))
    inner = ((torch.arange(_CHUNK, dtype=torch.float64, device=raw.device) * 40503) % 251) + 1
    total = 0
    for start, block in blocks:
        pad = (-block.numel()) % _CHUNK
        if pad:
            block = torch.cat([block, block.new_zeros(pad)])
        sums = block.view(-1, _CHUNK).to(torch.float64) @ inner  # |each| < 2^31 * 2^8 * 2^12
        idx = torch.arange(sums.numel(), dtype=torch.float64, device=sums.device) + start // _CHUNK
        weights = (idx * 2909 % 251) + 1  # partial sums stay below 2^31 * 2^8 * 2^8 < 2^53
        total = (total + int(torch.remainder(torch.remainder(sums, _MOD) * weights, _MOD).sum().item())) % _MOD
    return total ^ (nbytes << 31)


# The keyed checksum: per chunk of 2^12 words, KEYED_ROUNDS sums of word x secret coefficient in
# [1, 2^10), exact in float64 (|each| < 2^31 * 2^10 * 2^12 = 2^53: one matmul, any summation order),
# then HMAC-SHA256 over every chunk's sums in order. Without the key a change to a chunk keeps one
# round's sum with probability about 2^-10, all six's about 2^-60, and the HMAC binds the sums'
# order and the size: the bytes are authenticated, not a linear function anyone can steer (the
# unkeyed checksum, under which a tensor could be rewritten unseen).
KEYED_ROUNDS = 6


def keyed_checksum(t: torch.Tensor, key: bytes) -> int:
    words, tail, nbytes = _words(t)
    coefficients = _coefficients(key, words.device)
    digest = hmac.new(key, b"spice-keyed-checksum\n%d\n" % nbytes, hashlib.sha256)
    for start in range(0, words.numel(), _BLOCK):
        block = words[start:start + _BLOCK]
        pad = (-block.numel()) % _CHUNK
        if pad:
            block = torch.cat([block, block.new_zeros(pad)])
        sums = block.view(-1, _CHUNK).to(torch.float64) @ coefficients
        digest.update(sums.to(torch.int64).cpu().numpy().tobytes())
    if tail is not None:
        digest.update(tail.cpu().numpy().tobytes())
    return int.from_bytes(digest.digest()[:8], "big")


def _member_proof(key: bytes | None, stage: int, member: int) -> torch.Tensor:
    digest = hmac.new(key or b"", f"spice-sync-member\n{stage}\n{member}".encode(), hashlib.sha256).digest()
    return torch.frombuffer(bytearray(digest), dtype=torch.uint8)


def check_membership(group, stage: int, key: bytes | None) -> None:
    """Before a stage's first bucket of a sync: every receiver proves it holds the sync's key
    (HMAC(key, stage | its rank in the stage group), all-gathered), and the sender says whether all
    did (`group`: a bridge/weight_sync.WeightSyncGroup). A process that took an engine's sync rank
    without the token gets nothing; the sync fails on both sides. Without a key (unsigned syncs)
    the sender accepts every member."""
    size, dev = group.num_receivers + 1, group.device
    member = 0 if group.is_sender else 1 + group.sync_rank - group.num_stages
    mine = (torch.zeros(32, dtype=torch.uint8) if group.is_sender else _member_proof(key, stage, member)).to(dev)
    proofs = [torch.empty(32, dtype=torch.uint8, device=dev) for _ in range(size)]
    group.stage_group(stage).allgather([proofs], [mine]).wait()
    bad = [] if not group.is_sender or key is None else [
        m for m in range(1, size) if not torch.equal(proofs[m].cpu(), _member_proof(key, stage, m))]
    verdict = torch.tensor([0 if bad else 1], dtype=torch.uint8, device=dev)
    group.broadcast(verdict, stage)
    # every member has the verdict before anyone acts on it (a refusing sender closes the group)
    acks = [torch.empty(1, dtype=torch.uint8, device=dev) for _ in range(size)]
    group.stage_group(stage).allgather([acks], [verdict]).wait()
    if bad:
        raise WeightSyncError(f"stage {stage}: sync member(s) {bad} could not prove they hold this sync's key "
                              "(another process in an engine's place?): nothing was sent")
    if int(verdict.item()) != 1:
        raise WeightSyncError(f"stage {stage}'s sender refused this sync's members: a process without the key "
                              "among them")


@dataclass
class ReceivedManifest:
    """What the senders said they sent: the checksums arrive after each stage's last bucket."""

    version: int | None = None
    checksums: dict[str, int] = field(default_factory=dict)
    received: dict[str, int] = field(default_factory=dict)  # each tensor's checksum as it arrived (checked per bucket)
    most_buffered: int = 0  # concurrent receive: the most buckets received and not yet consumed at once


def verify_checksums(held: Iterable[tuple[str, torch.Tensor]], manifest: ReceivedManifest) -> int:
    """Compare the tensors a receiver holds with the senders' checksums; raises naming the first
    mismatching or missing tensor. Returns the number checked."""
    return compare_checksums({name: tensor_checksum(t) for name, t in held}, manifest)


def compare_checksums(held: dict[str, int], manifest: ReceivedManifest) -> int:
    """The same check from checksums already computed (an engine checksums each tensor as it loads it)."""
    for name, checksum in held.items():
        expected = manifest.checksums.get(name)
        if expected is None:
            raise WeightSyncError(f"tensor {name!r} is held by the engine but was not sent (version "
                                  f"{manifest.version})")
        if checksum != expected:
            raise WeightSyncError(f"tensor {name!r} differs from the learner's after the sync "
                                  f"(version {manifest.version})")
    missing = sorted(set(manifest.checksums) - set(held))
    if missing:
        raise WeightSyncError(f"tensor {missing[0]!r} was sent but the engine does not hold it "
                              f"({len(missing)} missing, version {manifest.version})")
    return len(held)
