#include "cli/commands.h"
#include "worker/kernels/cpu/blas_core.h"

int main(int argc, char** argv) {
  // Before anything runs a kernel or starts a rank (worker/kernels/cpu/blas_core.h).
  meshtrain::kernels::cpu::StartWithBestBlasCore(argc, argv);
  return meshtrain::cli::Main(argc, argv);
}
