# shellcheck shell=bash
# The body of slurm/spice_*.sbatch (sourced by them after they set RECIPE, LEARNER_NODES,
# ENGINE_TP and MAX_MODEL_LEN). Splits the allocation into learner and rollout nodes, starts
# the rollout services, waits until they are healthy, then runs the learner with torchrun over
# the learner nodes. A failed run is requeued and resumes from its last checkpoint.
#
# Settings (environment, with defaults):
#   MODEL_DIR         HF directory of the base model, as seen inside the container (required)
#   CONTAINER_IMAGE   enroot/pyxis image with spice-megatron installed (default: spice-megatron.sqsh)
#   CONTAINER_MOUNTS  extra mounts, comma-separated src:dst (models, data, output)
#   SPICE_HOME        the repository, mounted at the same path (default: the submit directory)
#   OUTPUT_DIR        run directory (default: $SPICE_HOME/runs/$RECIPE)
#   GPUS_PER_NODE     (default: $SLURM_GPUS_ON_NODE or 8)
#   ROLLOUT_PORT      first engine port on each rollout node (default: 8100)
#   RDZV_PORT         torchrun rendezvous port on the first learner node (default: 29500)
#   HEALTH_TIMEOUT    seconds to wait for the engines (default: 1800)
#   MAX_RESTARTS      requeues after a failure (default: 3)
#   Extra arguments to sbatch's script become config overrides: sbatch slurm/spice_8b.sbatch run.iterations=100
set -euo pipefail

: "${RECIPE:?}" "${LEARNER_NODES:?}" "${ENGINE_TP:?}" "${MAX_MODEL_LEN:?}"
: "${MODEL_DIR:?set MODEL_DIR to the HF directory of the base model, as seen inside the container}"
SPICE_HOME=${SPICE_HOME:-${SLURM_SUBMIT_DIR:-$PWD}}
CONTAINER_IMAGE=${CONTAINER_IMAGE:-$SPICE_HOME/spice-megatron.sqsh}
OUTPUT_DIR=${OUTPUT_DIR:-$SPICE_HOME/runs/$RECIPE}
GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
ROLLOUT_PORT=${ROLLOUT_PORT:-8100}
RDZV_PORT=${RDZV_PORT:-29500}
HEALTH_TIMEOUT=${HEALTH_TIMEOUT:-1800}
MAX_RESTARTS=${MAX_RESTARTS:-3}
RESTART=${SLURM_RESTART_COUNT:-0}
LOG_DIR=$OUTPUT_DIR/logs/slurm_${SLURM_JOB_ID}_restart${RESTART}
mkdir -p "$LOG_DIR"

mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
if (( ${#NODES[@]} <= LEARNER_NODES )); then
  echo "spice: ${#NODES[@]} node(s) allocated; LEARNER_NODES=$LEARNER_NODES leaves none for rollout" >&2
  exit 2
fi
LEARNER=("${NODES[@]:0:LEARNER_NODES}")
ROLLOUT=("${NODES[@]:LEARNER_NODES}")
learner_list=$(IFS=,; echo "${LEARNER[*]}")
rollout_list=$(IFS=,; echo "${ROLLOUT[*]}")
head_ip=$(srun --nodes=1 --ntasks=1 -w "${LEARNER[0]}" hostname --ip-address | awk '{print $1}')
echo "spice: job $SLURM_JOB_ID restart $RESTART: learner nodes $learner_list, rollout nodes $rollout_list"

# What both roles read. The token is a fresh secret per attempt; it travels in the environment,
# never on a command line.
SPICE_ROLLOUT_TOKEN=${SPICE_ROLLOUT_TOKEN:-$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')}
export SPICE_ROLLOUT_TOKEN
export SPICE_ROLLOUT_NODES=$rollout_list
export SPICE_ENGINES_PER_NODE=$(( GPUS_PER_NODE / ENGINE_TP ))
export SPICE_ROLLOUT_PORT=$ROLLOUT_PORT SPICE_ENGINE_TP=$ENGINE_TP SPICE_MAX_MODEL_LEN=$MAX_MODEL_LEN
export SPICE_MODEL=$MODEL_DIR SPICE_LOG_DIR=$LOG_DIR SPICE_GPUS_PER_NODE=$GPUS_PER_NODE
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}

# NCCL. The weight-sync group is its own communicator between the learner's stage senders and
# every engine worker on other nodes: both sides must agree on the transport and on
# NCCL_CUMEM_ENABLE (vLLM sets it to 0 in its workers; a mismatch hangs the first broadcast).
export NCCL_CUMEM_ENABLE=0
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export NCCL_IB_TIMEOUT=${NCCL_IB_TIMEOUT:-22}
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1
export CUDA_DEVICE_MAX_CONNECTIONS=1  # Megatron-Core: overlap of TP communication with compute
if [[ -n "${NCCL_SOCKET_IFNAME:-}" ]]; then export NCCL_SOCKET_IFNAME GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-$NCCL_SOCKET_IFNAME}; fi

container=(--container-image="$CONTAINER_IMAGE" --container-workdir="$SPICE_HOME" --no-container-mount-home
           --container-mounts="$SPICE_HOME:$SPICE_HOME${CONTAINER_MOUNTS:+,$CONTAINER_MOUNTS}")

# Requeue on the time limit (sbatch --signal=B:USR1@600) and on failure, up to MAX_RESTARTS.
requeue() {
  if (( RESTART < MAX_RESTARTS )); then
    echo "spice: requeueing job $SLURM_JOB_ID ($1); it resumes from the last checkpoint" >&2
    scontrol requeue "$SLURM_JOB_ID"
  else
    echo "spice: not requeueing ($1): MAX_RESTARTS=$MAX_RESTARTS reached" >&2
  fi
}
trap 'requeue "time limit"; exit 0' USR1

# --- rollout: one service per ENGINE_TP GPUs on every rollout node
srun --nodes=${#ROLLOUT[@]} --ntasks-per-node=1 -w "$rollout_list" "${container[@]}" \
  --output="$LOG_DIR/rollout_%N.out" --kill-on-bad-exit=1 bash slurm/rollout_node.sh &
rollout_pid=$!
trap 'kill "$rollout_pid" 2>/dev/null || true' EXIT

# --- wait until every engine answers /health
deadline=$(( SECONDS + HEALTH_TIMEOUT ))
for host in "${ROLLOUT[@]}"; do
  for (( i = 0; i < SPICE_ENGINES_PER_NODE; i++ )); do
    url="http://$host:$(( ROLLOUT_PORT + i ))/health"
    until curl -sf -o /dev/null --max-time 5 "$url"; do
      if ! kill -0 "$rollout_pid" 2>/dev/null; then
        echo "spice: the rollout services exited before $url was healthy; see $LOG_DIR" >&2
        requeue "rollout start failed"
        exit 1
      fi
      if (( SECONDS > deadline )); then
        echo "spice: $url not healthy after ${HEALTH_TIMEOUT}s; see $LOG_DIR" >&2
        requeue "rollout health timeout"
        exit 1
      fi
      sleep 10
    done
  done
done
echo "spice: ${#ROLLOUT[@]} x $SPICE_ENGINES_PER_NODE rollout engine(s) healthy"

# --- learner: torchrun over the learner nodes; always --resume (a requeued job continues)
srun --nodes="$LEARNER_NODES" --ntasks-per-node=1 -w "$learner_list" "${container[@]}" \
  --output="$LOG_DIR/learner_%N.out" --kill-on-bad-exit=1 \
  python -m torch.distributed.run --nnodes="$LEARNER_NODES" --nproc-per-node="$GPUS_PER_NODE" \
  --rdzv-backend=c10d --rdzv-endpoint="$head_ip:$RDZV_PORT" --rdzv-id="$SLURM_JOB_ID" \
  -m spice_megatron.cli train --recipe "$RECIPE" --model "$MODEL_DIR" --output-dir "$OUTPUT_DIR" --resume \
  cluster.nodes=${#NODES[@]} cluster.learner_nodes="$LEARNER_NODES" "$@" &
learner_pid=$!
set +e
wait "$learner_pid"
rc=$?
set -e
case $rc in
  0) echo "spice: run finished; HF checkpoint in $OUTPUT_DIR/hf_final" ;;
  3) echo "spice: the kill switch stopped the run (see $LOG_DIR/learner_*.out); not requeueing" >&2 ;;
  *) echo "spice: learner exited with code $rc" >&2; requeue "learner exit $rc" ;;
esac
exit "$rc"
