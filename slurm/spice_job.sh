# shellcheck shell=bash
# The body of slurm/spice_*.sbatch (sourced by them after they set RECIPE, LEARNER_NODES,
# ENGINE_TP and MAX_MODEL_LEN, each overridable from the environment: SPICE_RECIPE,
# SPICE_LEARNER_NODES, SPICE_ENGINE_TP, SPICE_MAX_MODEL_LEN, so that one sbatch body serves the paper
# recipe and the tiny CPU recipe alike). Splits the allocation into learner and rollout nodes, starts
# the rollout services, waits until they are healthy, then runs the learner with torchrun over
# the learner nodes. A failed run is requeued and resumes from its last checkpoint.
#
# Settings (environment, with defaults):
#   MODEL_DIR         HF directory of the base model, as seen inside the container (required)
#   ROLLOUT_MODEL_DIR the directory the engines serve (default: MODEL_DIR); an FP8 MODEL_DIR needs its
#                     bf16 copy here (spice convert bf16; docs/checkpoints.md)
#   CONTAINER_IMAGE   the learner's enroot/pyxis image: NGC PyTorch + megatron-core (+ TE, apex) + this
#                     package (tools/env/containers/learner.Dockerfile); unset or "none": no container, the
#                     job's own Python environment (sbatch exports the submitting shell's PATH)
#   ROLLOUT_CONTAINER_IMAGE  the engines' image: vLLM 0.32 + this package (default: CONTAINER_IMAGE;
#                     tools/env/containers/rollout.Dockerfile). vLLM pins its own torch, which breaks
#                     an NGC image's TE/apex builds, hence two images.
#   SPICE_DATA_DIR    holds staged/RECIPE, the corpus staged by `spice prepare --recipe RECIPE` on a
#                     node with hub access (default: $SPICE_HOME/data); jobs run with HF_HUB_OFFLINE=1
#   CONTAINER_MOUNTS  extra mounts, comma-separated src:dst (models, data, output)
#   SPICE_HOME        the repository, mounted at the same path (default: the submit directory)
#   OUTPUT_DIR        run directory (default: $SPICE_HOME/runs/$RECIPE)
#   GPUS_PER_NODE     (default: the allocation's $SLURM_GPUS_ON_NODE, else 8; on CPU nodes set it: 1)
#   WEIGHT_TRANSFER   vLLM weight-transfer backend of engines and learner alike (default: spice; nccl
#                     needs pipeline parallelism 1 and vLLM in the learner's image; ipc: colocated jobs;
#                     docs/weight-sync.md)
#   ROLLOUT_PORT      first engine port (default: 8100); engine i of rollout node k listens on
#                     ROLLOUT_PORT + k * engines per node + i, so that nodes sharing a host do not collide
#   ENGINE_TP         GPUs per engine; a multiple of GPUS_PER_NODE spans that many whole rollout nodes
#                     (vLLM's multi-node serving; disaggregated jobs only)
#   SPICE_ENGINE_MASTER_PORT  engines across nodes: engine g's torch.distributed port is this + 2g, its
#                     follower watch the next (default: 29600)
#   RDZV_PORT         torchrun rendezvous port on the first learner node (default: 29500)
#   HEALTH_TIMEOUT    seconds to wait for the engines (default: 1800)
#   MAX_RESTARTS      requeues after a failure (default: 3); time-limit requeues are not counted
#   STOP_GRACE        seconds the learner gets to checkpoint after the time-limit warning (default: 540,
#                     under the 600 s of --signal=B:USR1@600)
#   COLOCATE          1: learner and engines share every node's GPUs (run.colocate; the *_1node sbatch files
#                     set it): both srun steps span all nodes with --overlap, the engines start asleep and
#                     the trainer wakes them once it has built; one image for both roles (vLLM's CUDA IPC
#                     weight transfer needs vLLM in the learner's environment: ROLLOUT_CONTAINER_IMAGE is
#                     ignored)
#   SPICE_UMASK       what the job writes is its user's alone (default: 077; 027 with run.group_readable=true)
#   Extra arguments to sbatch's script become config overrides: sbatch slurm/spice_8b.sbatch run.iterations=100
#
# Every number above is checked to be one before any arithmetic uses it (bash evaluates what an
# arithmetic expression holds), and the run directory must be the user's own, writable by nobody
# else: a resume runs what its checkpoints hold (docs/cluster.md, "Security on a shared cluster").
set -euo pipefail
umask "${SPICE_UMASK:-077}"

