"""Checks that need only files and the config, run before any rank starts: a model directory's
config and safetensors shards (headers, not weights), a layout against the model's dimensions, a
Megatron checkpoint's files, and an output directory that a failed conversion must not leave
looking complete. Each failure is one UserError naming the path, tensor or field."""
from __future__ import annotations

import json
import os
import shutil
import struct
from typing import TYPE_CHECKING

from spice_megatron.config import ConfigError
from spice_megatron.entry import UserError, read_json, require_dir

if TYPE_CHECKING:  # the model module imports torch: only the checks that need it pay for it
    from spice_megatron.families import ModelSpec

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit on the JSON header


def safetensors_shapes(path: str) -> dict[str, tuple[int, ...]]:
    """The tensors a safetensors file declares, read from its header only; a truncated or corrupt
    file is named with what is wrong, as `safe_open` would only say "incomplete metadata"."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise UserError(f"{path}: truncated ({size} bytes; a safetensors file starts with an 8-byte header "
                                "length): download or convert it again")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise UserError(f"{path}: corrupt or truncated safetensors header (declares {n} bytes, the file has "
                                f"{size}): download or convert it again")
            header = json.loads(f.read(n))
    except OSError as e:
        raise UserError(f"{path}: cannot be read ({type(e).__name__}: {e})") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise UserError(f"{path}: corrupt safetensors header (not JSON): download or convert it again") from None
    if not isinstance(header, dict):
        raise UserError(f"{path}: corrupt safetensors header (not a JSON object)")
    shapes, end = {}, 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            shapes[name] = tuple(int(d) for d in info["shape"])
            end = max(end, int(info["data_offsets"][1]))
        except (TypeError, KeyError, IndexError, ValueError):
            raise UserError(f"{path}: corrupt safetensors header (tensor {name!r} has no shape/data_offsets)") from None
    if 8 + n + end > size:
        raise UserError(f"{path}: truncated ({size} bytes, its header needs {8 + n + end}): download or convert it "
                        "again")
    return shapes


def checkpoint_tensors(model_dir: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every tensor of an HF model directory with its shape and file; every shard the index names
    must be present and readable."""
    index, single = os.path.join(model_dir, INDEX_FILE), os.path.join(model_dir, SINGLE_FILE)
    if os.path.exists(index):
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise UserError(f"{index}: field 'weight_map' is missing or empty")
        files = sorted(set(weight_map.values()))
    elif os.path.exists(single):
        weight_map, files = None, [SINGLE_FILE]
    else:
        raise UserError(f"{model_dir}: no {SINGLE_FILE} or {INDEX_FILE}: not a Hugging Face safetensors model")
    tensors: dict[str, tuple[tuple[int, ...], str]] = {}
    for name in files:
        path = os.path.join(model_dir, name)
        if not os.path.exists(path):
            raise UserError(f"{path}: missing, though {INDEX_FILE} names it")
        tensors.update({t: (shape, path) for t, shape in safetensors_shapes(path).items()})
    for tensor, name in (weight_map or {}).items():
        if tensor not in tensors:
            raise UserError(f"{os.path.join(model_dir, name)}: holds no tensor {tensor!r}, though {INDEX_FILE} "
                            "says it does")
    return tensors


def check_hf_model(model_dir: str, flag: str = "--model") -> ModelSpec:
    """A local HF model directory, checked without loading weights: config.json parses and has what
    its family needs, every shard's header parses, and every tensor the architecture needs is there
    with its shape. Returns the model's spec."""
    require_dir(model_dir, flag)
    from spice_megatron.bridge.mapping import expected_hf_shapes
    from spice_megatron.families import model_spec_from_hf

    spec = model_spec_from_hf(model_dir)
    tensors = checkpoint_tensors(model_dir)

    for name, shape in expected_hf_shapes(spec).items():
        if name not in tensors:
            raise UserError(f"{model_dir}: tensor {name!r} is missing (a {spec.architecture} checkpoint needs it)")
        if tensors[name][0] != shape:
            raise UserError(f"{tensors[name][1]}: tensor {name!r} has shape {list(tensors[name][0])}, config.json "
                            f"implies {list(shape)}")
    return spec


