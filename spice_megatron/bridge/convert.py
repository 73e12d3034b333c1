"""Checkpoint conversion: HF <-> Megatron dist checkpoints, and the streamed HF writer.

Run under torchrun (or srun) with TP x PP ranks; each rank reads or writes only its own part.
"""
from __future__ import annotations

import json
import logging
import os
import shutil

import torch
import torch.distributed as dist

from spice_megatron.bridge.export import gather_stage_tensors, holds_unique_weights
from spice_megatron.bridge.preflight import partial_dir, publish_output
from spice_megatron.config import OptimConfig, ParallelConfig, PolicyTrainConfig
from spice_megatron.policy.checkpoint_files import HF_META_DIR

log = logging.getLogger(__name__)

# The reasoner's training prompts (recipe, template, prompt_dir, stop strings): `spice eval` of an
# exported model evaluates with them unless told otherwise.
TRAINING_PROMPTS_FILE = "spice_prompts.json"
METADATA_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                  "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja",
                  TRAINING_PROMPTS_FILE)


def write_training_prompts(cfg, hf_dir: str) -> None:
    sp = cfg.selfplay
    with open(os.path.join(hf_dir, TRAINING_PROMPTS_FILE), "w") as f:
        json.dump({"recipe": cfg.run.name, "template": sp.template, "prompt_dir": os.path.abspath(sp.prompt_dir)
                   if sp.prompt_dir else "", "reasoner_stop": list(sp.reasoner_stop)}, f, indent=1)


def read_training_prompts(model_dir: str) -> dict | None:
    path = os.path.join(model_dir, TRAINING_PROMPTS_FILE)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def copy_hf_metadata(src: str, dst: str) -> None:
    """Everything of an HF model directory except its weights."""
    os.makedirs(dst, exist_ok=True)
    for name in METADATA_FILES:
        if os.path.exists(os.path.join(src, name)):
            shutil.copy2(os.path.join(src, name), os.path.join(dst, name))


def save_hf_checkpoint(learner, out_dir: str, metadata_dir: str, bucket_bytes: int = 512 * 2**20,
                       dtype: torch.dtype | None = None) -> dict[str, str] | None:
    """Collective. Writes safetensors shards + index + metadata. Each stage's sending rank writes
    its own shards bucket by bucket, so no rank holds more than one bucket of the model.
    Returns the weight map on global rank 0."""
    from safetensors.torch import save_file

    lay = learner.layout
    rank = dist.get_rank()
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
    dist.barrier()
    written: list[tuple[str, list[str]]] = []
    if holds_unique_weights(lay, learner.spec):
        bucket: dict[str, torch.Tensor] = {}
        used = 0

        def flush() -> None:
            nonlocal bucket, used
            if bucket:
                name = f".stage{lay.pp_rank:03d}-{len(written):05d}.safetensors"
                save_file(bucket, os.path.join(out_dir, name), metadata={"format": "pt"})
                written.append((name, list(bucket)))
            bucket, used = {}, 0

        for hf_name, tensor in gather_stage_tensors(learner):  # yields on TP rank 0 only
            t = tensor.to("cpu", dtype or tensor.dtype)
            nbytes = t.numel() * t.element_size()
            if bucket and used + nbytes > bucket_bytes:
                flush()
            bucket[hf_name] = t
            used += nbytes
        flush()
    everything: list = [None] * lay.world_size
    dist.all_gather_object(everything, written)
    weight_map = None
    if rank == 0:
        files = [f for part in everything for f in part]
        files.sort(key=lambda f: f[0])
        weight_map = {}
        for i, (tmp_name, names) in enumerate(files):
            final = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
            os.replace(os.path.join(out_dir, tmp_name), os.path.join(out_dir, final))
            weight_map.update({n: final for n in names})
        total = sum(os.path.getsize(os.path.join(out_dir, f)) for f in set(weight_map.values()))
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=1)
        copy_hf_metadata(metadata_dir, out_dir)
        with open(os.path.join(out_dir, "config.json")) as f:
            config = json.load(f)
        config["torch_dtype"] = str(dtype or learner.dtype).replace("torch.", "")
        # an FP8 checkpoint was dequantized on import, and its multi-token-prediction layers skipped
        config.pop("quantization_config", None)
        if config.get("num_nextn_predict_layers"):
            config["num_nextn_predict_layers"] = 0
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            json.dump(config, f, indent=1)
    dist.barrier()
    return weight_map


def convert_from_hf(hf_dir: str, out: str, tp: int, pp: int, ep: int = 1, first_stage_layers: int = 0,
                    last_stage_layers: int = 0) -> str:
    """HF directory -> a model-only Megatron checkpoint root (with the HF metadata kept in hf/).
    `ep`: expert parallelism for a mixture-of-experts model (the world is pp x lcm(tp, ep));
    `first_stage_layers` / `last_stage_layers`: uneven pipeline stages (0: an even split).
    Written to OUT.partial and renamed to `out` when complete (an existing `out` is replaced)."""
    from spice_megatron.bridge.hf_io import learner_from_hf
    from spice_megatron.policy.checkpoint import save_checkpoint

    parallel = ParallelConfig(tp, pp, expert_parallel=ep, first_stage_layers=first_stage_layers,
                              last_stage_layers=last_stage_layers)
    learner = learner_from_hf(hf_dir, parallel, OptimConfig(), PolicyTrainConfig(dtype="fp32"))
    partial = _fresh_partial(out)
    path = save_checkpoint(learner, partial, step=0, model_only=True, keep_last=0)
    if dist.get_rank() == 0:
        copy_hf_metadata(hf_dir, os.path.join(partial, HF_META_DIR))
        publish_output(partial, out)
    dist.barrier()
    return os.path.join(out, os.path.basename(path))


def convert_to_hf(ckpt: str, out_dir: str, tp: int = 1, pp: int = 1, dtype: str | None = None, ep: int = 1,
                  first_stage_layers: int = 0, last_stage_layers: int = 0) -> None:
    """A checkpoint (root or step directory) -> HF safetensors directory, at any TP x PP (x EP, in
    even or uneven stages: the checkpoint's keys carry global layer numbers).
    Written to OUT.partial and renamed to `out_dir` when complete."""
    from spice_megatron.bridge.preflight import check_checkpoint
    from spice_megatron.families import model_spec_from_hf
    from spice_megatron.policy.checkpoint import load_checkpoint
    from spice_megatron.policy.learner import Learner

    step_dir = check_checkpoint(ckpt)
    meta = os.path.join(os.path.dirname(step_dir), HF_META_DIR)
    parallel = ParallelConfig(tp, pp, expert_parallel=ep, first_stage_layers=first_stage_layers,
                              last_stage_layers=last_stage_layers)
    learner = Learner(model_spec_from_hf(meta), parallel, OptimConfig(), PolicyTrainConfig(dtype="fp32"))
    load_checkpoint(learner, step_dir, model_only=True)
    partial = _fresh_partial(out_dir)
    save_hf_checkpoint(learner, partial, meta, dtype={"bf16": torch.bfloat16, "fp32": torch.float32, None: None}[dtype])
    if dist.get_rank() == 0:
        publish_output(partial, out_dir)
    dist.barrier()


def _fresh_partial(out: str) -> str:
    """Collective: OUT.partial, emptied of what a killed conversion left there."""
    partial = partial_dir(out)
    if dist.get_rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
    dist.barrier()
    return partial