# a whole number, or one line and exit 2
require_count() {
  if [[ ! $2 =~ ^[0-9]+$ ]]; then
    echo "spice: $1=$2 is not a whole number; not starting" >&2
    exit 2
  fi
}
# A counter file's number (0 when there is none); anything else is refused, never evaluated.
count() {
  local n=0
  if [[ -e $1 || -L $1 ]]; then n=$(head -c 32 "$1"); fi
  if [[ ! $n =~ ^[0-9]+$ ]]; then
    echo "spice: $1 holds '${n//[^[:print:]]/?}', not a count; not requeueing (remove it if the run directory is yours)" >&2
    exit 2
  fi
  echo "$n"
}
# Written next to the file and renamed over it: a link in its place is replaced, never followed.
write_count() {
  echo "$2" > "$1.$$" && mv -f "$1.$$" "$1"
}

RECIPE=${SPICE_RECIPE:-${RECIPE:?}} LEARNER_NODES=${SPICE_LEARNER_NODES:-${LEARNER_NODES:-0}}
COLOCATE=${SPICE_COLOCATE:-${COLOCATE:-0}}
ENGINE_TP=${SPICE_ENGINE_TP:-${ENGINE_TP:?}} MAX_MODEL_LEN=${SPICE_MAX_MODEL_LEN:-${MAX_MODEL_LEN:?}}
if [[ -z ${SLURM_JOB_ID:-} ]]; then
  echo "spice: SLURM_JOB_ID is unset: submit this file with sbatch (or try it on tools/env/slurm_box.sh)" >&2
  exit 2
fi
if [[ -z ${MODEL_DIR:-} ]]; then
  echo "spice: set MODEL_DIR to the HF directory of the base model, as seen inside the container; not starting" >&2
  exit 2
fi
SPICE_HOME=${SPICE_HOME:-${SLURM_SUBMIT_DIR:-$PWD}}
CONTAINER_IMAGE=${CONTAINER_IMAGE:-none}
ROLLOUT_CONTAINER_IMAGE=${ROLLOUT_CONTAINER_IMAGE:-$CONTAINER_IMAGE}
if [[ $COLOCATE == 1 ]]; then ROLLOUT_CONTAINER_IMAGE=$CONTAINER_IMAGE; fi
export SPICE_DATA_DIR=${SPICE_DATA_DIR:-$SPICE_HOME/data}
OUTPUT_DIR=${OUTPUT_DIR:-$SPICE_HOME/runs/$RECIPE}
GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
ROLLOUT_PORT=${ROLLOUT_PORT:-8100}
RDZV_PORT=${RDZV_PORT:-29500}
HEALTH_TIMEOUT=${HEALTH_TIMEOUT:-1800}
MAX_RESTARTS=${MAX_RESTARTS:-3}
STOP_GRACE=${STOP_GRACE:-540}
RESTART=${SLURM_RESTART_COUNT:-0}
for name in LEARNER_NODES COLOCATE ENGINE_TP MAX_MODEL_LEN ROLLOUT_PORT RDZV_PORT HEALTH_TIMEOUT MAX_RESTARTS \
            STOP_GRACE RESTART GPUS_PER_NODE SLURM_JOB_ID; do
  require_count "$name" "${!name}"
