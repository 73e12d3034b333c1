#!/usr/bin/env bash
# The bf16 learner checks on a machine with one CUDA GPU (tools/gpu_check.py prints one line per
# check). That machine needs Python 3.12 with a CUDA torch and nothing else: no internet, no TE,
# apex or vLLM. The few wheels it lacks come from a folder built beforehand on a machine with PyPI
# access (bash tools/build_gpu_wheels.sh, about 20 MB) and carried along:
#   bash tools/gpu_check.sh [WHEEL_DIR]      (default: tools/gpu_wheels)
# Finishes in well under 8 minutes (the checks use a tiny Qwen3 and one 151,936-vocabulary pass).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
WHEELS=${1:-tools/gpu_wheels}
PY=${PYTHON:-python3}
VENV=${GPU_CHECK_VENV:-/tmp/spice_gpu_check_venv}
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check env: FAIL $PY has no CUDA torch"
  exit 1
fi
# A venv over the system site-packages: the machine's CUDA torch stays, the wheels go on top.
[ -x "$VENV/bin/python" ] || "$PY" -m venv --system-site-packages "$VENV"
for pkg in megatron.core:megatron-core safetensors:safetensors numpy:numpy packaging:packaging; do
  if ! "$VENV/bin/python" -c "import ${pkg%%:*}" 2>/dev/null; then
    "$VENV/bin/python" -m pip install -q --no-index --find-links "$WHEELS" --no-deps "${pkg#*:}" \
      || { echo "gpu_check env: FAIL cannot install ${pkg#*:} from $WHEELS (bash tools/build_gpu_wheels.sh)"; exit 1; }
  fi
done
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
timeout 470 "$VENV/bin/python" tools/gpu_check.py
rc=$?
(( rc == 124 )) && echo "gpu_check done: FAIL timed out after 470 s"
exit "$rc"
