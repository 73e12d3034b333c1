#!/usr/bin/env bash
# A real Slurm cluster on this machine: N nodes (n1..nN) on localhost, each its own slurmd on its
# own port, one slurmctld, munge; Debian's slurm-wlm 22.05. What a user runs to try the cluster
# path (sbatch slurm/*.sbatch, NeMo-Run) on a laptop, and what the `slurm` tests run against.
#
#   bash tools/env/slurm_box.sh up [N]     # default 3 nodes; prints the SLURM_CONF to export
#   bash tools/env/slurm_box.sh status
#   bash tools/env/slurm_box.sh down       # stops exactly the daemons `up` started (their pid files)
#
# Settings (environment): SLURM_BOX_DIR (state, logs, spool, conf; default /tmp/spice_slurm_box),
# SLURM_BOX_CPUS (CPUs declared per node, default 8: more than the machine has, so that a job can
# ask for a task per "GPU"), SLURM_BOX_GPUS (fake GPUs per node through gres.conf, default 0),
# SLURM_BOX_PORT (slurmctld's port; the slurmds take the next N; default 16817).
#
# What it proves and what it cannot: real sbatch/srun/scontrol/scancel, node allocation, signals
# before the time limit, requeue with SLURM_RESTART_COUNT, multi-node srun steps. Not: GPUs, NCCL,
# pyxis containers, a network fabric, a filesystem shared across hosts (every node is this host).
# Requeue is fast here (cred_expire=10, 2 s scheduler intervals); on a real cluster it takes minutes.
set -euo pipefail

DIR=${SLURM_BOX_DIR:-/tmp/spice_slurm_box}
CPUS=${SLURM_BOX_CPUS:-8}
GPUS=${SLURM_BOX_GPUS:-0}
PORT=${SLURM_BOX_PORT:-16817}
CONF=$DIR/slurm.conf
SUDO=""
if [[ $(id -u) != 0 ]]; then SUDO="sudo"; fi

log() { echo "slurm_box: $*" >&2; }

install_packages() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
     && command -v munged >/dev/null; then
    return
  fi
  log "installing slurmctld slurmd slurm-client munge (apt-get)"
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
    slurmctld slurmd slurm-client munge >/dev/null \
    || { log "apt-get install failed (try: $SUDO apt-get update)"; exit 1; }
}

start_munge() {
  if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    return
  fi
  if [[ ! -s /etc/munge/munge.key ]]; then
    $SUDO mkdir -p /etc/munge
    if command -v mungekey >/dev/null; then
      $SUDO mungekey -c -f -k /etc/munge/munge.key
    else
      $SUDO dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
    fi
  fi
  $SUDO chown munge: /etc/munge/munge.key 2>/dev/null || true
  $SUDO chmod 400 /etc/munge/munge.key
  $SUDO mkdir -p /run/munge /var/log/munge /var/lib/munge
  $SUDO chown munge: /run/munge /var/log/munge /var/lib/munge 2>/dev/null || true
  if [[ $(id -u) == 0 ]]; then
    munged --force 2>/dev/null || runuser -u munge -- munged
  else
    $SUDO runuser -u munge -- munged
  fi
  for _ in $(seq 50); do
    if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then return; fi
    sleep 0.1
  done
  log "munge does not answer (munge -n | unmunge)"
  exit 1
}

