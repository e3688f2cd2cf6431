#!/usr/bin/env bash
# A two-tier network on this machine: virtual nodes in their own network namespaces,
# joined by veth pairs to a bridge in a switch namespace, with each node's link shaped by
# a tc token-bucket filter. Ranks inside a node talk over shared memory; ranks of
# different nodes over TCP through the shaped links, so the two tiers really differ.
#
#   netbed.sh up NAME NODES RATE [RACKS UPLINK]   e.g. netbed.sh up mtbed 2 2gbit
#   netbed.sh down NAME
#
# With RACKS, node i sits in rack i % RACKS: each rack has its own bridge, and the racks
# meet at a core bridge through uplinks shaped to UPLINK in both directions, so nodes of
# one rack talk at RATE and nodes of different racks at most at UPLINK (a third tier).
# Node i is namespace NAME-i with interface eth0 at 198.18.0.(i+1)/24 (RFC 2544's range
# for network benchmarks) and loopback; the switch is NAME-sw. Traffic goes only to those
# addresses and to loopback. This kernel has no netem, so links get a rate, not a delay.
# Needs root; `down` removes everything `up` made.
set -euo pipefail
command=${1:-}
name=${2:-}
[ -n "$command" ] && [ -n "$name" ] ||
  { echo "usage: netbed.sh up NAME NODES RATE [RACKS UPLINK] | netbed.sh down NAME" >&2; exit 1; }
case $command in
  up)
    nodes=${3:?the number of nodes} rate=${4:?the link rate, like 2gbit} racks=${5:-1} uplink=${6:-}
    [ "$nodes" -ge 1 ] && [ "$nodes" -le 200 ] || { echo "netbed: NODES must be in [1, 200]" >&2; exit 1; }
    [ "$racks" -ge 1 ] && [ "$racks" -le "$nodes" ] || { echo "netbed: RACKS must be in [1, NODES]" >&2; exit 1; }
    [ "$racks" -eq 1 ] || [ -n "$uplink" ] || { echo "netbed: RACKS needs an UPLINK rate" >&2; exit 1; }
    ip netns add "$name-sw"
    for ((r = 0; r < racks; r++)); do
      ip -n "$name-sw" link add "br$r" type bridge
      ip -n "$name-sw" link set "br$r" up
    done
    if [ "$racks" -gt 1 ]; then
      ip -n "$name-sw" link add core type bridge
      ip -n "$name-sw" link set core up
      for ((r = 0; r < racks; r++)); do
        ip -n "$name-sw" link add "up$r" type veth peer name "dn$r"
        ip -n "$name-sw" link set "up$r" master "br$r"
        ip -n "$name-sw" link set "dn$r" master core
        ip -n "$name-sw" link set "up$r" up
        ip -n "$name-sw" link set "dn$r" up
        # The rack's uplink, both ways: out of the rack (up) and into it (dn).
        ip netns exec "$name-sw" tc qdisc add dev "up$r" root tbf rate "$uplink" burst 256kb latency 50ms
        ip netns exec "$name-sw" tc qdisc add dev "dn$r" root tbf rate "$uplink" burst 256kb latency 50ms
      done
    fi
    for ((i = 0; i < nodes; i++)); do
      ns=$name-$i
      ip netns add "$ns"
      ip link add "$name-n$i" type veth peer name "$name-s$i"
      ip link set "$name-n$i" netns "$ns"
      ip link set "$name-s$i" netns "$name-sw"
      ip -n "$ns" link set "$name-n$i" name eth0
      ip -n "$ns" addr add "198.18.0.$((i + 1))/24" dev eth0
      ip -n "$ns" link set lo up
      ip -n "$ns" link set eth0 up
      ip -n "$name-sw" link set "$name-s$i" master "br$((i % racks))"
      ip -n "$name-sw" link set "$name-s$i" up
      # Each node's egress at the link rate: both directions of every inter-node path.
      ip netns exec "$ns" tc qdisc add dev eth0 root tbf rate "$rate" burst 256kb latency 50ms
    done
    ;;
  down)
    for ns in $(ip netns list | awk '{print $1}' | grep -E "^$name-(sw|[0-9]+)$" || true); do ip netns del "$ns"; done
    ;;
  *)
    echo "netbed: unknown command $command" >&2
    exit 1
    ;;
esac
