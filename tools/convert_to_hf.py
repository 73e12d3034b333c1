#!/usr/bin/env python3
"""Megatron checkpoint (a root or one step directory) -> Hugging Face safetensors directory.

  python tools/convert_to_hf.py --model CKPT --output DIR [--tp 1 --pp 1] [--dtype bf16] [--overwrite]

The model is loaded at the given TP x PP (any layout, resharded on load) and each pipeline stage
streams its tensors into safetensors shards; the directory gets config.json, the generation
config and the tokenizer files kept with the checkpoint. The checkpoint's files and the layout are
checked before any rank starts; the output is written to DIR.partial and renamed to DIR when
complete. The same as `spice convert to-hf` (its older spellings --ckpt and --out are still taken). A bad input is one
`error:` line and exit code 2 (-v or SPICE_DEBUG=1 adds the traceback).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from spice_megatron.entry import run_entry_point  # noqa: E402


def main() -> int:
    from spice_megatron.cli import build_parser, quiet_libraries

    if not {"-v", "--verbose"} & set(sys.argv) and not os.environ.get("SPICE_DEBUG"):
        quiet_libraries()  # megatron's import warnings, as `spice` silences them
    args = build_parser().parse_args(["convert", "to-hf", *sys.argv[1:]])
    return args.func(args)


if __name__ == "__main__":
    run_entry_point(main)
