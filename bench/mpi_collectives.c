/* The Open MPI side of `bench/compare-openmpi.sh`: MPI_Allgather, MPI_Reduce_scatter_block,
 * MPI_Allreduce and MPI_Alltoall on fp32, timed the way `meshtrain bench comm` times its collectives
 * (out of place, warm-up, then the mean over iterations of the slowest rank) and printed
 * in the same columns, with nccl-tests' bus-bandwidth factors.
 *
 *   mpirun -np 2 ./mpi_collectives all_gather|reduce_scatter|all_reduce|all_to_all MIN_BYTES MAX_BYTES
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void issue(const char *op, float *send, float *recv, size_t total, int n) {
  size_t block = total / n;
  if (strcmp(op, "all_gather") == 0) {
    MPI_Allgather(send, (int)block, MPI_FLOAT, recv, (int)block, MPI_FLOAT, MPI_COMM_WORLD);
  } else if (strcmp(op, "all_to_all") == 0) {
    MPI_Alltoall(send, (int)block, MPI_FLOAT, recv, (int)block, MPI_FLOAT, MPI_COMM_WORLD);
  } else if (strcmp(op, "reduce_scatter") == 0) {
    MPI_Reduce_scatter_block(send, recv, (int)block, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
  } else {
    MPI_Allreduce(send, recv, (int)total, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
  }
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int n, rank;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (argc != 4) {
    if (rank == 0) {
      fprintf(stderr, "usage: %s all_gather|reduce_scatter|all_reduce|all_to_all MIN_BYTES MAX_BYTES\n", argv[0]);
    }
    MPI_Finalize();
    return 2;
  }
  const char *op = argv[1];
  size_t min_bytes = strtoull(argv[2], NULL, 10), max_bytes = strtoull(argv[3], NULL, 10);
  double factor = strcmp(op, "all_reduce") == 0 ? 2.0 * (n - 1) / n : (double)(n - 1) / n;
  if (rank == 0) {
    printf("# MPI %s, %d ranks, fp32, out of place\n", op, n);
    printf("%12s %12s %8s %12s %12s %12s\n", "size(B)", "count", "iters", "time(us)", "algbw(GB/s)", "busbw(GB/s)");
  }
  for (size_t size = min_bytes; size <= max_bytes; size *= 2) {
    size_t total = size / 4 / n * n;
    if (total < (size_t)n) total = n;
    size_t bytes = total * 4;
    float *send = malloc(bytes), *recv = malloc(bytes);
    memset(send, 1, bytes);
    memset(recv, 0, bytes);
    size_t iterations = ((size_t)1 << 30) / bytes;
    if (iterations < 5) iterations = 5;
    if (iterations > 200) iterations = 200;
    for (int i = 0; i < 3; ++i) issue(op, send, recv, total, n);
    MPI_Barrier(MPI_COMM_WORLD);
    double start = MPI_Wtime();
    for (size_t i = 0; i < iterations; ++i) issue(op, send, recv, total, n);
    double seconds = (MPI_Wtime() - start) / iterations, slowest;
    MPI_Allreduce(&seconds, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    if (rank == 0) {
      double algbw = bytes / slowest / 1e9;
      printf("%12zu %12zu %8zu %12.1f %12.3f %12.3f\n", bytes, total, iterations, slowest * 1e6, algbw, algbw * factor);
      fflush(stdout);
    }
    free(send);
    free(recv);
  }
  MPI_Finalize();
  return 0;
}
