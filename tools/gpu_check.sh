#!/usr/bin/env bash
# The bf16 learner checks on a machine with one CUDA GPU (tools/checks/gpu_check.py prints one line per
# check). That machine's python3 holds a CUDA torch (it is itself a virtualenv) and nothing else:
# no internet, no TE, apex or vLLM. What it lacks (megatron-core, and safetensors / numpy /
# packaging only if missing) is installed with `pip --target` into a folder put on PYTHONPATH, from
# wheels built beforehand on a machine with PyPI access (bash tools/env/build_gpu_wheels.sh, ~20 MB) and
# carried along. Not a nested venv: a venv made from a venv with --system-site-packages sees the
# base interpreter's packages, not the parent venv's, and loses torch.
#   bash tools/gpu_check.sh [--allow-cpu] [--only NAME,...] [WHEEL_DIR]   (default: tools/gpu_wheels)
# Finishes in well under 8 minutes (the checks use a tiny Qwen3 and one 151,936-vocabulary pass).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --allow-cpu) ARGS+=(--allow-cpu); shift ;;
    --only) ARGS+=(--only "${2:?--only needs check names}"); shift 2 ;;
    *) break ;;
  esac
done
WHEELS=${1:-tools/gpu_wheels}
PY=${PYTHON:-python3}
SITE=${GPU_CHECK_SITE:-/tmp/spice_gpu_check_site}
if ! "$PY" -c "import torch" 2>/dev/null; then
  echo "gpu_check env: FAIL $PY has no torch"
  exit 1
fi
if [[ " ${ARGS[*]} " != *" --allow-cpu "* ]] && ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check env: FAIL $PY has no CUDA torch (--allow-cpu for the CPU smoke run)"
  exit 1
fi
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
for pkg in megatron.core:megatron-core safetensors:safetensors numpy:numpy packaging:packaging; do
  if ! "$PY" -c "import ${pkg%%:*}" 2>/dev/null; then
    "$PY" -m pip install -q --no-index --find-links "$WHEELS" --no-deps --target "$SITE" "${pkg#*:}" \
      || { echo "gpu_check env: FAIL cannot install ${pkg#*:} from $WHEELS (bash tools/env/build_gpu_wheels.sh)"; exit 1; }
  fi
done
"$PY" -c "import torch, megatron.core; print('gpu_check env: torch', torch.__version__, 'cuda', torch.version.cuda, \
'megatron-core', megatron.core.__version__)"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
timeout 470 "$PY" tools/checks/gpu_check.py "${ARGS[@]}"
rc=$?
(( rc == 124 )) && echo "gpu_check done: FAIL timed out after 470 s"
exit "$rc"
