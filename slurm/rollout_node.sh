#!/usr/bin/env bash
# Runs on one rollout node (in its container, if any): one vLLM rollout service per group of
# SPICE_ENGINE_TP GPUs; engine i of this node (the step's SLURM_NODEID k) listens on
# SPICE_ROLLOUT_PORT + k * engines per node + i. An engine that exits is started again on its port
# and GPUs (up to SPICE_ENGINE_RESTARTS times per engine, default 3; each logged): the trainer sees
# it come back at weights version 0 and sends it the current weights, so the kill -9 of one engine
# costs no requeue. Colocated jobs (SPICE_SLEEP_MODE=1) start the engines asleep (SPICE_START_ASLEEP=1)
# so that the learner builds beside them; a restarted one starts awake, to receive the weights at
# once (on a GPU its memory must then be free: see docs/cluster.md). Past the bound the others are stopped and the script fails, so that srun
# (--kill-on-bad-exit) ends the job and Slurm requeues it; the learner resumes from its checkpoint.
# Each engine listens on this node's address as the trainer knows it (its entry in
# SPICE_ROLLOUT_NODES), or on every interface where that name resolves to loopback here;
# SPICE_ENGINE_HOST overrides. Numbers from the environment are checked before any arithmetic.
set -euo pipefail
umask "${SPICE_UMASK:-077}"

: "${SPICE_MODEL:?SPICE_MODEL: the HF directory of the base model}"
: "${SPICE_ROLLOUT_TOKEN:?SPICE_ROLLOUT_TOKEN: the shared secret of the engines}"
engine_tp=${SPICE_ENGINE_TP:-1}
port=${SPICE_ROLLOUT_PORT:-8100}
gpus=${SPICE_GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
log_dir=${SPICE_LOG_DIR:-logs}
node=${SLURMD_NODENAME:-$(hostname -s)}
node_index=${SLURM_NODEID:-0}
restarts_allowed=${SPICE_ENGINE_RESTARTS:-3}
seed=${SPICE_SEED:-1234}
for name in engine_tp port gpus node_index restarts_allowed seed; do
  if [[ ! ${!name} =~ ^[0-9]+$ ]]; then
    echo "rollout_node.sh: $name=${!name} (from the environment) is not a whole number" >&2
    exit 2
  fi
done
host=${SPICE_ENGINE_HOST:-}
if [[ -z $host ]]; then
  IFS=, read -ra addrs <<< "${SPICE_ROLLOUT_NODES:-}"
  host=${addrs[node_index]:-}
  ip=$(getent ahosts "$host" 2>/dev/null | awk 'NR == 1 {print $1}') || ip=""
  if [[ -z $host || -z $ip || $ip == 127.* || $ip == ::1 ]]; then host=0.0.0.0; fi
fi
mkdir -p "$log_dir"

if (( gpus % engine_tp != 0 )); then
  echo "rollout_node.sh: $gpus GPUs on $node are not a multiple of SPICE_ENGINE_TP=$engine_tp" >&2
  exit 2
fi

engines=$(( gpus / engine_tp ))
first_port=$(( port + node_index * engines ))

start_engine() {  # engine $1 on its GPUs and port, appending to its log; $2: its first start
  local i=$1 first=${2:-} devices
  devices=$(seq -s, $(( i * engine_tp )) $(( (i + 1) * engine_tp - 1 )))
  CUDA_VISIBLE_DEVICES=$devices python -m spice_megatron.rollout.serve \
    --model "$SPICE_MODEL" --host "$host" --port $(( first_port + i )) \
    --tensor-parallel-size "$engine_tp" ${SPICE_ENGINE_EXPERT_PARALLEL:+--enable-expert-parallel} \
    --max-model-len "${SPICE_MAX_MODEL_LEN:-12288}" \
    --gpu-memory-utilization "${SPICE_GPU_MEMORY_UTILIZATION:-0.85}" \
    --weight-transfer "${SPICE_WEIGHT_TRANSFER:-spice}" \
    ${SPICE_SLEEP_MODE:+--enable-sleep-mode} ${first:+${SPICE_START_ASLEEP:+--start-asleep}} \
    --seed $(( seed + 1000 * node_index + i )) \
    >> "$log_dir/rollout_${node}_$(( first_port + i )).log" 2>&1 &
  pids[i]=$!
}

pids=()
restarts=()
for (( i = 0; i < engines; i++ )); do
  start_engine "$i" first
  restarts[i]=0
done
echo "rollout_node.sh: $node started $engines engine(s) (TP=$engine_tp) on ports $first_port..$(( first_port + engines - 1 ))"

trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT TERM INT
set +e
while true; do
  wait -n "${pids[@]}"
  rc=$?
  for (( i = 0; i < engines; i++ )); do
    kill -0 "${pids[i]}" 2>/dev/null && continue
    wait "${pids[i]}" 2>/dev/null
    if (( restarts[i] >= restarts_allowed )); then
      echo "rollout_node.sh: engine $i on $node (port $(( first_port + i ))) exited (code $rc) after" \
           "${restarts[i]} restart(s); stopping the others" >&2
      exit $(( rc == 0 ? 1 : rc ))
    fi
    restarts[i]=$(( restarts[i] + 1 ))
    echo "rollout_node.sh: engine $i on $node (port $(( first_port + i ))) exited (code $rc); restart" \
         "${restarts[i]} of $restarts_allowed" >&2
    start_engine "$i"
  done
done
