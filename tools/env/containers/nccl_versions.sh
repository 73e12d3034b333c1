#!/usr/bin/env bash
# Print the NCCL version of the learner and rollout images (pyxis/enroot), which must agree on
# major.minor for the weight-sync communicator that spans them:
#   bash tools/env/containers/nccl_versions.sh spice-learner.sqsh spice-rollout.sqsh
set -euo pipefail
probe='import torch; print(".".join(map(str, torch.cuda.nccl.version())))'
learner=$(srun --ntasks=1 --container-image="$1" python -c "$probe")
rollout=$(srun --ntasks=1 --container-image="$2" python -c "$probe")
echo "learner image NCCL $learner, rollout image NCCL $rollout"
if [[ ${learner%.*} != "${rollout%.*}" ]]; then
  # VLLM_NCCL_SO_PATH would not help: it steers vLLM's own ctypes NCCL, while the spice backend on the
  # engines uses torch's ProcessGroupNCCL, which loads the libnccl.so.2 its torch wheel was built with.
  echo "NCCL major.minor differ. The weight sync runs torch's ProcessGroupNCCL on both sides, so either" >&2
  echo "  - build both images on the same torch/NCCL (an NGC release whose torch equals vLLM's), or" >&2
  echo "  - pin NCCL $learner in the rollout image: pip install 'nvidia-nccl-cu12==$learner.*' (or the cu13 package" >&2
  echo "    matching its CUDA) and LD_PRELOAD that libnccl.so.2 for the engines, then run this check again" >&2
  exit 1
fi
