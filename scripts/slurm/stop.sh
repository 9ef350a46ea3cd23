#!/usr/bin/env bash
# Stop the cluster of start.sh: cancel its jobs, then end slurmd, slurmctld and munged by
# the pids in their pid files under $CQK_SLURM_DIR (default /tmp/cqk-slurm), and nothing
# else; a multi-node cluster's network namespaces (what still runs in them, and the
# bridge and links that start.sh listed in netns.list) are deleted last. State and logs
# stay for inspection; start.sh reuses them.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
DIR=${CQK_SLURM_DIR:-/tmp/cqk-slurm}
export SLURM_CONF=$DIR/slurm.conf
# shellcheck source=scripts/slurm/nodes.sh
source "$HERE/nodes.sh"

pid_of() {  # pid_of PIDFILE NAME: the pid, if it is a live process called NAME
  [ -s "$1" ] || return 1
  local pid
  pid=$(cat "$1")
  running "$pid" && [ "$(ps -o comm= -p "$pid" 2>/dev/null)" = "$2" ] && echo "$pid"
}

running() {  # running PID: alive and not a zombie (nothing may reap orphans here)
  local stat
  stat=$(ps -o stat= -p "$1" 2>/dev/null) || return 1
  [[ "$stat" != Z* ]]
}

if pid_of "$DIR/run/slurmctld.pid" slurmctld >/dev/null && [ -f "$SLURM_CONF" ]; then
  jobs=$(timeout 10 squeue -h -o %A 2>/dev/null || true)  # this private cluster's jobs only
  if [ -n "$jobs" ]; then
    # shellcheck disable=SC2086
    scancel $jobs 2>/dev/null || true
    for _ in $(seq 1 40); do
      [ -z "$(timeout 10 squeue -h -o %A 2>/dev/null || true)" ] && break
      sleep 0.5
    done
  fi
fi

stop_daemon() {  # stop_daemon PIDFILE NAME
  local pid
  pid=$(pid_of "$1" "$2") || return 0
  kill "$pid"
  for _ in $(seq 1 40); do
    running "$pid" || break
    sleep 0.25
  done
  if running "$pid"; then
    kill -9 "$pid"
  fi
  echo "slurm: stopped $2 ($pid, $(basename "$1" .pid))" >&2
}

for pidfile in "$DIR"/run/slurmd*.pid; do  # slurmd.pid, or slurmd-<node>.pid per node
  [ -e "$pidfile" ] && stop_daemon "$pidfile" slurmd
done
stop_daemon "$DIR/run/slurmctld.pid" slurmctld
stop_daemon "$DIR/run/munged.pid" munged
teardown_nodes "$DIR"
