#!/usr/bin/env python3
"""Hugging Face model directory -> Megatron dist checkpoint at TP x PP.

  python tools/convert_from_hf.py --hf DIR --out CKPT --tp 2 --pp 2

Starts TP x PP local ranks itself; under torchrun/srun (multi-node) it uses the launcher's ranks.
"""
import argparse
import math
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hf", required=True, help="HF model directory (config.json + safetensors)")
    ap.add_argument("--out", required=True, help="checkpoint root to create")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1, help="expert parallelism (mixture-of-experts models)")
    args = ap.parse_args()
    from spice_megatron.launch import relaunch_with_torchrun

    relaunch_with_torchrun(args.pp * math.lcm(args.tp, args.ep))
    from spice_megatron.bridge.convert import convert_from_hf

    path = convert_from_hf(args.hf, args.out, args.tp, args.pp, args.ep)
    import torch.distributed as dist

    if dist.get_rank() == 0:
        print(f"wrote {path} (TP={args.tp}, PP={args.pp}, EP={args.ep})")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
