"""`spice convert`: a Megatron checkpoint to Hugging Face (`to-hf`), a Hugging Face model to a
Megatron checkpoint at a layout (`from-hf`), and the engines' bf16 copy of an FP8 model (`bf16`).
tools/convert_to_hf.py and tools/convert_from_hf.py are the first two under their first names
(--ckpt / --hf and --out, still accepted here).

The two Megatron conversions start their TP x PP local ranks themselves (torchrun re-runs the same
command); under torchrun or srun they use the launcher's ranks."""
from __future__ import annotations

import argparse
import math
import os

from spice_megatron.entry import Spelled, non_negative_int, positive_int, require_dir, typed_flag


def add_convert_parser(sub) -> None:
    sn = sub.add_parser("convert", help="convert a checkpoint: to-hf, from-hf, or bf16 (an FP8 model's copy for the "
                        "rollout engines)")
    kinds = sn.add_subparsers(dest="kind", metavar="KIND", required=True, help="to-hf, from-hf or bf16")
    th = kinds.add_parser("to-hf", help="a Megatron checkpoint (a root or one step directory) -> a Hugging Face "
                          "safetensors directory")
    th.add_argument("--model", "--ckpt", dest="model", action=Spelled, required=True, help="the Megatron checkpoint")
    th.add_argument("--output", "--out", dest="output", action=Spelled, required=True,
                    help="the HF directory to write")
    th.add_argument("--dtype", choices=["fp32", "bf16"], default=None, help="default: the learner's dtype")
    _layout_arguments(th)
    th.set_defaults(func=cmd_to_hf)
    fh = kinds.add_parser("from-hf", help="a Hugging Face model directory -> a Megatron checkpoint at TP x PP (x EP)")
    fh.add_argument("--model", "--hf", dest="model", action=Spelled, required=True,
                    help="HF model directory (config.json + safetensors)")
    fh.add_argument("--output", "--out", dest="output", action=Spelled, required=True,
                    help="the checkpoint root to create")
    _layout_arguments(fh)
    fh.set_defaults(func=cmd_from_hf)
    bf = kinds.add_parser("bf16", help="an FP8 Hugging Face directory dequantized, one shard at a time, for the "
                          "rollout engines (rollout.model)")
    bf.add_argument("--model", required=True, help="the FP8 HF directory (run.model)")
    bf.add_argument("--output", required=True, help="the bf16 HF directory to write (rollout.model)")
    bf.set_defaults(func=cmd_bf16)


def _layout_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tp", type=positive_int, default=1, help="tensor parallel size")
    p.add_argument("--pp", type=positive_int, default=1, help="pipeline parallel size")
    p.add_argument("--ep", type=positive_int, default=1, help="expert parallelism (mixture-of-experts models)")
    p.add_argument("--first-stage-layers", type=non_negative_int, default=0,
                   help="uneven pipeline stages: layers on the first stage (0: an even split)")
    p.add_argument("--last-stage-layers", type=non_negative_int, default=0,
                   help="uneven pipeline stages: layers on the last stage (0: an even split)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --output")


def cmd_to_hf(args: argparse.Namespace) -> int:
    """Megatron checkpoint -> HF: the checkpoint's files and the layout checked before any rank starts;
    written to OUTPUT.partial and renamed when complete."""
    from spice_megatron.bridge.preflight import CONVERT_FLAGS, check_checkpoint, check_layout, refuse_existing_output
    from spice_megatron.families import model_spec_from_hf
    from spice_megatron.torchrun import relaunch_with_torchrun, under_launcher

    step = check_checkpoint(args.model, typed_flag(args, "model"))
    check_layout(model_spec_from_hf(os.path.join(os.path.dirname(step), "hf")), args.tp, args.pp, args.ep,
                 flags=CONVERT_FLAGS, first_stage_layers=args.first_stage_layers,
                 last_stage_layers=args.last_stage_layers)
    if not under_launcher():
        refuse_existing_output(args.output, args.overwrite, typed_flag(args, "output"))
    relaunch_with_torchrun(args.pp * math.lcm(args.tp, args.ep))
    import torch.distributed as dist

    from spice_megatron.bridge.convert import convert_to_hf

    convert_to_hf(args.model, args.output, args.tp, args.pp, args.dtype, args.ep, args.first_stage_layers,
                  args.last_stage_layers)
    if dist.get_rank() == 0:
        print(f"wrote {args.output}")
    dist.destroy_process_group()
    return 0


def cmd_from_hf(args: argparse.Namespace) -> int:
    """HF -> Megatron checkpoint: the model's files and the layout checked before any rank starts;
    written to OUTPUT.partial and renamed when complete."""
    from spice_megatron.bridge.preflight import CONVERT_FLAGS, check_hf_model, check_layout, refuse_existing_output
    from spice_megatron.torchrun import relaunch_with_torchrun, under_launcher

    spec = check_hf_model(args.model, typed_flag(args, "model"))
    check_layout(spec, args.tp, args.pp, args.ep, flags=CONVERT_FLAGS,
                 first_stage_layers=args.first_stage_layers, last_stage_layers=args.last_stage_layers)
    if not under_launcher():  # under srun/torchrun every rank would see the others' output
        refuse_existing_output(args.output, args.overwrite, typed_flag(args, "output"))
    relaunch_with_torchrun(args.pp * math.lcm(args.tp, args.ep))
    from spice_megatron.bridge.convert import convert_from_hf

    path = convert_from_hf(args.model, args.output, args.tp, args.pp, args.ep, args.first_stage_layers,
                           args.last_stage_layers)
    import torch.distributed as dist

    if dist.get_rank() == 0:
        print(f"wrote {path} (TP={args.tp}, PP={args.pp}, EP={args.ep})")
    dist.destroy_process_group()
    return 0


def cmd_bf16(args: argparse.Namespace) -> int:
    """A bf16 copy of an FP8 checkpoint for the rollout engines (bridge/dequantize.py)."""
    from spice_megatron.bridge.dequantize import write_bf16_copy
    from spice_megatron.run_dir import check_ancestors

    require_dir(args.model, "--model")
    check_ancestors(args.output, "--output")  # a parent another user can write could swap the copy after it
    counts = write_bf16_copy(args.model, args.output)
    print(f"bf16 copy of {args.model} in {args.output}: {counts['tensors']} tensors, {counts['dequantized']} "
          f"dequantized, {counts['scales_dropped']} scales dropped; serve it with rollout.model={args.output}")
    return 0
