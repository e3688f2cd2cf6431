#!/usr/bin/env bash
# The network testbed (scripts/netbed.sh): ranks of two virtual nodes in their own network
# namespaces, joined through links shaped to 1 Gbit/s. An all-reduce among them runs to
# the end, and its bandwidth stays under the link's, so the traffic between nodes really
# crossed the shaped links (loopback would be two orders faster). `down` leaves no
# namespace behind, and a launch on a testbed that is not up names what is missing; on
# 50 Mbit/s links the planner picks pipeline stages, measured at least 1.5x the best
# layout without them.
# Usage: netbed_test.sh BUILD_DIR
set -euo pipefail
build=$1
src=$(cd "$(dirname "$0")/../.." && pwd)
name=mtnb$$
trap 'bash "$src/scripts/netbed.sh" down "$name"' EXIT
fail() { echo "FAIL (netbed): $*" >&2; exit 1; }

if ! ip netns add "$name-probe" 2>/dev/null; then
  echo "skipped: no network namespaces (ip netns add needs root)"
  exit 77
fi
ip netns del "$name-probe"

bash "$src/scripts/netbed.sh" up "$name" 2 1gbit
out=$("$build/cli/meshtrain" bench comm --ranks 4 --nodes 2 --op all_reduce --sizes 4M --algorithm ring \
  --netbed "$name" 2>&1) || fail "the all-reduce over the testbed failed: $out"
echo "$out"
busbw=$(echo "$out" | awk '$1 == 4194304 { print $6 }')
[ -n "$busbw" ] || fail "no 4 MiB row"
# A ring all-reduce over 2 nodes sends 1.5x the buffer out of each node; the link carries
# 0.125 GB/s, so the bus bandwidth stays under 0.125 x 1.5 / (2 x 3/4) = 0.125 GB/s.
awk "BEGIN { exit !($busbw > 0 && $busbw < 0.125) }" ||
  fail "busbw $busbw GB/s: the traffic did not cross the 1 Gbit/s links"
bash "$src/scripts/netbed.sh" down "$name"
[ -z "$(ip netns list | grep "^$name-" || true)" ] || fail "netbed.sh down left namespaces"

# Two racks of two nodes behind 50 Mbit/s uplinks: the scheduler's order keeps each shard
# group (2 nodes) in one rack, name order splits both across racks; both train.
bash "$src/scripts/netbed.sh" up "$name" 4 1gbit 2 50mbit
out=$("$build/cli/meshtrain" bench train --model gpt2-tiny --ranks 4 --nodes 4 --shard 2 --netbed "$name" --racks 2 \
  --compare order --seq 32 --batch 2 --steps 2 2>&1) || fail "the racked comparison failed: $out"
echo "$out" | grep -v '^\[20'
[[ $out == *"topology-aware order: node ranks on testbed nodes 0 (rack 0) 2 (rack 0) 1 (rack 1) 3 (rack 1)"* ]] ||
  fail "the scheduler did not keep shard groups in a rack"
[[ $out == *"name order: node ranks on testbed nodes 0 (rack 0) 1 (rack 1) 2 (rack 0) 3 (rack 1)"* ]] || fail "no name order run"
[[ $out =~ "topology-aware order / name order: tokens/s "[0-9.]+ ]] || fail "no ratio"
bash "$src/scripts/netbed.sh" down "$name"
[ -z "$(ip netns list | grep "^$name-" || true)" ] || fail "netbed.sh down left the racked namespaces"
out=$("$build/cli/meshtrain" bench comm --ranks 4 --nodes 2 --netbed "$name" 2>&1) && fail "a launch on a testbed that is down ran"
[[ $out == *"testbed $name has no node 0 (no network namespace $name-0; run scripts/netbed.sh up $name 2 RATE)"* ]] ||
  fail "the error does not say what is missing: $out"
# Two nodes of two ranks joined at 50 Mbit/s: on calibrated links the planner puts a stage
# on each node for gpt2-tiny, and measured, that pick is at least 1.5x the best layout
# without stages (the two fastest modelled layouts of each pipeline degree run).
bash "$src/scripts/netbed.sh" up "$name" 2 50mbit
links=$(mktemp)
trap 'rm -f "$links"; bash "$src/scripts/netbed.sh" down "$name"' EXIT
"$build/cli/meshtrain" bench comm --ranks 4 --nodes 2 --netbed "$name" --calibrate "$links" >/dev/null 2>&1 ||
  fail "calibrating the 50 Mbit/s links failed"
out=$("$build/cli/meshtrain" bench plan --measure --netbed "$name" --links "$links" --memory-mib 48 --global-batch 2048 \
  --measure-top 2 2>&1) || fail "bench plan --measure failed: $out"
echo "$out" | grep -v '^\[20'
[[ $out =~ "  1. P=2 " ]] || fail "the planner did not pick two stages on the 50 Mbit/s links"
ratio=$(echo "$out" | sed -n 's/.*pick \/ best without stages \([0-9.]*\)x.*/\1/p')
[ -n "$ratio" ] || fail "no comparison with the best layout without stages"
awk "BEGIN { exit !($ratio >= 1.5) }" || fail "two stages measured only ${ratio}x the best layout without them"
bash "$src/scripts/netbed.sh" down "$name"
echo "ok: netbed"
