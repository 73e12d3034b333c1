#!/usr/bin/env bash
# Runs inside the container on one rollout node: one vLLM rollout service per group of
# SPICE_ENGINE_TP GPUs, engine i listening on SPICE_ROLLOUT_PORT + i. If any engine exits, the
# others are stopped and the script fails, so that srun (--kill-on-bad-exit) ends the job and
# Slurm requeues it; the learner resumes from its last checkpoint.
set -euo pipefail

: "${SPICE_MODEL:?SPICE_MODEL: the HF directory of the base model}"
: "${SPICE_ROLLOUT_TOKEN:?SPICE_ROLLOUT_TOKEN: the shared secret of the engines}"
engine_tp=${SPICE_ENGINE_TP:-1}
port=${SPICE_ROLLOUT_PORT:-8100}
gpus=${SPICE_GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
log_dir=${SPICE_LOG_DIR:-logs}
node=$(hostname -s)
node_index=${SLURM_NODEID:-0}
mkdir -p "$log_dir"

if (( gpus % engine_tp != 0 )); then
  echo "rollout_node.sh: $gpus GPUs on $node are not a multiple of SPICE_ENGINE_TP=$engine_tp" >&2
  exit 2
fi

pids=()
for (( i = 0; i < gpus / engine_tp; i++ )); do
  devices=$(seq -s, $(( i * engine_tp )) $(( (i + 1) * engine_tp - 1 )))
  CUDA_VISIBLE_DEVICES=$devices python -m spice_megatron.rollout.serve \
    --model "$SPICE_MODEL" --host 0.0.0.0 --port $(( port + i )) \
    --tensor-parallel-size "$engine_tp" ${SPICE_ENGINE_EXPERT_PARALLEL:+--enable-expert-parallel} \
    --max-model-len "${SPICE_MAX_MODEL_LEN:-12288}" \
    --gpu-memory-utilization "${SPICE_GPU_MEMORY_UTILIZATION:-0.85}" \
    --weight-transfer "${SPICE_WEIGHT_TRANSFER:-spice}" \
    --seed $(( ${SPICE_SEED:-1234} + 1000 * node_index + i )) \
    > "$log_dir/rollout_${node}_$(( port + i )).log" 2>&1 &
  pids+=("$!")
done
echo "rollout_node.sh: $node started ${#pids[@]} engine(s) (TP=$engine_tp) on ports $port..$(( port + ${#pids[@]} - 1 ))"

trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT TERM INT
set +e
wait -n "${pids[@]}"
rc=$?
set -e
echo "rollout_node.sh: an engine on $node exited with code $rc; stopping the others" >&2
exit $(( rc == 0 ? 1 : rc ))
