#!/usr/bin/env bash
# Runs Open MPI's collectives (all-gather, reduce-scatter, all-reduce, all-to-all) and
# meshtrain's fabric backend back to back on this machine
# (2 ranks on one node, 64 MiB by default) and prints their bus bandwidths and ratios,
# then the hierarchical all-reduce against a flat ring on 2 virtual nodes x 2 ranks.
#
#   bash bench/compare-openmpi.sh [SIZE]      (SIZE like 64M; needs a built meshtrain)
set -euo pipefail
cd "$(dirname "$0")/.."
size="${1:-64M}"
meshtrain="${MESHTRAIN:-build/default/cli/meshtrain}"
[ -x "$meshtrain" ] || { echo "build meshtrain first (cmake --workflow --preset default)" >&2; exit 2; }

if ! command -v mpicc >/dev/null || ! command -v mpirun >/dev/null; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "Open MPI is missing: run apt-get install -y libopenmpi-dev openmpi-bin" >&2; exit 2
  fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q libopenmpi-dev openmpi-bin >/dev/null
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mpicc -O2 -o "$work/mpi_collectives" bench/mpi_collectives.c

bytes=$(numfmt --from=iec "$size")
busbw() { awk '$1 ~ /^[0-9]+$/ { last = $6 } END { print last }'; }
mpi_run() { mpirun --allow-run-as-root --oversubscribe -np 2 "$work/mpi_collectives" "$1" "$bytes" "$bytes"; }

echo "2 ranks on one node, $size fp32; busbw in GB/s (nccl-tests factors), all measured now"
echo "meshtrain runs on buffers from Communicator::AllocateBuffer unless 'heap' says otherwise"
printf '%-15s %9s | %9s %7s | %9s %7s | %9s %7s\n' op "Open MPI" "meshtrain" ratio "in place" ratio "heap" ratio
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2fx", a / b }'; }
for op in all_gather reduce_scatter all_reduce; do
  mpi=$(mpi_run "$op" | busbw)
  ours=$("$meshtrain" bench comm --ranks 2 --nodes 1 --op "$op" --sizes "$size" | busbw)
  in_place=$("$meshtrain" bench comm --ranks 2 --nodes 1 --op "$op" --sizes "$size" --in-place | busbw)
  heap=$("$meshtrain" bench comm --ranks 2 --nodes 1 --op "$op" --sizes "$size" --heap-buffers | busbw)
  printf '%-15s %9s | %9s %7s | %9s %7s | %9s %7s\n' "$op" "$mpi" "$ours" "$(ratio "$ours" "$mpi")" \
    "$in_place" "$(ratio "$in_place" "$mpi")" "$heap" "$(ratio "$heap" "$mpi")"
done
# all-to-all has no in-place form: a block of SIZE / 2 to each rank.
mpi=$(mpi_run all_to_all | busbw)
ours=$("$meshtrain" bench comm --ranks 2 --nodes 1 --op all_to_all --sizes "$size" | busbw)
heap=$("$meshtrain" bench comm --ranks 2 --nodes 1 --op all_to_all --sizes "$size" --heap-buffers | busbw)
printf '%-15s %9s | %9s %7s | %9s %7s | %9s %7s\n' all_to_all "$mpi" "$ours" "$(ratio "$ours" "$mpi")" - - \
  "$heap" "$(ratio "$heap" "$mpi")"

echo
echo "all_reduce, 4 ranks on 2 virtual nodes (shm inside, tcp between), $size"
flat=$("$meshtrain" bench comm --ranks 4 --nodes 2 --op all_reduce --sizes "$size" --algorithm ring | busbw)
hier=$("$meshtrain" bench comm --ranks 4 --nodes 2 --op all_reduce --sizes "$size" --algorithm hierarchical | busbw)
printf 'flat ring %s GB/s, hierarchical %s GB/s: %.2fx\n' "$flat" "$hier" \
  "$(awk -v a="$hier" -v b="$flat" 'BEGIN { print a / b }')"