def looks_like_local_path(model: str) -> bool:
    """A hub id is `org/name`; anything absolute, relative to . or ~, or present is a local path."""
    return os.path.isabs(model) or model.startswith((".", "~")) or os.path.exists(model)


def check_layout(spec: ModelSpec, tp: int, pp: int, ep: int = 1, etp: int = 1,
                 flags: dict[str, str] | None = None, first_stage_layers: int = 0, last_stage_layers: int = 0,
                 vpp: int = 1) -> None:
    """The layout against the model's dimensions; `flags` renames config fields to a tool's flags."""
    from spice_megatron.policy.model import check_parallel_layout

    try:
        check_parallel_layout(spec, tp, pp, ep, etp, first_stage_layers, last_stage_layers, vpp)
    except ConfigError as e:
        field, _, rest = str(e).partition(": ")
        for name, flag in (flags or {}).items():  # the hints name fields too
            rest = rest.replace(name, flag)
        raise ConfigError(f"{(flags or {}).get(field, field)}: {rest}") from None


CONVERT_FLAGS = {"parallel.tensor_parallel": "--tp", "parallel.pipeline_parallel": "--pp",
                 "parallel.expert_parallel": "--ep", "parallel.expert_tensor_parallel": "--etp",
                 "parallel.first_stage_layers / last_stage_layers": "--first-stage-layers / --last-stage-layers"}


def check_checkpoint(ckpt: str, flag: str = "--ckpt") -> str:
    """A Megatron checkpoint (a root or one step directory) whose files are all there; returns the
    step directory. Sizes are checked against the manifest; checksums are left to the load."""
    from spice_megatron.policy.checkpoint_files import HF_META_DIR, MANIFEST, checkpoint_root, latest_checkpoint

    require_dir(ckpt, flag)
    root = checkpoint_root(ckpt)
    read_json(os.path.join(root, HF_META_DIR, "config.json"),
              f" (the checkpoint root {root} keeps the model's HF config in {HF_META_DIR}/)")
    step = latest_checkpoint(ckpt) if root == ckpt.rstrip("/") else ckpt
    if step is None:
        raise UserError(f"{ckpt}: no complete checkpoint (no step_* directory with a layout.json)")
    layout = read_json(os.path.join(step, "layout.json"), " (every complete checkpoint has one)")
    for field in ("tp", "pp", "dp"):
        if not isinstance(layout.get(field), int):
            raise UserError(f"{os.path.join(step, 'layout.json')}: field {field!r} is missing or not an integer")
    if not os.path.exists(os.path.join(step, ".metadata")):
        raise UserError(f"{os.path.join(step, '.metadata')}: missing (megatron's checkpoint index)")
    manifest = os.path.join(step, MANIFEST)
    if os.path.exists(manifest):
        files = read_json(manifest).get("files")
        if not isinstance(files, dict):
            raise UserError(f"{manifest}: field 'files' is missing")
        for name, entry in sorted(files.items()):
            path = os.path.join(step, name)
            if not os.path.exists(path):
                raise UserError(f"{path}: missing (the checkpoint's manifest lists it)")
            if isinstance(entry, dict) and os.path.getsize(path) != entry.get("size"):
                raise UserError(f"{path}: {os.path.getsize(path)} bytes, the manifest says {entry.get('size')} "
                                "(truncated or overwritten)")
    return step


def partial_dir(out: str) -> str:
    """Where a conversion writes until it is complete; never mistaken for a finished output."""
    return out.rstrip("/") + ".partial"


def refuse_existing_output(out: str, overwrite: bool, flag: str = "--out") -> None:
    if os.path.lexists(out) and not overwrite:
        raise UserError(f"{flag} {out}: already exists; pass --overwrite to replace it, or choose another path")
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent):
        raise UserError(f"{flag} {out}: its parent directory {parent} does not exist")


def publish_output(partial: str, out: str) -> None:
    """Rename a finished conversion into place (an existing `out` is replaced: --overwrite)."""
    old = out.rstrip("/") + ".old"
    if os.path.lexists(out):
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out, old)
    os.replace(partial, out)
    shutil.rmtree(old, ignore_errors=True)
