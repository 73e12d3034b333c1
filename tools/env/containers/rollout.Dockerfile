# The engines' image: vLLM 0.32 (which brings its own CUDA torch) plus this package, without
# Transformer Engine or apex (the engines need neither). Build, then convert for pyxis:
#   docker build -f tools/env/containers/rollout.Dockerfile -t spice-rollout .
#   enroot import -o spice-rollout.sqsh dockerd://spice-rollout
# and pass it as ROLLOUT_CONTAINER_IMAGE (slurm/) or --rollout-container-image (spice launch).
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0
FROM ${VLLM_IMAGE}
WORKDIR /opt/spice-megatron
COPY setup.py README.md ./
COPY spice_megatron ./spice_megatron
COPY recipes ./recipes
RUN pip install --no-cache-dir "megatron-core==0.16.1" "math-verify==0.9.0" "transformers>=4.57" matplotlib psutil datasets safetensors && \
    pip install --no-cache-dir --no-deps -e . && \
    python -c "import torch, vllm; print('torch', torch.__version__, 'vllm', vllm.__version__, 'nccl', torch.cuda.nccl.version())"
ENTRYPOINT []