done
# The run directory: the user's own and writable by nobody else (created so), or not started.
mkdir -p "$OUTPUT_DIR"
if [[ ! -O $OUTPUT_DIR ]] || [[ -n $(find "$OUTPUT_DIR" -maxdepth 0 -perm /022 2>/dev/null) ]]; then
  echo "spice: OUTPUT_DIR $OUTPUT_DIR is not yours alone to write (owner $(stat -c %U "$OUTPUT_DIR"), mode" \
       "$(stat -c %a "$OUTPUT_DIR")): a resume would run what others put there; not starting (chmod go-w it if it is yours)" >&2
  exit 2
fi
# Every directory above one the job trusts: root's or this user's, writable by nobody else unless
# sticky with the next one down this user's; otherwise another user could swap it after the checks.
unsafe_ancestor() {  # prints the first unsafe directory above $1 (resolved), nothing if none
  local path dir child
  path=$(readlink -f "$1")
  child=$path
  dir=$(dirname "$path")
  while :; do
    if [[ -e $dir ]]; then
      local owner mode
      owner=$(stat -c %u "$dir") mode=$(stat -c %a "$dir")
      if [[ $owner != 0 && $owner != "$(id -u)" ]]; then echo "$dir (owned by $(stat -c %U "$dir"))"; return; fi
      if (( 8#$mode & 8#022 )) && ! { (( 8#$mode & 8#1000 )) && [[ ! -e $child || -O $child ]]; }; then
        echo "$dir (mode $mode)"; return
      fi
    fi
    [[ $dir == / ]] && return
    child=$dir
    dir=$(dirname "$dir")
  done
}
for trusted in "$OUTPUT_DIR" "$SPICE_HOME"; do
  bad=$(unsafe_ancestor "$trusted")
  if [[ -n $bad ]]; then
    echo "spice: $trusted lies under $bad, which another user could change: not starting" >&2
    exit 2
  fi
done
# The code every node runs: another user's, or writable by others, it would run as this user on every node.
# SPICE_HOME itself and what lies directly in it too: every node's command runs from it (`python -m` puts
# it first on sys.path), so a module another user could drop there (SPICE_HOME/secrets.py) would run.
unsafe_code=$(find "$SPICE_HOME" -maxdepth 1 \( \( ! -type l -perm /022 \) -o ! -user "$(id -u)" \) -print -quit \
  2>/dev/null || true)
[[ -n $unsafe_code ]] || unsafe_code=$(find "$SPICE_HOME/spice_megatron" "$SPICE_HOME/recipes" "$SPICE_HOME/slurm" \
  \( -perm /022 -o ! -user "$(id -u)" \) -print -quit 2>/dev/null || true)
if [[ -n $unsafe_code ]]; then
  echo "spice: $unsafe_code is another user's or writable by group or others: the job would run what they put" \
       "there; not starting (chmod -R go-w $SPICE_HOME; use a copy of your own)" >&2
  exit 2
fi
LOG_DIR=$OUTPUT_DIR/logs/slurm_${SLURM_JOB_ID}_restart${RESTART}
mkdir -p "$LOG_DIR"
# Files shared with the trainer (spice_megatron/trainer.py): torchrun reports every worker failure
# as exit 1, so the kill switch is a marker file, and the time-limit stop request is a file too.
STOP_FILE=$OUTPUT_DIR/STOP
STOPPED_FILE=$OUTPUT_DIR/STOPPED  # written by the trainer when it stopped on a request (STOP file, Ctrl-C)
KILL_SWITCH_FILE=$OUTPUT_DIR/KILL_SWITCH
FAILURES_FILE=$OUTPUT_DIR/.slurm_failed_attempts
TIME_LIMITS_FILE=$OUTPUT_DIR/.slurm_time_limit_requeues
count "$FAILURES_FILE" >/dev/null && count "$TIME_LIMITS_FILE" >/dev/null  # a bad one stops the job now
# One writer per run directory (spice_megatron/run/lock.py): the trainer holds OUTPUT_DIR/RUN_LOCK.
# Held by another Slurm job that still runs: refuse before touching anything here (no requeue).
# A holder outside Slurm, or an earlier attempt of this job, is the trainer's to judge.
lock_job=$(sed -n 's/.*"slurm_job_id": *"\([0-9_]*\)".*/\1/p' "$OUTPUT_DIR/RUN_LOCK" 2>/dev/null || true)
if [[ -n $lock_job && $lock_job != "$SLURM_JOB_ID" ]] && squeue -h -j "$lock_job" -o %T 2>/dev/null | grep -qx RUNNING; then
  echo "spice: $OUTPUT_DIR is in use by Slurm job $lock_job (its RUN_LOCK); not starting: use another OUTPUT_DIR" >&2
  exit 2
fi
rm -f "$STOP_FILE" "$STOPPED_FILE"

mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
overlap=()
if [[ $COLOCATE == 1 ]]; then  # every node runs learner ranks and engines on the same GPUs
  LEARNER_NODES=${#NODES[@]}
  LEARNER=("${NODES[@]}")
  ROLLOUT=("${NODES[@]}")
  overlap=(--overlap)  # the second step shares the first one's CPUs, memory and GPUs
  export SPICE_SLEEP_MODE=1 SPICE_START_ASLEEP=1
else
  if (( LEARNER_NODES < 1 )); then
    echo "spice: set LEARNER_NODES (or SPICE_LEARNER_NODES) to the learner's node count, or COLOCATE=1" >&2
    exit 2
  fi
  if (( ${#NODES[@]} <= LEARNER_NODES )); then
    echo "spice: ${#NODES[@]} node(s) allocated; LEARNER_NODES=$LEARNER_NODES leaves none for rollout" >&2
    exit 2
  fi
  LEARNER=("${NODES[@]:0:LEARNER_NODES}")
  ROLLOUT=("${NODES[@]:LEARNER_NODES}")
fi
# An engine wider than a node spans ENGINE_TP / GPUS_PER_NODE whole rollout nodes (slurm/rollout_node.sh:
# a leader and headless followers), never a colocated job's: vLLM's CUDA IPC and sleep mode stay in a node.
ENGINE_NODES=1
if (( ENGINE_TP > GPUS_PER_NODE )); then
  ENGINE_NODES=$(( ENGINE_TP / GPUS_PER_NODE ))
  if [[ $COLOCATE == 1 ]]; then
    echo "spice: ENGINE_TP=$ENGINE_TP spans $ENGINE_NODES nodes of $GPUS_PER_NODE GPUs; colocated engines stay within" \
         "a node: use the disaggregated placement (COLOCATE=0 with LEARNER_NODES, rollout nodes of its own) or" \
         "ENGINE_TP <= $GPUS_PER_NODE; not starting" >&2
    exit 2
  fi
  if (( ENGINE_TP % GPUS_PER_NODE != 0 || ${#ROLLOUT[@]} % ENGINE_NODES != 0 )); then
    echo "spice: ENGINE_TP=$ENGINE_TP over nodes of $GPUS_PER_NODE GPUs needs a multiple of $GPUS_PER_NODE and a" \
         "rollout node count (${#ROLLOUT[@]}) that is a multiple of $ENGINE_NODES; not starting" >&2
    exit 2
  fi
  # vLLM's store and message queues are not authenticated (code execution for whoever reaches them while
  # an engine starts): only on a network the operator declares this job's alone
  if [[ -z ${SPICE_TRUSTED_NETWORK:-} || ${SPICE_TRUSTED_NETWORK} == 0 ]]; then
    echo "spice: ENGINE_TP=$ENGINE_TP spans $ENGINE_NODES nodes, and an engine across nodes runs vLLM's" \
         "unauthenticated store and message queues: set SPICE_TRUSTED_NETWORK=1 (or the interface, e.g. ib0) where" \
         "only this job reaches the rollout nodes (docs/cluster.md, 'Security on a shared cluster'); not starting" >&2
    exit 2
  fi
elif (( GPUS_PER_NODE % ENGINE_TP != 0 )); then
  echo "spice: GPUS_PER_NODE=$GPUS_PER_NODE is not a multiple of ENGINE_TP=$ENGINE_TP; not starting" >&2
  exit 2
fi
# The engines serve what the bf16 weight sync can fill: a quantized directory (an FP8 MODEL_DIR without a
# ROLLOUT_MODEL_DIR) is refused here, before any srun, not from the engines' /status after the learner
# has loaded the model, as a failure that requeues (bridge/dequantize.py says the same from Python).
engine_model=${ROLLOUT_MODEL_DIR:-$MODEL_DIR}
if [[ -f $engine_model/config.json ]] \
   && grep -Eq '"quantization_config"[[:space:]]*:[[:space:]]*[{]' "$engine_model/config.json"; then
  echo "spice: ROLLOUT_MODEL_DIR=$engine_model is quantized (config.json has a quantization_config): the weight" \
       "sync sends bf16 tensors the engines would cast with stale scales; serve a bf16 copy (spice convert bf16" \
       "--model $engine_model --output DIR, then ROLLOUT_MODEL_DIR=DIR); not starting" >&2
  exit 2
fi
learner_list=$(IFS=,; echo "${LEARNER[*]}")
rollout_list=$(IFS=,; echo "${ROLLOUT[*]}")
# Every srun names its task count: the allocation's SLURM_NTASKS (one task per node) is inherited
# by srun and would override --ntasks-per-node.
head_ip=$(srun --nodes=1 --ntasks=1 -w "${LEARNER[0]}" hostname --ip-address | awk '{print $1}')
# The engines' addresses as Slurm knows them (NodeAddr: the name or an IP), each checked to resolve
# here: a name that does not is one line now, not a health wait of HEALTH_TIMEOUT and a requeue.
ROLLOUT_ADDRS=()
for node in "${ROLLOUT[@]}"; do
  addr=$(scontrol show node -o "$node" | grep -o 'NodeAddr=[^ ]*' | cut -d= -f2)
  addr=${addr:-$node}
  if ! getent ahosts "$addr" >/dev/null; then
    echo "spice: rollout node $node's address $addr does not resolve on $(hostname -s); not starting" >&2
    exit 2
  fi
  ROLLOUT_ADDRS+=("$addr")
done
echo "spice: job $SLURM_JOB_ID restart $RESTART: learner nodes $learner_list, rollout nodes $rollout_list"

# What both roles read. The token is a fresh secret per attempt (never one inherited from the
# submitting shell); it travels in the environment, never on a command line.
SPICE_ROLLOUT_TOKEN=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')
export SPICE_ROLLOUT_TOKEN
SPICE_ROLLOUT_NODES=$(IFS=,; echo "${ROLLOUT_ADDRS[*]}")
export SPICE_ROLLOUT_NODES
export SPICE_ENGINES_PER_NODE=$(( ENGINE_NODES > 1 ? 1 : GPUS_PER_NODE / ENGINE_TP )) SPICE_ENGINE_NODES=$ENGINE_NODES
export SPICE_ROLLOUT_PORT=$ROLLOUT_PORT SPICE_ENGINE_TP=$ENGINE_TP SPICE_MAX_MODEL_LEN=$MAX_MODEL_LEN
# mixture-of-experts recipes: vLLM's expert parallelism inside each engine (ENGINE_EP=1 in the sbatch)
if [[ "${ENGINE_EP:-0}" == 1 ]]; then export SPICE_ENGINE_EXPERT_PARALLEL=1; fi
ROLLOUT_MODEL_DIR=${ROLLOUT_MODEL_DIR:-$MODEL_DIR}
export SPICE_MODEL=$ROLLOUT_MODEL_DIR SPICE_LOG_DIR=$LOG_DIR SPICE_GPUS_PER_NODE=$GPUS_PER_NODE
export SPICE_WEIGHT_TRANSFER=${WEIGHT_TRANSFER:-spice}
# the engines' share of each GPU (vLLM's gpu_memory_utilization); colocated, what the learner's
# resident weights leave (the recipe's rollout.gpu_memory_utilization, ENGINE_MEMORY_SHARE in the sbatch)
export SPICE_GPU_MEMORY_UTILIZATION=${SPICE_GPU_MEMORY_UTILIZATION:-${ENGINE_MEMORY_SHARE:-0.85}}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}

# NCCL. The weight-sync group is its own communicator between the learner's stage senders and
# every engine worker on other nodes. Within a node its P2P transport exchanges memory handles, and
# cuMem handles (NCCL_CUMEM_ENABLE, on by default) and legacy IPC handles do not mix; but no node
# holds both a sender and an engine here (the members that share a node all come from one image),
# so NCCL keeps its default on the learner, where cuMem enables NVLS for the TP/DP collectives. A
# NCCL_CUMEM_ENABLE exported before sbatch reaches both sides.
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export NCCL_IB_TIMEOUT=${NCCL_IB_TIMEOUT:-22}
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1
if [[ -n "${NCCL_SOCKET_IFNAME:-}" ]]; then export NCCL_SOCKET_IFNAME GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-$NCCL_SOCKET_IFNAME}; fi

# pyxis flags for an image ("none": no container, the job's own environment)
in_image() {
  if [[ $1 == none ]]; then return; fi
  printf '%s\n' --container-image="$1" --container-workdir="$SPICE_HOME" --no-container-mount-home \
    --container-mounts="$SPICE_HOME:$SPICE_HOME${CONTAINER_MOUNTS:+,$CONTAINER_MOUNTS}"
}
mapfile -t rollout_container < <(in_image "$ROLLOUT_CONTAINER_IMAGE")
mapfile -t learner_container < <(in_image "$CONTAINER_IMAGE")
if [[ $CONTAINER_IMAGE == none ]]; then cd "$SPICE_HOME"; fi

# Requeue after a failure (at most MAX_RESTARTS failed attempts) or at the time limit (always).
requeue() {
  local why=$1 kind=$2 n
  if [[ $kind == time_limit ]]; then
    n=$(count "$TIME_LIMITS_FILE")
    write_count "$TIME_LIMITS_FILE" $(( n + 1 ))
  else
    n=$(count "$FAILURES_FILE")
    local failures=$(( n + 1 ))
    write_count "$FAILURES_FILE" "$failures"
    if (( failures > MAX_RESTARTS )); then
      echo "spice: not requeueing ($why): $failures failed attempts, MAX_RESTARTS=$MAX_RESTARTS" >&2
      return
    fi
  fi
  echo "spice: requeueing job $SLURM_JOB_ID ($why); it resumes from the last checkpoint" >&2
  scontrol requeue "$SLURM_JOB_ID"
}

# Time limit (sbatch --signal=B:USR1@600): ask the learner to stop after its iteration with a
# checkpoint, give it STOP_GRACE seconds, then requeue.
learner_pid=""
time_limit=0
# shellcheck disable=SC2329  # invoked by the USR1 trap
on_time_limit() {
  time_limit=1
  if [[ -z $learner_pid ]]; then  # still starting the engines: nothing to save
    requeue "time limit" time_limit
    exit 0
  fi
  echo "spice: time limit near: asking the learner to checkpoint and stop (up to ${STOP_GRACE}s)" >&2
  touch "$STOP_FILE"
}
trap on_time_limit USR1

# --- rollout: one service per ENGINE_TP GPUs on every rollout node
srun --nodes=${#ROLLOUT[@]} --ntasks=${#ROLLOUT[@]} --ntasks-per-node=1 -w "$rollout_list" "${overlap[@]}" \
  "${rollout_container[@]}" \
  --output="$LOG_DIR/rollout_%N_%n.out" --kill-on-bad-exit=1 bash slurm/rollout_node.sh &
rollout_pid=$!
trap 'kill "$rollout_pid" 2>/dev/null || true' EXIT

# --- wait until every engine answers /health
deadline=$(( SECONDS + HEALTH_TIMEOUT ))
for k in "${!ROLLOUT_ADDRS[@]}"; do
  if (( k % ENGINE_NODES != 0 )); then continue; fi  # an engine across nodes answers on its leader
  for (( i = 0; i < SPICE_ENGINES_PER_NODE; i++ )); do
    url="http://${ROLLOUT_ADDRS[k]}:$(( ROLLOUT_PORT + k * SPICE_ENGINES_PER_NODE + i ))/health"
    until curl -sf -o /dev/null --max-time 5 "$url"; do
      if ! kill -0 "$rollout_pid" 2>/dev/null; then
        echo "spice: the rollout services exited before $url was healthy; see $LOG_DIR" >&2
        requeue "rollout start failed" failure
        exit 1
      fi
      if (( SECONDS > deadline )); then
        echo "spice: $url not healthy after ${HEALTH_TIMEOUT}s; see $LOG_DIR" >&2
        requeue "rollout health timeout" failure
        exit 1
      fi
      sleep 10
    done
  done
done
echo "spice: $(( ${#ROLLOUT[@]} * SPICE_ENGINES_PER_NODE / ENGINE_NODES )) rollout engine(s) of TP=$ENGINE_TP healthy$( [[ $COLOCATE == 1 ]] && echo ' (asleep until the learner has built)')"

# --- learner: torchrun over the learner nodes; always --resume (a requeued job continues)
# The learner world's own secret, fresh per attempt and exported only now: the rollout step, started
# above, never holds it (its nodes run vLLM's unauthenticated plane: docs/cluster.md, "Security on a shared cluster")
SPICE_WORLD_SECRET=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')
export SPICE_WORLD_SECRET
srun --nodes="$LEARNER_NODES" --ntasks="$LEARNER_NODES" --ntasks-per-node=1 -w "$learner_list" "${overlap[@]}" \
  "${learner_container[@]}" \
  --output="$LOG_DIR/learner_%N_%n.out" --kill-on-bad-exit=1 \
  env CUDA_DEVICE_MAX_CONNECTIONS=1 \
  python -m spice_megatron.torchrun --nnodes="$LEARNER_NODES" --nproc-per-node="$GPUS_PER_NODE" \
  --rdzv-backend=c10d --rdzv-endpoint="$head_ip:$RDZV_PORT" --rdzv-id="$SLURM_JOB_ID" \
  -m spice_megatron.cli train --recipe "$RECIPE" --model "$MODEL_DIR" --output "$OUTPUT_DIR" --resume \
  cluster.nodes=${#NODES[@]} cluster.learner_nodes="$(( COLOCATE == 1 ? 0 : LEARNER_NODES ))" \
  rollout.weight_transfer="$SPICE_WEIGHT_TRANSFER" rollout.model="$ROLLOUT_MODEL_DIR" "$@" &
learner_pid=$!
set +e
wait "$learner_pid"
rc=$?
if (( time_limit )); then  # wait was interrupted by USR1: the learner is finishing its iteration
  for (( waited = 0; waited < STOP_GRACE; waited++ )); do
    kill -0 "$learner_pid" 2>/dev/null || break
    sleep 1
  done
  if kill -0 "$learner_pid" 2>/dev/null; then
    echo "spice: the learner did not stop within ${STOP_GRACE}s; killing it (the previous checkpoint stands)" >&2
    kill -KILL "$learner_pid"
  fi
  wait "$learner_pid"
  rc=$?
fi
set -e
if [[ -f $KILL_SWITCH_FILE ]]; then
  echo "spice: the kill switch stopped the run ($(cat "$KILL_SWITCH_FILE")); not requeueing" >&2
  exit 3
fi
if (( time_limit )); then
  requeue "time limit" time_limit
  exit 0
fi
if [[ -f $STOPPED_FILE ]]; then  # someone touched OUTPUT_DIR/STOP: a stop, not a failure to requeue
  echo "spice: the run stopped on request after a checkpoint; not requeueing (sbatch again to continue)" >&2
  exit 0
fi
case $rc in
  0) echo "spice: run finished; HF checkpoint in $OUTPUT_DIR/hf_final" ;;
  *) echo "spice: learner exited with code $rc" >&2; requeue "learner exit $rc" failure ;;
esac
exit "$rc"
