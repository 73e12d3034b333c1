#!/usr/bin/env python3
"""Build the default offline corpus and evaluation sets (see spice_megatron/offline_data.py)."""
import sys

from spice_megatron.offline_data import main

if __name__ == "__main__":
    sys.exit(main())
