# Nodes of the multi-node test cluster (sourced by start.sh and stop.sh; not run alone).
#
# Each node is a network namespace with one veth into a bridge in the root namespace:
#
#   root namespace: bridge cqkbr<PORT>, 198.18.<S>.1/24 (slurmctld and the client tools)
#   node1: netns cqk<PORT>-node1, eth0 198.18.<S>.11, hostname node1 (its own UTS namespace)
#   node2: netns cqk<PORT>-node2, eth0 198.18.<S>.12, hostname node2   ...
#
# 198.18.0.0/15 is reserved for network tests (RFC 2544), so it collides with no real
# network; <S> = the controller port mod 256, so instances with their own ports get their
# own subnet; nothing is routed out of it (no default route, no NAT, no forwarding). Each
# node's slurmd runs in its namespace with a private mount namespace in which
# $DIR/hosts is bind-mounted over /etc/hosts (every node's name and address), so jobs see
# their node's hostname and resolve the others; the filesystem is otherwise shared, as a
# cluster's shared filesystem would be. Every name created is listed in $DIR/netns.list,
# which stop.sh reads to delete exactly those.

# shellcheck shell=bash

node_names() {  # node_names N: node1 ... nodeN
  local i
  for i in $(seq 1 "$1"); do echo "node$i"; done
}

subnet_of() {  # subnet_of CTLD_PORT: the first three octets of the test subnet
  echo "198.18.$(($1 % 256))"
}

setup_nodes() {  # setup_nodes DIR N CTLD_PORT
  local dir=$1 n=$2 port=$3 subnet bridge ns veth i
  subnet=$(subnet_of "$port")
  bridge="cqkbr$port"
  : >"$dir/netns.list.tmp"
  if ! ip link show "$bridge" >/dev/null 2>&1; then
    ip link add "$bridge" type bridge
    echo "link $bridge" >>"$dir/netns.list.tmp"
  fi
  ip addr replace "$subnet.1/24" dev "$bridge"
  ip link set "$bridge" up
  {
    echo "127.0.0.1 localhost"
    echo "$subnet.1 $(hostname -s)"
    for i in $(seq 1 "$n"); do echo "$subnet.$((10 + i)) node$i"; done
  } >"$dir/hosts"
  for i in $(seq 1 "$n"); do
    ns="cqk$port-node$i"
    veth="cqk${port}n$i"
    if ! ip netns list | grep -qw "$ns"; then
      ip netns add "$ns"
      echo "netns $ns" >>"$dir/netns.list.tmp"
    fi
    if ! ip link show "$veth" >/dev/null 2>&1; then
      ip link add "$veth" type veth peer name eth0 netns "$ns"
      echo "link $veth" >>"$dir/netns.list.tmp"
    fi
    ip link set "$veth" master "$bridge"
    ip link set "$veth" up
    ip netns exec "$ns" ip addr replace "$subnet.$((10 + i))/24" dev eth0
    ip netns exec "$ns" ip link set eth0 up
    ip netns exec "$ns" ip link set lo up
  done
  # Keep what an earlier start listed (a rerun finds the links already there).
  cat "$dir/netns.list.tmp" >>"$dir/netns.list"
  sort -u "$dir/netns.list" -o "$dir/netns.list"
  rm -f "$dir/netns.list.tmp"
}

in_node() {  # in_node DIR CTLD_PORT NODE COMMAND...: run COMMAND as if on NODE
  local dir=$1 port=$2 node=$3
  shift 3
  mkdir -p "$dir/spool/slurmd-$node"
  # nsenter, not "ip netns exec": that one remounts /sys, hiding the cgroup filesystem
  # that slurmd's cgroup plugin looks for.
  nsenter --net="/run/netns/cqk$port-$node" unshare --uts --mount --propagation private \
    sh -c 'hostname "$0" && mount --bind "$1" /etc/hosts && shift && exec "$@"' \
    "$node" "$dir/hosts" "$@"
}

teardown_nodes() {  # teardown_nodes DIR: end what runs in the namespaces, delete them
  local dir=$1 kind name pid
  [ -f "$dir/netns.list" ] || return 0
  while read -r kind name; do
    if [ "$kind" = netns ]; then
      for pid in $(ip netns pids "$name" 2>/dev/null); do  # jobs' tasks and slurmstepd
        kill -9 "$pid" 2>/dev/null || true
      done
      ip netns del "$name" 2>/dev/null || true
      echo "slurm: deleted network namespace $name" >&2
    fi
  done <"$dir/netns.list"
  while read -r kind name; do
    if [ "$kind" = link ]; then
      ip link del "$name" 2>/dev/null || true
    fi
  done <"$dir/netns.list"
  rm -f "$dir/netns.list"
}
