"""`python -m spice_megatron.cli`: the `spice` command (the job scripts run it this way)."""
import sys

from spice_megatron.cli import main

sys.exit(main())
