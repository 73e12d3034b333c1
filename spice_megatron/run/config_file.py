"""RUN/config.json: the resolved config a run was started with, the recipe and the overrides that
made it. Written at the start; a resume compares its own resolved config with it and refuses, in
one line naming the field, a value that changed (`--force-config` accepts the new one and records
it), so a resumed run is the run that was started."""
from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import time

from spice_megatron.config import SpiceConfig
from spice_megatron.entry import UserError

CONFIG_FILE = "config.json"
# what a resume may change: how long the run goes on, where it lives, what a cluster hands over
# afresh at every (re)start (engine addresses, the sync's rendezvous), and how the run is kept and
# watched (checkpoints kept and how often, logging, timeouts, the kill switch's thresholds): none
# changes what an iteration computes
MAY_CHANGE = ("run.iterations", "run.output_dir", "rollout.engines", "rollout.challenger_engines",
              "rollout.sync_host", "rollout.sync_port", "rollout.token_file",
              "run.keep_last", "run.checkpoint_every", "run.export_hf", "run.wandb_project", "run.driver_timeout",
              "run.lock_wait_s", "run.min_valid_task_rate", "run.patience", "run.min_challenger_reward")


def _flat(tree: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flat(value, name + "."))
        else:
            out[name] = value
    return out


def config_changes(old: dict, new: dict) -> list[str]:
    """`field: old -> new` for every field that differs (MAY_CHANGE aside)."""
    a, b = _flat(old), _flat(new)
    return [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b))
            if k not in MAY_CHANGE and a.get(k) != b.get(k)]


def recorded_run(output_dir: str) -> dict | None:
    """RUN/config.json as the run's start wrote it (recipe, overrides, config), or None where there is none."""
    path = os.path.join(output_dir, CONFIG_FILE)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            recorded = json.load(f)
        if not isinstance(recorded.get("recipe"), str) or not isinstance(recorded.get("overrides"), list):
            raise ValueError("no recipe and overrides")
        return recorded
    except (OSError, ValueError, AttributeError) as e:
        raise UserError(f"{path}: unreadable ({type(e).__name__}: {e}); move it away to resume with the command "
                        "line's config") from None


def run_held(output_dir: str) -> str | None:
    """What RUN holds of an earlier run, in words (None: nothing, or only a failed start's empty directory)."""
    recorded = recorded_run(output_dir) if os.path.isdir(output_dir) else None
    steps = sorted(d for d in os.listdir(os.path.join(output_dir, "checkpoints"))
                   if d.startswith("step_")) if os.path.isdir(os.path.join(output_dir, "checkpoints")) else []
    metrics = os.path.join(output_dir, "metrics.jsonl")
    from spice_megatron.run.log import read_jsonl

    # iteration 0 is the base model's evaluation, not an iteration
    rows = sum(1 for r in read_jsonl(metrics) if r.get("iteration") != 0) if os.path.isfile(metrics) else 0
    if recorded is None and not steps and not rows:
        return None
    parts = [f"recipe {recorded['recipe']}"] if recorded else []
    parts += [f"{rows} iteration(s) logged"] if rows else []
    parts += [f"checkpoint {steps[-1]}"] if steps else []
    return ", ".join(parts)


def refuse_changed_config(cfg: SpiceConfig, force: bool) -> None:
    """A resume's config against the run's, before any model or data is loaded: one line naming every
    field that differs, unless --force-config (run.model only where the command line gives one: its
    default is filled in later, the same as at the start)."""
    recorded = recorded_run(cfg.run.output_dir)
    if recorded is None or force:
        return
    resolved = json.loads(json.dumps(dataclasses.asdict(cfg), default=str))
    changes = [c for c in config_changes(recorded["config"], resolved)
               if cfg.run.model or not c.startswith("run.model:")]
    if changes:
        raise UserError(f"--resume: the config differs from the run's ({os.path.join(cfg.run.output_dir, CONFIG_FILE)}"
                        f"): {'; '.join(changes)}; resume without --recipe and overrides to take the run's, or pass "
                        "--force-config to accept the new values")


def record_run_config(cfg: SpiceConfig, recipe: str, overrides: list[str], resume: bool,
                      force: bool = False, options: dict | None = None) -> str:
    """Compares (on a resume) and writes RUN/config.json; returns the line to print. `options`: the
    command line's options that shape the run but are no config field (the evaluations), which a
    resume takes back (cli_train.RUN_OPTIONS)."""
    path = os.path.join(cfg.run.output_dir, CONFIG_FILE)
    resolved = json.loads(json.dumps(dataclasses.asdict(cfg), default=str))
    accepted = ""
    if resume and os.path.exists(path):
        try:
            with open(path) as f:
                previous = json.load(f)["config"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise UserError(f"{path}: unreadable ({type(e).__name__}: {e}); move it away to resume with the "
                            "command line's config") from None
        changes = config_changes(previous, resolved)
        if changes and not force:
            more = f" (and {len(changes) - 1} more)" if len(changes) > 1 else ""
            raise UserError(f"--resume: the config differs from the run's ({path}): {changes[0]}{more}; resume with "
                            "the same recipe and overrides, or pass --force-config to accept the new values")
        accepted = f", {len(changes)} changed value(s) accepted (--force-config)" if changes else ""
    os.makedirs(cfg.run.output_dir, exist_ok=True)
    # a fresh file of its own (never through a link someone left at a fixed name), renamed into place
    fd, tmp = tempfile.mkstemp(prefix=CONFIG_FILE + ".", suffix=".tmp", dir=cfg.run.output_dir)
    umask = os.umask(0)
    os.umask(umask)
    os.fchmod(fd, 0o666 & ~umask)  # as an open() here would make it (run.group_readable: the group reads it)
    with os.fdopen(fd, "w") as f:
        json.dump({"recipe": recipe, "overrides": list(overrides), "options": dict(options or {}),
                   "written": time.strftime("%Y-%m-%dT%H:%M:%S"), "config": resolved}, f, indent=1)
    os.replace(tmp, path)
    shown = " ".join(overrides) if overrides else "none"
    return f"config: {path} (recipe {recipe}; overrides: {shown}{accepted})"
