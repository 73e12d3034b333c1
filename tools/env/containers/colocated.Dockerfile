# The image of a colocated job (run.colocate, slurm/spice_*_1node.sbatch): learner and engines in one
# image, because vLLM's CUDA IPC weight transfer runs its trainer side inside the learner's processes
# (spice_megatron/loop/engine_weights.py). vLLM 0.32's image (its own CUDA torch) plus megatron-core and
# Transformer Engine built against that torch: the paper recipes' distributed optimizer needs TE or
# apex (megatron-core's torch fallback restores Adam's step wrongly), and optim.cpu_offload_fraction
# needs TE's precision-aware Adam. The TE build compiles CUDA code: it takes a while and needs nvcc
# (the devel stage of vLLM's image; pass another with VLLM_IMAGE if yours lacks it). Never built here.
#   docker build -f tools/env/containers/colocated.Dockerfile -t spice-colocated .
#   enroot import -o spice-colocated.sqsh dockerd://spice-colocated
# and pass it as CONTAINER_IMAGE (the 1node sbatch files use it for both roles).
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0
FROM ${VLLM_IMAGE}
WORKDIR /opt/spice-megatron
COPY setup.py README.md ./
COPY spice_megatron ./spice_megatron
COPY recipes ./recipes
RUN pip install --no-cache-dir "megatron-core==0.16.1" "math-verify==0.9.0" "transformers>=4.57" matplotlib psutil \
        datasets safetensors "nemo-run==0.11.1" tensorboard tqdm && \
    pip install --no-cache-dir --no-build-isolation "transformer_engine[pytorch]" && \
    pip install --no-cache-dir --no-deps -e . && \
    python -c "import torch, vllm, transformer_engine, megatron.core; print('torch', torch.__version__, 'vllm', vllm.__version__)"
ENTRYPOINT []
