"""Append-only run logs: per-iteration metrics (JSONL + TensorBoard + optional Weights & Biases) and
the audit trail of every challenger output and reasoner answer.

Both JSONL files are resumable: a checkpoint records their byte length, and a resumed run cuts
them back to it, so records of an iteration that was killed before its checkpoint are not left
behind twice.
"""
from __future__ import annotations

import json
import math
import os
import secrets
import sys
from typing import Any, Callable, Iterator


def _warn_stderr(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


def read_jsonl(path: str, warn: Callable[[str], None] = _warn_stderr) -> Iterator[dict]:
    """Records of a run's JSONL log in file order; a line that is not JSON (a torn write of a
    killed run) is skipped and reported through `warn`."""
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                warn(f"{path}:{line_no} is not valid JSON (a torn write?); skipped")


class JsonlLog:
    def __init__(self, path: str, resume_at: int | None = None):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self.path = path
        if resume_at is not None and os.path.exists(path):
            with open(path, "r+b") as f:
                f.truncate(resume_at)
        elif resume_at is None and os.path.exists(path):
            os.replace(path, path + ".previous")  # a fresh run never appends to an old one
        self._f = open(path, "ab")

    def write(self, records: list[dict[str, Any]]) -> None:
        for r in records:
            self._f.write((json.dumps(r, ensure_ascii=False, default=_jsonable) + "\n").encode())
        self._f.flush()
        os.fsync(self._f.fileno())

    def offset(self) -> int:
        return self._f.tell()

    def close(self) -> None:
        self._f.close()


def _jsonable(x: Any) -> Any:
    if hasattr(x, "item"):
        return x.item()
    return str(x)


class MetricsLogger:
    def __init__(self, out_dir: str, resume_at: int | None = None, wandb_project: str = "", run_name: str = "",
                 config: dict | None = None, declared: list[str] | None = None):
        """`declared`: the names every row carries (metric_names.declared_names), null where an
        iteration did not measure one; a name first measured later is carried from then on."""
        self.jsonl = JsonlLog(os.path.join(out_dir, "metrics.jsonl"), resume_at)
        from torch.utils.tensorboard import SummaryWriter

        self.names = dict.fromkeys(["iteration", *(declared or [])])
        # a resumed run hides the events of iterations after its checkpoint (written before a kill,
        # or before a damaged checkpoint was passed over): TensorBoard shows each iteration once
        purge = None
        if resume_at is not None:
            rows = list(read_jsonl(self.jsonl.path))
            self.names.update(dict.fromkeys(k for r in rows for k in r))
            logged = [r.get("iteration", 0) for r in rows]
            purge = (max(logged) if logged else 0) + 1
        self.tb = SummaryWriter(os.path.join(out_dir, "tensorboard"), purge_step=purge)
        self.wandb = None
        if wandb_project:
            try:
                import wandb
            except ImportError:
                raise RuntimeError("run.wandb_project is set but wandb is not installed: "
                                   "pip install 'spice_megatron[wandb]'") from None
            # The run id lives with the run, so a resumed run continues the same W&B run.
            id_path = os.path.join(out_dir, "wandb_run_id")
            if not os.path.exists(id_path):
                with open(id_path, "w") as f:
                    f.write(secrets.token_hex(8))
            with open(id_path) as f:
                run_id = f.read().strip()
            self.wandb = wandb.init(project=wandb_project, name=run_name or None, config=config, id=run_id,
                                    resume="allow", dir=out_dir)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.names.update(dict.fromkeys(metrics))
        self.jsonl.write([{k: step if k == "iteration" else metrics.get(k) for k in self.names}])
        for k, v in metrics.items():
            if isinstance(v, (int, float)) and math.isfinite(v):
                self.tb.add_scalar(k, v, step)  # the JSONL's name: one spelling to search for
        self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)

    def close(self) -> None:
        self.jsonl.close()
        self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
