#!/usr/bin/env bash
# Runs on one rollout node (in its container, if any): one vLLM rollout service per group of
# SPICE_ENGINE_TP GPUs; engine i of this node (the step's SLURM_NODEID k) listens on
# SPICE_ROLLOUT_PORT + k * engines per node + i. An engine wider than a node (SPICE_ENGINE_TP a
# multiple of the node's GPUs) spans SPICE_ENGINE_TP / GPUs consecutive rollout nodes, on a network the
# operator declared the job's alone (SPICE_TRUSTED_NETWORK): the first one leads it (the project's API
# on SPICE_ROLLOUT_PORT + k, its follower watch on SPICE_ENGINE_MASTER_PORT + 2 * engine + 1, default
# 29601, vLLM's torch.distributed store on a port the leader picks per start and tells its proven
# followers), each other node runs a headless follower on all its GPUs (rollout/follower.py); the
# engine lives and dies whole, and each node restarts its part, so a dead follower restarts the engine.
# An engine that exits is started again on its port and GPUs (up to SPICE_ENGINE_RESTARTS times per
# engine, default 3; each logged), once its GPUs and ports are free of the last one's processes (waited
# for, up to SPICE_ENGINE_FREE_WAIT s, default 120): the trainer sees it come back at weights version 0
# and sends it the current weights, so the kill -9 of one engine (or of a follower) costs no requeue.
# An engine across nodes exports VLLM_HOST_IP, this node's address as the others reach it. Colocated jobs (SPICE_SLEEP_MODE=1)
# start the engines asleep (SPICE_START_ASLEEP=1) so that the learner builds beside them; a restarted
# one starts awake, to receive the weights at once (on a GPU its memory must then be free: see
# docs/cluster.md). Past the bound the others are stopped and the script fails, so that srun
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
master_port=${SPICE_ENGINE_MASTER_PORT:-29600}
step_tokens=${SPICE_MAX_NUM_BATCHED_TOKENS:-0}  # 0: the engine's pinned default (rollout/step_settings.py)
step_seqs=${SPICE_MAX_NUM_SEQS:-0}
for name in engine_tp port gpus node_index restarts_allowed seed master_port step_tokens step_seqs; do
  if [[ ! ${!name} =~ ^[0-9]+$ ]]; then
    echo "rollout_node.sh: $name=${!name} (from the environment) is not a whole number" >&2
    exit 2
  fi
done
IFS=, read -ra addrs <<< "${SPICE_ROLLOUT_NODES:-}"
host=${SPICE_ENGINE_HOST:-}
if [[ -z $host ]]; then
  host=${addrs[node_index]:-}
  ip=$(getent ahosts "$host" 2>/dev/null | awk 'NR == 1 {print $1}') || ip=""
  if [[ -z $host || -z $ip || $ip == 127.* || $ip == ::1 ]]; then host=0.0.0.0; fi
fi
mkdir -p "$log_dir"