write_conf() {
  local n=$1 mem
  mem=$(awk '/MemTotal/ {print int($2 / 1024 / 2)}' /proc/meminfo)  # MB: half the machine, declared per node
  mkdir -p "$DIR"/{state,log,run,spool} "$DIR"/fakegpu
  {
    echo "# written by tools/env/slurm_box.sh: $n nodes on this host"
    echo "ClusterName=spicebox"
    echo "SlurmctldHost=localhost"
    echo "SlurmctldPort=$PORT"
    echo "SlurmUser=$(id -un)"
    echo "AuthType=auth/munge"
    echo "AuthInfo=cred_expire=10"
    echo "StateSaveLocation=$DIR/state"
    echo "SlurmdSpoolDir=$DIR/spool/%n"
    echo "SlurmctldPidFile=$DIR/run/slurmctld.pid"
    echo "SlurmdPidFile=$DIR/run/slurmd.%n.pid"
    echo "SlurmctldLogFile=$DIR/log/slurmctld.log"
    echo "SlurmdLogFile=$DIR/log/slurmd.%n.log"
    echo "ProctrackType=proctrack/linuxproc"
    echo "TaskPlugin=task/none"
    echo "SelectType=select/cons_tres"
    echo "SelectTypeParameters=CR_Core"
    echo "SchedulerParameters=sched_interval=2,bf_interval=2"
    echo "ReturnToService=2"
    echo "MpiDefault=none"
    echo "MailProg=/bin/true"
    echo "JobAcctGatherType=jobacct_gather/none"
    echo "AccountingStorageType=accounting_storage/none"
    echo "MinJobAge=300"
    echo "KillWait=5"
    echo "InactiveLimit=0"
    echo "SlurmdParameters=config_overrides"
    if (( GPUS > 0 )); then echo "GresTypes=gpu"; fi
    for i in $(seq "$n"); do
      mkdir -p "$DIR/spool/n$i"
      echo "NodeName=n$i NodeHostname=localhost NodeAddr=127.0.0.1 Port=$((PORT + i)) CPUs=$CPUS RealMemory=$mem" \
           "$( (( GPUS > 0 )) && echo "Gres=gpu:$GPUS")"
    done
    echo "PartitionName=box Nodes=ALL Default=YES MaxTime=INFINITE State=UP"
  } >"$CONF"
  if (( GPUS > 0 )); then
    for g in $(seq 0 $((GPUS - 1))); do : >"$DIR/fakegpu/gpu$g"; done
    # plain files stand in for /dev/nvidia*: with task/none nothing opens them
    echo "NodeName=n[1-$n] Name=gpu File=$DIR/fakegpu/gpu[0-$((GPUS - 1))] AutoDetect=off" >"$DIR/gres.conf"
  else
    rm -f "$DIR/gres.conf"
  fi
}

resolve_names() {
  local n=$1 missing=()
  for i in $(seq "$n"); do getent hosts "n$i" >/dev/null || missing+=("n$i"); done
  if (( ${#missing[@]} )); then
    # appended, not edited in place: in a container /etc/hosts is a bind mount
    echo "127.0.0.1 ${missing[*]}  # tools/env/slurm_box.sh" | $SUDO tee -a /etc/hosts >/dev/null \
      || log "cannot make ${missing[*]} resolve (no write access to /etc/hosts); the scripts use Slurm's node addresses"
  fi
}

alive() { [[ -f $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

nodes_in_conf() { grep -c '^NodeName=' "$CONF" 2>/dev/null || echo 0; }

up() {
  local n=${1:-3}
  install_packages
  start_munge
  if alive "$DIR/run/slurmctld.pid" && [[ $(nodes_in_conf) == "$n" ]]; then
    log "already up ($n nodes)"
  else
    down quiet
    rm -rf "$DIR/state"
    write_conf "$n"
    resolve_names "$n"
    SLURM_CONF=$CONF slurmctld -f "$CONF"
    for i in $(seq "$n"); do SLURM_CONF=$CONF slurmd -f "$CONF" -N "n$i"; done
  fi
  export SLURM_CONF=$CONF
  for _ in $(seq 150); do
    if [[ $(sinfo -h -t idle -o %D 2>/dev/null | awk '{s += $1} END {print s + 0}') == "$n" ]]; then
      log "$n node(s) idle"
      echo "export SLURM_CONF=$CONF"
      return
    fi
    sleep 0.2
  done
  log "the nodes are not idle after 30 s:"
  sinfo -N -l >&2 || true
  tail -n 20 "$DIR"/log/*.log >&2 || true
  exit 1
}

down() {
  local stopped=0
  for pidfile in "$DIR"/run/slurmd.*.pid "$DIR"/run/slurmctld.pid; do
    [[ -f $pidfile ]] || continue
    if alive "$pidfile"; then
      kill "$(cat "$pidfile")" 2>/dev/null || true
      stopped=$((stopped + 1))
    fi
    rm -f "$pidfile"
  done
  # slurmstepd and job processes of running jobs end with their slurmd; give them a moment
  sleep 1
  [[ ${1:-} == quiet ]] || log "stopped $stopped daemon(s)"
}

status() {
  if ! alive "$DIR/run/slurmctld.pid"; then
    echo "slurm_box: down"
    return 1
  fi
  echo "slurm_box: up, SLURM_CONF=$CONF"
  SLURM_CONF=$CONF sinfo -N -o "%N %T %c %G"
  SLURM_CONF=$CONF squeue
}

case ${1:-} in
  up) up "${2:-3}" ;;
  down) down ;;
  status) status ;;
  *) echo "usage: bash tools/env/slurm_box.sh up [N] | status | down" >&2; exit 2 ;;
esac
