#!/usr/bin/env python3
"""Hugging Face model directory -> Megatron dist checkpoint at TP x PP.

  python tools/convert_from_hf.py --model DIR --output CKPT --tp 2 --pp 2 [--overwrite]
  python tools/convert_from_hf.py --model Qwen3-235B-A22B --output CKPT --tp 4 --pp 8 --ep 16 \
      --first-stage-layers 11 --last-stage-layers 11      # 94 layers: 11, 12 x 6, 11

Starts TP x PP local ranks itself; under torchrun/srun (multi-node) it uses the launcher's ranks.
The model's files and the layout are checked before any rank starts; the checkpoint is written to
CKPT.partial and renamed to CKPT when complete. The same as `spice convert from-hf` (its older
spellings --hf and --out are still taken). A bad input is one `error:` line and exit code 2 (-v or
SPICE_DEBUG=1 adds the traceback).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from spice_megatron.entry import run_entry_point  # noqa: E402


def main() -> int:
    from spice_megatron.cli import build_parser, quiet_libraries

    if not {"-v", "--verbose"} & set(sys.argv) and not os.environ.get("SPICE_DEBUG"):
        quiet_libraries()  # megatron's import warnings, as `spice` silences them
    args = build_parser().parse_args(["convert", "from-hf", *sys.argv[1:]])
    return args.func(args)


if __name__ == "__main__":
    run_entry_point(main)
