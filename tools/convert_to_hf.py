#!/usr/bin/env python3
"""Megatron checkpoint (a root or one step directory) -> Hugging Face safetensors directory.

  python tools/convert_to_hf.py --ckpt CKPT --out DIR [--tp 1 --pp 1] [--dtype bf16] [--overwrite]

The model is loaded at the given TP x PP (any layout, resharded on load) and each pipeline stage
streams its tensors into safetensors shards; the directory gets config.json, the generation
config and the tokenizer files kept with the checkpoint. The checkpoint's files and the layout are
checked before any rank starts; the output is written to DIR.partial and renamed to DIR when
complete. A bad input is one `error:` line and exit code 2 (-v or SPICE_DEBUG=1 adds the traceback).
"""
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from spice_megatron.entry import ArgumentParser, non_negative_int, positive_int, run_entry_point  # noqa: E402


def main() -> int:
    ap = ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tp", type=positive_int, default=1)
    ap.add_argument("--pp", type=positive_int, default=1)
    ap.add_argument("--ep", type=positive_int, default=1, help="expert parallelism (mixture-of-experts models)")
    ap.add_argument("--first-stage-layers", type=non_negative_int, default=0,
                    help="uneven pipeline stages: layers on the first stage (0: an even split)")
    ap.add_argument("--last-stage-layers", type=non_negative_int, default=0,
                    help="uneven pipeline stages: layers on the last stage (0: an even split)")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default=None, help="default: the learner's dtype")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    ap.add_argument("-v", "--verbose", action="store_true", help="tracebacks with errors")
    args = ap.parse_args()
    from spice_megatron.launch import relaunch_with_torchrun, under_launcher
    from spice_megatron.policy.model import model_spec_from_hf
    from spice_megatron.preflight import CONVERT_FLAGS, check_checkpoint, check_layout, refuse_existing_output

    step = check_checkpoint(args.ckpt)
    check_layout(model_spec_from_hf(os.path.join(os.path.dirname(step), "hf")), args.tp, args.pp, args.ep,
                 flags=CONVERT_FLAGS, first_stage_layers=args.first_stage_layers,
                 last_stage_layers=args.last_stage_layers)
    if not under_launcher():
        refuse_existing_output(args.out, args.overwrite)
    relaunch_with_torchrun(args.pp * math.lcm(args.tp, args.ep))
    import torch.distributed as dist

    from spice_megatron.bridge.convert import convert_to_hf

    convert_to_hf(args.ckpt, args.out, args.tp, args.pp, args.dtype, args.ep, args.first_stage_layers,
                  args.last_stage_layers)
    if dist.get_rank() == 0:
        print(f"wrote {args.out}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    run_entry_point(main)
