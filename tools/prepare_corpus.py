#!/usr/bin/env python3
"""Build the default offline corpus and evaluation sets (see spice_megatron/data/offline_data.py).
A bad input is one `error:` line and exit code 2 (-v or SPICE_DEBUG=1 adds the traceback)."""
from spice_megatron.data.offline_data import main
from spice_megatron.entry import run_entry_point

if __name__ == "__main__":
    run_entry_point(main)
