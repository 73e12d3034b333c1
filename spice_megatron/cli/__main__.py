"""`python -m spice_megatron.cli`: the `spice` command (the job scripts and NeMo-Run's launchers run it
this way, or as this file's path). Guarded: a process that multiprocessing spawns imports the main
module again (as __mp_main__), and must not start a second command."""
import sys

from spice_megatron.cli import main

if __name__ == "__main__":
    sys.exit(main())
