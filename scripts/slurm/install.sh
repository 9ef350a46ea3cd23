#!/usr/bin/env bash
# Install Slurm (slurmctld, slurmd, client tools) and munge from Debian's packages, for the
# test clusters of scripts/slurm/start.sh, and iproute2/util-linux (ip, unshare, nsenter)
# for its multi-node mode. Idempotent: does nothing when they are there. Needs root
# (apt-get). The packages' own services are not started (no systemd); start.sh runs
# private daemons instead.
set -euo pipefail
missing=()
for tool in munged slurmctld slurmd sbatch ip unshare nsenter; do
  command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "slurm: already installed ($(sbatch --version 2>/dev/null || echo unknown version))"
  exit 0
fi
echo "slurm: installing (missing: ${missing[*]})"
export DEBIAN_FRONTEND=noninteractive
apt-get update -q >/dev/null
apt-get install -y -q --no-install-recommends slurmctld slurmd slurm-client munge \
  iproute2 util-linux >/dev/null
echo "slurm: installed $(sbatch --version)"
