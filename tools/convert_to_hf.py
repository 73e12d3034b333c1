#!/usr/bin/env python3
"""Megatron checkpoint (a root or one step directory) -> Hugging Face safetensors directory.

  python tools/convert_to_hf.py --ckpt CKPT --out DIR [--tp 1 --pp 1] [--dtype bf16]

The model is loaded at the given TP x PP (any layout, resharded on load) and each pipeline stage
streams its tensors into safetensors shards; the directory gets config.json, the generation
config and the tokenizer files kept with the checkpoint.
"""
import argparse
import math
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1, help="expert parallelism (mixture-of-experts models)")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default=None, help="default: the learner's dtype")
    args = ap.parse_args()
    from spice_megatron.launch import relaunch_with_torchrun

    relaunch_with_torchrun(args.pp * math.lcm(args.tp, args.ep))
    import torch.distributed as dist

    from spice_megatron.bridge.convert import convert_to_hf

    convert_to_hf(args.ckpt, args.out, args.tp, args.pp, args.dtype, args.ep)
    if dist.get_rank() == 0:
        print(f"wrote {args.out}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
