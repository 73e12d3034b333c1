"""What a weight sync must deliver, checked: a checksum of every tensor the senders sent (computed
while the buckets are in flight, sent last), and the receiver's comparison of what it holds with
them. The transport is bridge/weight_sync.py."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import torch

_MOD = 2**31 - 1
_CHUNK = 1 << 12  # 32-bit words per dot product
_BLOCK = 1 << 20  # words per float64 block: 8 MiB of temporaries


class WeightSyncError(RuntimeError):
    pass


def tensor_checksum(t: torch.Tensor) -> int:
    """A position-sensitive checksum of a tensor's bytes, exact on any device and in any
    summation order: 32-bit words times small weights, summed in float64 over chunks of 2^12,
    stay integers below 2^51, so BLAS may add them in any order and still agree bit for bit."""
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
            raise WeightSyncError(f"tensor {name!r} is held by the engine but was not sent (version {manifest.version})")
        if checksum != expected:
            raise WeightSyncError(f"tensor {name!r} differs from the learner's after the sync "
                                  f"(version {manifest.version})")
    missing = sorted(set(manifest.checksums) - set(held))
    if missing:
        raise WeightSyncError(f"tensor {missing[0]!r} was sent but the engine does not hold it "
                              f"({len(missing)} missing, version {manifest.version})")
    return len(held)
