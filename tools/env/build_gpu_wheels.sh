#!/usr/bin/env bash
# Build the wheel folder tools/gpu_check.sh installs from, for Python 3.12 on x86_64 Linux, on a
# machine with PyPI access (no torch: the GPU machine has its own CUDA build):
#   bash tools/env/build_gpu_wheels.sh [OUT_DIR]   (default: tools/gpu_wheels, git-ignored, ~20 MB)
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-tools/gpu_wheels}
PY=${PYTHON:-.venv/bin/python}
mkdir -p "$OUT"
"$PY" -m pip download -q --only-binary=:all: --no-deps -d "$OUT" --python-version 3.12 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any megatron-core==0.16.1 safetensors==0.8.0 numpy==2.3.5 packaging==26.0
du -sh "$OUT"
ls "$OUT"
