#!/usr/bin/env bash
# The suite on a slower day: the README's test command (tools/env/run_tests.sh) with one of the
# machine's cores kept busy by a bounded busy loop beside it, stopped when the suite ends. Prints
# the suite's wall time; exits with the suite's exit code.
#
#   bash tools/checks/load_check.sh            # in this checkout
#   bash tools/checks/load_check.sh --clone    # in a fresh clone of HEAD (its own .venv, set up first)
#
# LOAD_LIMIT_S bounds the busy loop (default 7200 s) should this script itself be killed.
set -uo pipefail
cd "$(dirname "$0")/../.."
dir=$PWD
if [[ ${1:-} == --clone ]]; then
  shift
  dir=$(mktemp -d "${TMPDIR:-/tmp}/spice-load-check.XXXXXX")
  git clone -q "$PWD" "$dir" || exit 1
  echo "[load_check] fresh clone of $(git rev-parse --short HEAD) in $dir"
fi
timeout "${LOAD_LIMIT_S:-7200}" bash -c 'while :; do :; done' &
busy=$!
trap 'kill "$busy" 2>/dev/null' EXIT
echo "[load_check] one core busy (pid $busy) beside the suite"
start=$SECONDS
bash "$dir/tools/env/run_tests.sh" "$@"
rc=$?
elapsed=$(( SECONDS - start ))
printf '[load_check] suite exit code %d, %d min %02d s with one core busy\n' "$rc" $(( elapsed / 60 )) $(( elapsed % 60 ))
exit "$rc"
