#!/usr/bin/env bash
# Runs Open MPI's collectives (all-gather, reduce-scatter, all-reduce, all-to-all, and
# all-to-all with uneven blocks as a mixture of experts sends them) and meshtrain's
# fabric backend back to back on this machine (2 ranks on one node, 64 MiB by default)
# and prints their bus bandwidths and ratios, then the hierarchical all-reduce against a
# flat ring on 2 virtual nodes x 2 ranks.
#
#   bash bench/compare-openmpi.sh [SIZE [OP...]]   (SIZE like 64M; needs a built meshtrain)
#
# OPs (default: all) pick rows: all_gather reduce_scatter all_reduce all_to_all
# all_to_all_v hierarchical.
set -euo pipefail
cd "$(dirname "$0")/.."
size="${1:-64M}"
ops=" ${*:2} "
[ "$ops" = "  " ] && ops=" all_gather reduce_scatter all_reduce all_to_all all_to_all_v hierarchical "
wanted() { [[ "$ops" == *" $1 "* ]]; }
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
# MPI_Alltoallv with the uneven pattern of `meshtrain bench comm --op all_to_all_v`
# (cli/bench_comm_command.cc, UnevenCount): rank r sends
# rank p the share (p + r + 1) / (sum over q of (q + r + 1)) of its SIZE, rounded down, the
# last rank the rest; blocks in peer order; timed as bench/mpi_collectives.c times.
cat > "$work/mpi_alltoallv.c" <<'EOF'
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static size_t uneven_count(int from, int to, int n, size_t total) {
  size_t shares = (size_t)n * (n + 1) / 2 + (size_t)n * from, before = 0;
  for (int q = 0; q < to; ++q) before += total * (size_t)(q + from + 1) / shares;
  return to == n - 1 ? total - before : total * (size_t)(to + from + 1) / shares;
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int n, rank;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  size_t total = strtoull(argv[1], NULL, 10) / 4 / n * n, bytes = total * 4;
  int *send_counts = malloc(n * sizeof(int)), *send_displs = malloc(n * sizeof(int));
  int *recv_counts = malloc(n * sizeof(int)), *recv_displs = malloc(n * sizeof(int));
  size_t sent = 0, received = 0;
  for (int p = 0; p < n; ++p) {
    send_counts[p] = (int)uneven_count(rank, p, n, total), send_displs[p] = (int)sent, sent += send_counts[p];
    recv_counts[p] = (int)uneven_count(p, rank, n, total), recv_displs[p] = (int)received, received += recv_counts[p];
  }
  float *send = malloc(bytes), *recv = malloc(received * 4);
  memset(send, 1, bytes);
  memset(recv, 0, received * 4);
  size_t iterations = ((size_t)1 << 30) / bytes;
  if (iterations < 5) iterations = 5;
  if (iterations > 200) iterations = 200;
#define ISSUE() MPI_Alltoallv(send, send_counts, send_displs, MPI_FLOAT, recv, recv_counts, recv_displs, MPI_FLOAT, MPI_COMM_WORLD)
  for (int i = 0; i < 3; ++i) ISSUE();
  MPI_Barrier(MPI_COMM_WORLD);
  double start = MPI_Wtime();
  for (size_t i = 0; i < iterations; ++i) ISSUE();
  double seconds = (MPI_Wtime() - start) / iterations, slowest;
  MPI_Allreduce(&seconds, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  if (rank == 0) {
    double algbw = bytes / slowest / 1e9;
    printf("# MPI all_to_all_v, %d ranks, fp32, uneven\n", n);
    printf("%12zu %12zu %8zu %12.1f %12.3f %12.3f\n", bytes, total, iterations, slowest * 1e6, algbw,
           algbw * (n - 1) / n);
  }
  MPI_Finalize();
  return 0;
}
EOF
mpicc -O2 -o "$work/mpi_alltoallv" "$work/mpi_alltoallv.c"

bytes=$(numfmt --from=iec "$size")
busbw() { awk '$1 ~ /^[0-9]+$/ { last = $6 } END { print last }'; }
mpi_run() { mpirun --allow-run-as-root --oversubscribe -np 2 "$work/mpi_collectives" "$1" "$bytes" "$bytes"; }

echo "2 ranks on one node, $size fp32; busbw in GB/s (nccl-tests factors), all measured now"
echo "meshtrain runs on buffers from Communicator::AllocateBuffer unless 'heap' says otherwise"
printf '%-15s %9s | %9s %7s | %9s %7s | %9s %7s\n' op "Open MPI" "meshtrain" ratio "in place" ratio "heap" ratio
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2fx", a / b }'; }
for op in all_gather reduce_scatter all_reduce; do
  wanted "$op" || continue
  mpi=$(mpi_run "$op" | busbw)
  ours=$("$meshtrain" bench comm --ranks 2 --nodes 1 --op "$op" --sizes "$size" | busbw)
  in_place=$("$meshtrain" bench comm --ranks 2 --nodes 1 --op "$op" --sizes "$size" --in-place | busbw)
  heap=$("$meshtrain" bench comm --ranks 2 --nodes 1 --op "$op" --sizes "$size" --heap-buffers | busbw)
  printf '%-15s %9s | %9s %7s | %9s %7s | %9s %7s\n' "$op" "$mpi" "$ours" "$(ratio "$ours" "$mpi")" \
    "$in_place" "$(ratio "$in_place" "$mpi")" "$heap" "$(ratio "$heap" "$mpi")"
done
# all-to-all has no in-place form: a block of SIZE / 2 to each rank.
if wanted all_to_all; then
  mpi=$(mpi_run all_to_all | busbw)
  ours=$("$meshtrain" bench comm --ranks 2 --nodes 1 --op all_to_all --sizes "$size" | busbw)
  heap=$("$meshtrain" bench comm --ranks 2 --nodes 1 --op all_to_all --sizes "$size" --heap-buffers | busbw)
  printf '%-15s %9s | %9s %7s | %9s %7s | %9s %7s\n' all_to_all "$mpi" "$ours" "$(ratio "$ours" "$mpi")" - - \
    "$heap" "$(ratio "$heap" "$mpi")"
fi
# Uneven blocks (MPI_Alltoallv): each rank sends SIZE in all, received totals differ.
if wanted all_to_all_v; then
  mpi=$(mpirun --allow-run-as-root --oversubscribe -np 2 "$work/mpi_alltoallv" "$bytes" | busbw)
  uneven=("$meshtrain" bench comm --ranks 2 --nodes 1 --op all_to_all_v)
  ours=$("${uneven[@]}" --sizes "$size" | busbw)
  heap=$("${uneven[@]}" --sizes "$size" --heap-buffers | busbw)
  printf '%-15s %9s | %9s %7s | %9s %7s | %9s %7s\n' all_to_all_v "$mpi" "$ours" "$(ratio "$ours" "$mpi")" - - \
    "$heap" "$(ratio "$heap" "$mpi")"
fi

wanted hierarchical || exit 0
echo
echo "all_reduce, 4 ranks on 2 virtual nodes (shm inside, tcp between), $size"
flat=$("$meshtrain" bench comm --ranks 4 --nodes 2 --op all_reduce --sizes "$size" --algorithm ring | busbw)
hier=$("$meshtrain" bench comm --ranks 4 --nodes 2 --op all_reduce --sizes "$size" --algorithm hierarchical | busbw)
printf 'flat ring %s GB/s, hierarchical %s GB/s: %.2fx\n' "$flat" "$hier" \
  "$(awk -v a="$hier" -v b="$flat" 'BEGIN { print a / b }')"
