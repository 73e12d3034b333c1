#!/usr/bin/env bash
# Print the NCCL version of the learner and rollout images (pyxis/enroot), which must agree on
# major.minor for the weight-sync communicator that spans them:
#   bash tools/containers/nccl_versions.sh spice-learner.sqsh spice-rollout.sqsh
set -euo pipefail
probe='import torch; print(".".join(map(str, torch.cuda.nccl.version())))'
learner=$(srun --ntasks=1 --container-image="$1" python -c "$probe")
rollout=$(srun --ntasks=1 --container-image="$2" python -c "$probe")
echo "learner image NCCL $learner, rollout image NCCL $rollout"
if [[ ${learner%.*} != "${rollout%.*}" ]]; then
  echo "NCCL major.minor differ: set VLLM_NCCL_SO_PATH in the rollout image to the learner's libnccl, or rebuild" >&2
  exit 1
fi
