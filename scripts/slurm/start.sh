#!/usr/bin/env bash
# Start a Slurm cluster on this machine: munged, slurmctld and slurmd, as root, with
# everything (config, state, logs, pid files, munge socket) under $CQK_SLURM_DIR
# (default /tmp/cqk-slurm). Prints the line to export on stdout:
#
#   eval "$(bash scripts/slurm/start.sh)"     # export SLURM_CONF=/tmp/cqk-slurm/slurm.conf
#   sbatch --wrap hostname; squeue; bash scripts/slurm/stop.sh
#
# Daemons already running from this folder (by their pid files) are kept, so running it
# twice is harmless. The last line on stderr says "started" or "already running".
# Settings: CQK_SLURM_CPUS (CPUs each node declares, default max(nproc, 4)),
# CQK_SLURM_CTLD_PORT / CQK_SLURM_SLURMD_PORT (default 6817 / 6818), CQK_SLURM_NODES
# (default 1: one node, "$(hostname -s)" on 127.0.0.1; 2 or more: nodes node1..nodeN, each
# in a network namespace with its own hostname and address, see nodes.sh; slurmctld then
# listens on the namespaces' bridge and the client tools reach it there).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
DIR=${CQK_SLURM_DIR:-/tmp/cqk-slurm}
CONF=$DIR/slurm.conf
NODES=${CQK_SLURM_NODES:-1}
CTLD_PORT=${CQK_SLURM_CTLD_PORT:-6817}
# shellcheck source=scripts/slurm/nodes.sh
source "$HERE/nodes.sh"

tools=(munged slurmctld slurmd sbatch scontrol sinfo)
[ "$NODES" -gt 1 ] && tools+=(ip unshare)
for tool in "${tools[@]}"; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    echo "error: '$tool' is not installed; run: bash scripts/slurm/install.sh (as root)" >&2
    exit 1
  fi
done
if [ "$(id -u)" != 0 ]; then
  echo "error: start.sh runs slurmd as root (it starts jobs as their users); run it as root" >&2
  exit 1
fi

alive() {  # alive PIDFILE NAME: the pid file names a live process called NAME
  [ -s "$1" ] || return 1
  local pid
  pid=$(cat "$1")
  # A zombie (state Z) is dead: where nothing reaps orphans, killed daemons linger as such.
  [ "$(ps -o comm= -p "$pid" 2>/dev/null)" = "$2" ] &&
    [[ "$(ps -o stat= -p "$pid" 2>/dev/null)" != Z* ]]
}

started_or_fail() {  # started_or_fail PIDFILE NAME LOG: the daemon came up, else say why
  for _ in $(seq 1 50); do
    alive "$1" "$2" && return 0
    sleep 0.1
  done
  echo "error: $2 did not start; the end of $3:" >&2
  tail -n 20 "$3" >&2 || true
  exit 1
}

mkdir -p "$DIR"/{munge,state,spool,run,log}
chmod 700 "$DIR/munge"
if [ ! -s "$DIR/munge/munge.key" ]; then
  (umask 077 && head -c 1024 /dev/urandom >"$DIR/munge/munge.key.tmp")
  mv "$DIR/munge/munge.key.tmp" "$DIR/munge/munge.key"
fi
chmod 400 "$DIR/munge/munge.key"

