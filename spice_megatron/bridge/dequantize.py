"""A bf16 copy of an FP8 (block-scaled) Hugging Face checkpoint, for the rollout engines.

The learner dequantizes an FP8 checkpoint on import and trains bf16; the weight sync then sends
bf16 tensors. An engine that loaded the FP8 directory holds float8 parameters with the checkpoint's
block scales: vLLM's loaders copy a synced bf16 tensor into them element by element and keep
multiplying by the old scales (served weights ~5,000x too small, every checksum passing; found on a GPU).
So engines serve a bf16 copy (`rollout.model`) while the learner reads the original, and an engine
directory that is still quantized is refused before anything starts.

The copy streams: one shard of the source in memory at a time, each FP8 weight times its blocks'
`weight_scale_inv` (HFCheckpointReader's arithmetic, the same as the learner's import), the scales
dropped, everything else as it is; one process, no megatron, no torchrun.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Callable

from spice_megatron.entry import UserError

SCALE_SUFFIX = "_scale_inv"


class QuantizedEngineModel(UserError, ValueError):
    pass


def quantization_of(model_dir: str) -> str | None:
    """The quant_method of a local HF directory's config.json (None: unquantized, or not a local directory)."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        q = json.load(f).get("quantization_config")
    return str(q.get("quant_method", "unknown")) if isinstance(q, dict) else None


def check_engine_model(model_dir: str, field: str = "rollout.model") -> None:
    """Refuses an engine model directory the bf16 weight sync cannot fill (quantized)."""
    method = quantization_of(model_dir)
    if method is not None:
        raise QuantizedEngineModel(
            f"{field}={model_dir}: the engines would serve it quantized ({method}), and the weight sync sends "
            f"bf16 tensors they would cast into its {method} parameters with stale scales; serve a bf16 copy: "
            f"spice convert bf16 --model {model_dir} --output DIR, then rollout.model=DIR (the learner keeps "
            "reading run.model)")


def write_bf16_copy(src: str, dst: str, progress: Callable[[str], None] = print) -> dict[str, int]:
    """Writes `dst`: `src` with every FP8 weight dequantized to bf16 and no quantization_config, shard
    by shard under the source's shard names. Returns counts (tensors, dequantized, scales dropped)."""
    from spice_megatron.bridge.hf_io import CheckpointError, HFCheckpointReader

    if os.path.abspath(src) == os.path.abspath(dst):
        raise CheckpointError(f"--output {dst}: the copy must not overwrite its source")
    # a fresh directory only: an existing one (or a link) may be another user's, who could rewrite what
    # the engines serve (docs/cluster.md, "The weight sync only with the job's members")
    if os.path.lexists(dst):
        raise CheckpointError(f"--output {dst}: already exists (the copy writes a fresh directory of its own; "
                              "choose another path, or remove it if it is yours)")
    parent = os.path.dirname(os.path.abspath(dst))
    if not os.path.isdir(parent):
        raise CheckpointError(f"--output {dst}: its parent directory {parent} does not exist")
    reader = HFCheckpointReader(src)
    if reader.fp8_block is None:
        raise CheckpointError(f"{src}: config.json has no fp8 quantization_config: nothing to dequantize")
    # written into a directory of this process's own beside it (0700, a name no one can know in advance)
    # and renamed into place once complete: a killed copy leaves no half directory under --output, and
    # nothing this process did not create is ever removed
    tmp = tempfile.mkdtemp(prefix=os.path.basename(dst.rstrip("/")) + ".partial.", dir=parent)
    try:
        counts = _write_copy(reader, src, tmp, progress)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # this process's own directory
        raise
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # as a directory made here would be
    os.rename(tmp, dst)  # refused where dst appeared meanwhile and is not an empty directory
    return counts


def _write_copy(reader, src: str, tmp: str, progress: Callable[[str], None]) -> dict[str, int]:
    """The copy's files in `tmp`: each shard dequantized, then the index, the other files and the config."""
    from safetensors.torch import save_file

    shards = sorted(set(reader.weight_map.values()))
    counts = {"tensors": 0, "dequantized": 0, "scales_dropped": 0}
    weight_map: dict[str, str] = {}
    for n, shard in enumerate(shards, 1):
        names = sorted(k for k, v in reader.weight_map.items() if v == shard)
        out = {}
        for name in names:
            if name.endswith(SCALE_SUFFIX) and name[:-len(SCALE_SUFFIX)] in reader.weight_map:
                counts["scales_dropped"] += 1
                continue
            tensor = reader.read(name, None, None, None)  # FP8 comes back dequantized to bf16
            counts["dequantized"] += int(reader._file(shard).get_slice(name).get_dtype() == "F8_E4M3")
            out[name] = tensor.contiguous()
            weight_map[name] = shard
        save_file(out, os.path.join(tmp, shard), metadata={"format": "pt"})
        counts["tensors"] += len(out)
        reader._files.pop(shard, None)  # one shard open at a time
        reader._scales.clear()
        progress(f"[convert bf16] shard {n}/{len(shards)} {shard}: {len(out)} tensors")
    with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
    for fname in os.listdir(src):  # config, tokenizer, generation config, code: as they are
        path = os.path.join(src, fname)
        if os.path.isfile(path) and not fname.endswith(".safetensors") and fname != "model.safetensors.index.json":
            shutil.copy2(path, os.path.join(tmp, fname))
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config.pop("quantization_config", None)
    config["dtype" if "dtype" in config else "torch_dtype"] = "bfloat16"  # transformers 5 writes dtype
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return counts
