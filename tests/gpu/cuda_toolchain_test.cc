// The CUDA build option end to end: NCCL and cuBLAS link and report their versions
// (no GPU needed), and an nvcc-built kernel matches its CPU reference (GPU needed).

#include <cmath>
#include <random>
#include <vector>

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <nccl.h>

#include "tests/gpu/cuda_toolchain_kernel.h"
#include "tests/support/gpu.h"

namespace meshtrain::testing {
namespace {

TEST(CudaToolchain, NcclAndCublasLink) {
  int nccl_version = 0;
  ASSERT_EQ(ncclGetVersion(&nccl_version), ncclSuccess);
  EXPECT_GE(nccl_version, 21800);  // NCCL 2.18: ncclCommSplit
  int cublas_major = 0;
  ASSERT_EQ(cublasGetProperty(MAJOR_VERSION, &cublas_major), CUBLAS_STATUS_SUCCESS);
  EXPECT_GE(cublas_major, 12);
}

TEST(CudaToolchain, KernelMatchesCpuReference) {
  MESHTRAIN_SKIP_WITHOUT_GPU();
  const int n = 1 << 20;
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  std::vector<float> x(n), y(n);
  for (int i = 0; i < n; ++i) x[i] = dist(rng), y[i] = dist(rng);

  float *dx = nullptr, *dy = nullptr;
  ASSERT_EQ(cudaMalloc(&dx, n * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&dy, n * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dx, x.data(), n * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dy, y.data(), n * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(LaunchSaxpy(2.5f, dx, dy, n, nullptr), cudaSuccess);
  std::vector<float> out(n);
  ASSERT_EQ(cudaMemcpy(out.data(), dy, n * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  cudaFree(dx);
  cudaFree(dy);
  for (int i = 0; i < n; ++i) {
    const double expected = 2.5 * double(x[i]) + double(y[i]);
    ASSERT_NEAR(out[i], expected, 1e-6) << "at " << i;
  }
}

}  // namespace
}  // namespace meshtrain::testing
