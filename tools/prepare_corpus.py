#!/usr/bin/env python3
"""Build the default offline corpus and evaluation sets (see spice_megatron/offline_data.py).
A bad input is one `error:` line and exit code 2 (-v or SPICE_DEBUG=1 adds the traceback)."""
from spice_megatron.entry import run_entry_point
from spice_megatron.offline_data import main

if __name__ == "__main__":
    run_entry_point(main)
