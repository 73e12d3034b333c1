#!/usr/bin/env python3
"""Hugging Face model directory -> Megatron dist checkpoint at TP x PP.

  python tools/convert_from_hf.py --hf DIR --out CKPT --tp 2 --pp 2 [--overwrite]
  python tools/convert_from_hf.py --hf Qwen3-235B-A22B --out CKPT --tp 4 --pp 8 --ep 16 \
      --first-stage-layers 11 --last-stage-layers 11      # 94 layers: 11, 12 x 6, 11

Starts TP x PP local ranks itself; under torchrun/srun (multi-node) it uses the launcher's ranks.
The model's files and the layout are checked before any rank starts; the checkpoint is written to
CKPT.partial and renamed to CKPT when complete. A bad input is one `error:` line and exit code 2
(-v or SPICE_DEBUG=1 adds the traceback).
"""
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from spice_megatron.entry import ArgumentParser, non_negative_int, positive_int, run_entry_point  # noqa: E402


def main() -> int:
    ap = ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hf", required=True, help="HF model directory (config.json + safetensors)")
    ap.add_argument("--out", required=True, help="checkpoint root to create")
    ap.add_argument("--tp", type=positive_int, default=1)
    ap.add_argument("--pp", type=positive_int, default=1)
    ap.add_argument("--ep", type=positive_int, default=1, help="expert parallelism (mixture-of-experts models)")
    ap.add_argument("--first-stage-layers", type=non_negative_int, default=0,
                    help="uneven pipeline stages: layers on the first stage (0: an even split)")
    ap.add_argument("--last-stage-layers", type=non_negative_int, default=0,
                    help="uneven pipeline stages: layers on the last stage (0: an even split)")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    ap.add_argument("-v", "--verbose", action="store_true", help="tracebacks with errors")
    args = ap.parse_args()
    from spice_megatron.launch import relaunch_with_torchrun, under_launcher
    from spice_megatron.preflight import CONVERT_FLAGS, check_hf_model, check_layout, refuse_existing_output

    spec = check_hf_model(args.hf, "--hf")
    check_layout(spec, args.tp, args.pp, args.ep, flags=CONVERT_FLAGS,
                 first_stage_layers=args.first_stage_layers, last_stage_layers=args.last_stage_layers)
    if not under_launcher():  # under srun/torchrun every rank would see the others' output
        refuse_existing_output(args.out, args.overwrite)
    relaunch_with_torchrun(args.pp * math.lcm(args.tp, args.ep))
    from spice_megatron.bridge.convert import convert_from_hf

    path = convert_from_hf(args.hf, args.out, args.tp, args.pp, args.ep, args.first_stage_layers,
                           args.last_stage_layers)
    import torch.distributed as dist

    if dist.get_rank() == 0:
        print(f"wrote {path} (TP={args.tp}, PP={args.pp}, EP={args.ep})")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    run_entry_point(main)
