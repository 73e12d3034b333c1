"""What a run directory holds on disk, and `spice clean RUN`: every checkpoint but the newest
(`--keep N`), the damaged ones a resume passed over, and unfinished writes, removed; what a resume,
an evaluation or a conversion reads (the newest checkpoints, hf/, hf_final, the logs) stays."""
from __future__ import annotations

import os
import shutil

from spice_megatron.entry import UserError


def tree_bytes(path: str) -> int:
    """Bytes of the files under `path` (a file: its size); links are not followed."""
    if os.path.isfile(path) or os.path.islink(path):
        return os.lstat(path).st_size
    total = 0
    for folder, _, files in os.walk(path):
        total += sum(os.lstat(os.path.join(folder, f)).st_size for f in files)
    return total


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def footprint_line(run_dir: str) -> str:
    """One line: the run's size on disk, its checkpoints' share, and how to shrink it."""
    ckpts = os.path.join(run_dir, "checkpoints")
    total, in_ckpts = tree_bytes(run_dir), tree_bytes(ckpts) if os.path.isdir(ckpts) else 0
    return (f"  on disk: {gib(total)} in {run_dir}, {gib(in_ckpts)} of it checkpoints (spice clean {run_dir} keeps "
            "the newest; run.keep_last sets how many a run keeps)")


def removable(run_dir: str, keep: int) -> list[str]:
    """The checkpoint directories `spice clean` removes: complete ones older than the newest `keep`
    (never the one `latest` names), damaged ones, and unfinished writes (*.partial, *.tmp)."""
    from spice_megatron.policy.checkpoint import DAMAGED_PREFIX, checkpoint_candidates
    from spice_megatron.policy.checkpoint_files import latest_checkpoint

    root = os.path.join(run_dir, "checkpoints")
    if not os.path.isdir(root):
        return []
    complete = checkpoint_candidates(root)  # newest first
    kept = set(complete[:keep]) | {latest_checkpoint(root)}
    out = [p for p in complete[keep:] if p not in kept]
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if os.path.isdir(path) and (name.startswith(DAMAGED_PREFIX) or name.endswith((".partial", ".tmp"))
                                    or (name.startswith("step_") and path not in complete)):
            out.append(path)
    return out


def clean_run(run_dir: str, keep: int, dry_run: bool) -> list[str]:
    """Removes (or with `dry_run` lists) what `removable` names; returns the lines to print. A run
    directory a live run holds is refused: its newest checkpoint may be the one being written."""
    from spice_megatron.run.lock import check_unlocked

    if not os.path.isdir(os.path.join(run_dir, "checkpoints")):
        raise UserError(f"{run_dir}: not a run directory (no checkpoints/ in it)")
    if keep < 1:
        raise UserError(f"--keep {keep}: keep at least the newest checkpoint (1)")
    check_unlocked(run_dir)
    before = tree_bytes(run_dir)
    lines, freed = [], 0
    for path in removable(run_dir, keep):
        size = tree_bytes(path)
        freed += size
        lines.append(f"{'would remove' if dry_run else 'removed'} {path} ({gib(size)})")
        if not dry_run:
            shutil.rmtree(path)
    verb = "would free" if dry_run else "freed"
    lines.append(f"{verb} {gib(freed)} of {gib(before)}; kept the newest {keep} checkpoint(s), hf_final, the logs")
    return lines
