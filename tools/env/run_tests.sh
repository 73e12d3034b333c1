#!/usr/bin/env bash
# Set up the CPU environment (idempotent) and run the whole test suite on both cores.
# pytest's exit code 5 ("no tests collected") is a failure here, never a pass.
set -uo pipefail
cd "$(dirname "$0")/../.."
bash tools/env/setup_cpu_env.sh || exit 1
# the lint rules of pyproject.toml first: a finding fails the run before the half hour of tests
.venv/bin/ruff check . || { echo "error: ruff check found the lines above (pyproject.toml's rules)" >&2; exit 1; }
.venv/bin/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder --durations=25 "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "error: pytest collected no tests" >&2
  exit 1
fi
exit "$rc"
