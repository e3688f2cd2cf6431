// The main() of every gtest binary: OpenBLAS's best core for this CPU first
// (worker/kernels/cpu/blas_core.h), as the programs under test start, then the tests.

#include <gtest/gtest.h>

#include "worker/kernels/cpu/blas_core.h"

int main(int argc, char** argv) {
  meshtrain::kernels::cpu::StartWithBestBlasCore(argc, argv);
  testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
