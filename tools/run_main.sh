#!/usr/bin/env bash
# Set up the CPU environment and run the main job on this machine.
# Until the trainer lands (issue: SPICE trainer end to end), the main job builds the offline
# corpus and evaluation sets and prints the document pool SPICE samples from.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup_cpu_env.sh
.venv/bin/spice prepare
.venv/bin/spice corpus --show 3