span=1  # the nodes one engine spans
if (( engine_tp > gpus )); then
  span=$(( engine_tp / gpus ))
  if (( engine_tp % gpus != 0 || ${#addrs[@]} % span != 0 )) || [[ -n ${SPICE_SLEEP_MODE:-} ]]; then
    echo "rollout_node.sh: an engine of SPICE_ENGINE_TP=$engine_tp spans whole nodes of $gpus GPUs: it needs a" \
         "multiple of $gpus, a multiple of its $span node(s) in SPICE_ROLLOUT_NODES (${#addrs[@]}), and rollout" \
         "nodes of its own (not colocated)" >&2
    exit 2
  fi
elif (( gpus % engine_tp != 0 )); then
  echo "rollout_node.sh: $gpus GPUs on $node are not a multiple of SPICE_ENGINE_TP=$engine_tp" >&2
  exit 2
fi

engines=$(( span > 1 ? 1 : gpus / engine_tp ))
group=$(( node_index / span ))  # this node's engine, across nodes
leader=$(( group * span ))  # the node that leads it (this one when an engine fits a node)
node_rank=$(( node_index - leader ))
first_port=$(( port + leader * engines ))
span_args=()
if (( span > 1 )); then
  # vLLM's store and message queues are not authenticated: an engine across nodes only on a network the
  # operator declared this job's alone (SPICE_TRUSTED_NETWORK: 1, or the interface on it)
  trusted=${SPICE_TRUSTED_NETWORK:-}
  if [[ -z $trusted || $trusted == 0 ]]; then
    echo "rollout_node.sh: an engine across nodes (SPICE_ENGINE_TP=$engine_tp) runs vLLM's unauthenticated store" \
         "and message queues: set SPICE_TRUSTED_NETWORK=1 (or the interface, e.g. ib0) where only this job reaches" \
         "the rollout nodes (docs/cluster.md, 'Security on a shared cluster')" >&2
    exit 2
  fi
  # the store's port is the leader's choice per start (--master-port 0), told to proven followers only
  span_args=(--nnodes "$span" --master-addr "${addrs[leader]}" --master-port 0
             --watch-port $(( master_port + 2 * group + 1 )))
  # vLLM's workers advertise their message queues at VLLM_HOST_IP, else at the default route's interface
  # (vllm/utils/network_utils.py get_ip): this node's address on the trusted network (the interface
  # SPICE_TRUSTED_NETWORK names), else as the other nodes reach it, not a loopback one its own name may
  # resolve to here; SPICE_ENGINE_HOST_IP overrides
  if [[ $trusted != 1 ]]; then
    export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-$trusted}
    if [[ -z ${SPICE_ENGINE_HOST_IP:-} ]]; then
      SPICE_ENGINE_HOST_IP=$(ip -o -4 addr show dev "$trusted" 2>/dev/null | awk '{split($4, a, "/"); print a[1]; exit}') || true
      if [[ -z $SPICE_ENGINE_HOST_IP ]]; then
        echo "rollout_node.sh: SPICE_TRUSTED_NETWORK=$trusted: no IPv4 address on that interface on $node" >&2
        exit 2
      fi
    fi
  fi
  if [[ -z ${VLLM_HOST_IP:-} ]]; then
    VLLM_HOST_IP=${SPICE_ENGINE_HOST_IP:-}
    if [[ -z $VLLM_HOST_IP && -n ${ip:-} && $ip != 127.* && $ip != ::1 ]]; then VLLM_HOST_IP=$ip; fi
    if [[ -z $VLLM_HOST_IP ]]; then
      VLLM_HOST_IP=$(hostname -I 2>/dev/null | tr ' ' '\n' | grep -v -e '^127\.' -e '^::1$' -e '^$' | head -n 1) || true
    fi
    if [[ -n $VLLM_HOST_IP ]]; then export VLLM_HOST_IP; else unset VLLM_HOST_IP; fi
  fi
fi

port_listened() {  # whether a process on this node listens on TCP port $1 (/proc/net/tcp and tcp6)
  local hex
  hex=$(printf ':%04X' "$1")
  awk -v p="$hex" '$4 == "0A" && substr($2, length($2) - 4) == p {found = 1} END {exit !found}' \
    /proc/net/tcp /proc/net/tcp6 2>/dev/null
}

wait_until_free() {  # before a restart: engine $1's GPUs and ports free of the last one's processes, bounded
  local i=$1 deadline=$(( SECONDS + ${SPICE_ENGINE_FREE_WAIT:-120} )) busy ports=()
  if (( node_rank == 0 )); then ports=($(( first_port + i ))); fi
  if (( span > 1 && node_rank == 0 )); then ports+=($(( master_port + 2 * group + 1 ))); fi
  while true; do
    busy=""
    for p in "${ports[@]}"; do port_listened "$p" && busy+=" port $p"; done
    if command -v nvidia-smi >/dev/null 2>&1; then
      apps=$(nvidia-smi --query-compute-apps=pid --format=csv,noheader -i "$(engine_devices "$i")" 2>/dev/null \
             | grep -c '[0-9]') || true
      (( ${apps:-0} > 0 )) && busy+=" $apps process(es) on GPUs $(engine_devices "$i")"
    fi
    [[ -z $busy ]] && return 0
    if (( SECONDS >= deadline )); then
      echo "rollout_node.sh: engine $i on $node: still held after ${SPICE_ENGINE_FREE_WAIT:-120} s:$busy;" \
           "restarting anyway" >&2
      return 0
    fi
    sleep 2
  done
}

engine_devices() {  # CUDA_VISIBLE_DEVICES of engine $1 on this node
  if (( span > 1 )); then seq -s, 0 $(( gpus - 1 )); else seq -s, $(( $1 * engine_tp )) $(( ($1 + 1) * engine_tp - 1 )); fi
}

start_engine() {  # engine $1 on its GPUs and port, appending to its log; $2: its first start
  local i=$1 first=${2:-} devices role
  devices=$(engine_devices "$i")  # an engine across nodes: every GPU of the node, its share of the workers
  role=(spice_megatron.rollout.serve --host "$host" --port $(( first_port + i )))
  if (( span > 1 && node_rank > 0 )); then role=(spice_megatron.rollout.follower --node-rank "$node_rank"); fi
  CUDA_VISIBLE_DEVICES=$devices python -m "${role[@]}" "${span_args[@]}" \
    --model "$SPICE_MODEL" \
    --tensor-parallel-size "$engine_tp" ${SPICE_ENGINE_EXPERT_PARALLEL:+--enable-expert-parallel} \
    --max-model-len "${SPICE_MAX_MODEL_LEN:-12288}" \
    --gpu-memory-utilization "${SPICE_GPU_MEMORY_UTILIZATION:-0.85}" \
    --max-num-batched-tokens "$step_tokens" --max-num-seqs "$step_seqs" \
    --weight-transfer "${SPICE_WEIGHT_TRANSFER:-spice}" \
    ${SPICE_SLEEP_MODE:+--enable-sleep-mode} ${first:+${SPICE_START_ASLEEP:+--start-asleep}} \
    --seed $(( seed + 1000 * leader + i )) \
    >> "$log_dir/rollout_${node}_$(( first_port + i ))$( (( node_rank > 0 )) && echo "_node$node_rank").log" 2>&1 &
  pids[i]=$!
}

pids=()
restarts=()
for (( i = 0; i < engines; i++ )); do
  start_engine "$i" first
  restarts[i]=0
done
if (( span > 1 )); then
  echo "rollout_node.sh: $node started node $node_rank of $span of the engine (TP=$engine_tp) led by" \
       "${addrs[leader]}:$first_port"
else
  echo "rollout_node.sh: $node started $engines engine(s) (TP=$engine_tp) on ports $first_port..$(( first_port + engines - 1 ))"
fi

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
    wait_until_free "$i"
    start_engine "$i"
  done
done
