"""A learner checkpoint's files on disk, apart from what they hold: each file flushed and listed with
its size and CRC in `manifest.json` (written last, before the rename that completes a save), the
`latest` pointer, the complete checkpoints under a root, the pruning of older ones, and the check of
a checkpoint's files against its manifest (checkpoint.py writes and loads them)."""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import zlib
from typing import Any

log = logging.getLogger(__name__)

LATEST = "latest"
MANIFEST = "manifest.json"
HF_META_DIR = "hf"  # inside a checkpoint root: config.json, generation config, tokenizer files
DAMAGED_PREFIX = "damaged."  # a checkpoint a resume passed over, kept for inspection
_SHARD = re.compile(r"__(\d+)_\d+\.distcp$")  # torch_dist's files: __<global rank>_<n>.distcp


def writer_rank(name: str, world: int) -> int:
    """The rank that wrote (and so flushes and checksums) a checkpoint file: a shard's own rank,
    rank 0 for the rest (metadata, common state)."""
    m = _SHARD.match(name)
    return int(m.group(1)) if m and int(m.group(1)) < world else 0


def _crc32c_extend():
    """google-crc32c's hardware CRC-32C (SSE4.2 / ARMv8), or None where it is not installed."""
    try:
        import google_crc32c
    except ImportError:
        return None
    return google_crc32c.extend


def _checksum(f, algorithm: str) -> int:
    """`algorithm` ("crc32c" or "crc32") of an open file from its current position to the end,
    16 MiB at a time."""
    crc, extend = 0, (_crc32c_extend() if algorithm == "crc32c" else None)
    if algorithm == "crc32c" and extend is None:
        raise ChecksumUnavailable("google-crc32c")
    while chunk := f.read(1 << 24):
        crc = extend(crc, chunk) if extend else zlib.crc32(chunk, crc)
    return crc


class ChecksumUnavailable(RuntimeError):
    """A manifest's checksum needs a package this environment lacks."""


def file_entry(path: str) -> dict:
    """Flush a file to disk; its size and checksum: CRC-32C where google-crc32c is installed (about
    2.7x zlib's CRC-32 here, 10.6 vs 3.9 GB/s), else CRC-32; the manifest names which."""
    algorithm = "crc32c" if _crc32c_extend() is not None else "crc32"
    with open(path, "rb") as f:
        crc = _checksum(f, algorithm)
        os.fsync(f.fileno())
        return {"size": f.tell(), algorithm: crc}


def write_json(path: str, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(tmp: str, world: int) -> None:
    """Rank 0, last before the rename: every rank's entries and rank 0's own files in one manifest."""
    files: dict[str, dict] = {}
    for r in range(world):
        part = os.path.join(tmp, f".manifest.rank{r}.json")
        with open(part) as f:
            files.update(json.load(f))
        os.remove(part)
    for name in ("layout.json", "scheduler.json", "trainer_state.json"):
        if os.path.exists(os.path.join(tmp, name)):
            files[name] = file_entry(os.path.join(tmp, name))
    missing = sorted(set(os.listdir(tmp)) - set(files))
    if missing:  # a file no rank claimed: written by a rank this save did not expect
        raise RuntimeError(f"checkpoint {tmp}: files not in any rank's manifest: {missing}")
    write_json(os.path.join(tmp, MANIFEST), {"files": files})
    fsync_dir(tmp)


def write_latest(root: str, name: str) -> None:
    tmp = os.path.join(root, f".{LATEST}.tmp")
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, LATEST))
    fsync_dir(root)


def prune(root: str, keep_last: int) -> None:
    done = sorted(d for d in os.listdir(root) if d.startswith("step_"))
    for d in done[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(os.path.join(root, d), ignore_errors=True)


def checkpoint_candidates(root: str) -> list[str]:
    """The renamed (complete when written) checkpoints under root, newest first."""
    if not os.path.isdir(root):
        return []
    done = sorted((d for d in os.listdir(root) if d.startswith("step_")
                   and os.path.exists(os.path.join(root, d, "layout.json"))), reverse=True)
    return [os.path.join(root, d) for d in done]


def checkpoint_root(ckpt: str) -> str:
    """The root of a checkpoint given as its root (which holds hf/) or as one step directory."""
    ckpt = ckpt.rstrip("/")
    return ckpt if os.path.isdir(os.path.join(ckpt, HF_META_DIR)) else os.path.dirname(ckpt)


def latest_checkpoint(root: str) -> str | None:
    """The newest complete checkpoint under root, or None."""
    path = os.path.join(root, LATEST)
    if os.path.exists(path):
        with open(path) as f:
            name = f.read().strip()
        # a step directory's name only: `latest` never leads out of the tree (an absolute path, ..)
        candidate = os.path.join(root, name) if name and "/" not in name and not name.startswith(".") else ""
        if not candidate:
            log.warning("%s names %r, not a checkpoint of this directory: ignored", path, name[:200])
        elif os.path.exists(os.path.join(candidate, "layout.json")):
            return candidate
    # `latest` may lag a completed rename if the process died in between: fall back to a scan.
    done = checkpoint_candidates(root)
    return done[0] if done else None


def verify_checkpoint(path: str, part: int = 0, parts: int = 1) -> str:
    """Why the checkpoint's files do not match its manifest ("" if they do), checking the files
    `part` of `parts` (so that the ranks of a resume share the reading). A checkpoint from before
    manifests existed is not checked here; its load is."""
    manifest = os.path.join(path, MANIFEST)
    if not os.path.exists(manifest):
        return ""
    try:
        with open(manifest) as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError) as e:
        return f"{manifest} is unreadable ({type(e).__name__}: {e})"
    for name in sorted(files)[part::parts]:
        want, file = files[name], os.path.join(path, name)
        if not os.path.exists(file):
            return f"{file} is missing"
        size = os.path.getsize(file)
        if size != want["size"]:
            return f"{file} has {size} bytes, its manifest says {want['size']}"
        algorithm = "crc32c" if "crc32c" in want else "crc32"  # manifests before CRC-32C say crc32
        try:
            with open(file, "rb") as f:
                crc = _checksum(f, algorithm)
        except ChecksumUnavailable:
            return f"{manifest} checksums with CRC-32C: install google-crc32c to verify {file}"
        if crc != want.get(algorithm):
            name = "CRC-32C" if algorithm == "crc32c" else "CRC-32"
            return f"{file} fails its {name} (manifest {want.get(algorithm)}, file {crc})"
    return ""
