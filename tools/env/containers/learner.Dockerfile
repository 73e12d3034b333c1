# The learner's image: NGC PyTorch (CUDA torch with Transformer Engine and apex built against it)
# plus megatron-core and this package. vLLM is NOT installed here: it pins its own torch, and
# installing it would replace NGC's torch and break the TE/apex builds (rollout.Dockerfile is the
# engines' image). Build, then convert for pyxis:
#   docker build -f tools/env/containers/learner.Dockerfile -t spice-learner .
#   enroot import -o spice-learner.sqsh dockerd://spice-learner
# Pick an NGC release whose torch matches vLLM 0.32's (torch 2.13) closely enough that both ship
# the same NCCL major.minor: the weight-sync communicator spans both images
# (tools/env/containers/nccl_versions.sh prints what each image has).
ARG NGC_PYTORCH=nvcr.io/nvidia/pytorch:25.11-py3
FROM ${NGC_PYTORCH}
WORKDIR /opt/spice-megatron
COPY setup.py README.md ./
COPY spice_megatron ./spice_megatron
COPY recipes ./recipes
# --no-deps for torch: keep NGC's build. The learner needs no vLLM at all.
RUN pip install --no-cache-dir "megatron-core==0.16.1" "math-verify==0.9.0" "transformers>=4.57" matplotlib psutil datasets safetensors \
        "nemo-run==0.11.1" tensorboard tqdm requests fastapi uvicorn && \
    pip install --no-cache-dir --no-deps -e . && \
    python -c "import torch, transformer_engine, megatron.core; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version())"