host=$(hostname -s)
cpus=${CQK_SLURM_CPUS:-$(nproc)}
[ "$cpus" -ge 4 ] || cpus=4
memory_mb=$(awk '/MemTotal/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)
if [ "$NODES" -gt 1 ]; then
  setup_nodes "$DIR" "$NODES" "$CTLD_PORT"
  subnet=$(subnet_of "$CTLD_PORT")
  # A short SlurmdTimeout: a node that vanishes is DOWN (its job requeued) in seconds.
  ctld_addr=$subnet.1 slurmd_pid=slurmd-%n.pid slurmd_log=slurmd-%n.log slurmd_timeout=10
  nodes=($(node_names "$NODES"))
else
  ctld_addr=127.0.0.1 slurmd_pid=slurmd.pid slurmd_log=slurmd.log slurmd_timeout=60
  nodes=("$host")
fi
{
  sed -e "s|@DIR@|$DIR|g" -e "s|@HOST@|$host|g" -e "s|@CTLD_ADDR@|$ctld_addr|g" \
    -e "s|@SLURMD_PID@|$slurmd_pid|g" -e "s|@SLURMD_LOG@|$slurmd_log|g" \
    -e "s|@SLURMD_TIMEOUT@|$slurmd_timeout|g" \
    -e "s|@CTLD_PORT@|$CTLD_PORT|g" \
    -e "s|@SLURMD_PORT@|${CQK_SLURM_SLURMD_PORT:-6818}|g" \
    "$HERE/slurm.conf.in"
  if [ "$NODES" -gt 1 ]; then
    for i in $(seq 1 "$NODES"); do
      echo "NodeName=node$i NodeHostname=node$i NodeAddr=$subnet.$((10 + i)) CPUs=$cpus" \
        "RealMemory=$((memory_mb / NODES)) State=UNKNOWN"
    done
    echo "PartitionName=local Nodes=node[1-$NODES] Default=YES MaxTime=INFINITE State=UP" \
      "OverSubscribe=NO"
  else
    echo "NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$memory_mb State=UNKNOWN"
    echo "PartitionName=local Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO"
  fi
} >"$CONF.tmp"
mv "$CONF.tmp" "$CONF"
export SLURM_CONF=$CONF

started=()
if ! alive "$DIR/run/munged.pid" munged; then
  rm -f "$DIR/run/munged.pid"
  munged --force --key-file="$DIR/munge/munge.key" --socket="$DIR/munge/munge.socket" \
    --pid-file="$DIR/run/munged.pid" --log-file="$DIR/log/munged.log" \
    --seed-file="$DIR/munge/munged.seed"
  started_or_fail "$DIR/run/munged.pid" munged "$DIR/log/munged.log"
  started+=(munged)
fi
if ! alive "$DIR/run/slurmctld.pid" slurmctld; then
  rm -f "$DIR/run/slurmctld.pid"
  slurmctld -f "$CONF"
  started_or_fail "$DIR/run/slurmctld.pid" slurmctld "$DIR/log/slurmctld.log"
  started+=(slurmctld)
fi
for node in "${nodes[@]}"; do
  pidfile=$DIR/run/${slurmd_pid/\%n/$node}
  if ! alive "$pidfile" slurmd; then
    rm -f "$pidfile"
    if [ "$NODES" -gt 1 ]; then
      in_node "$DIR" "$CTLD_PORT" "$node" slurmd -f "$CONF" -N "$node"
    else
      slurmd -f "$CONF"
    fi
    started_or_fail "$pidfile" slurmd "$DIR/log/${slurmd_log/\%n/$node}"
    started+=("slurmd($node)")
  fi
done

# Wait for the nodes to register (a second or two), then make sure they take jobs: a node
# left DOWN or DRAINED by an earlier run is resumed.
for node in "${nodes[@]}"; do
  deadline=$((SECONDS + 30))
  state=""
  while [ "$SECONDS" -lt "$deadline" ]; do
    state=$(timeout 5 sinfo -h -n "$node" -o %T 2>/dev/null | head -1 || true)
    case "$state" in
      idle*|mixed*|allocated*|completing*) break ;;
      down*|drain*|fail*) scontrol update NodeName="$node" State=RESUME >/dev/null 2>&1 || true ;;
    esac
    sleep 0.5
  done
  case "$state" in
    idle*|mixed*|allocated*|completing*) ;;
    *)
      echo "error: node $node is '$state' after 30 s; see $DIR/log/slurmctld.log and" \
        "$DIR/log/${slurmd_log/\%n/$node}" >&2
      exit 1 ;;
  esac
done

echo "export SLURM_CONF=$CONF"
if [ ${#started[@]} -gt 0 ]; then
  echo "slurm: started ${started[*]} (nodes ${nodes[*]}, $cpus CPUs each, state under $DIR)" >&2
else
  echo "slurm: already running (state under $DIR)" >&2
fi
