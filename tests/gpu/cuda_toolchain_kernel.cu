#include "tests/gpu/cuda_toolchain_kernel.h"

namespace meshtrain::testing {
namespace {

// y[i] = a * x[i] + y[i]
__global__ void SaxpyKernel(float a, const float* x, float* y, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = a * x[i] + y[i];
}

}  // namespace

cudaError_t LaunchSaxpy(float a, const float* x, float* y, int n, cudaStream_t stream) {
  const int threads = 256;
  SaxpyKernel<<<(n + threads - 1) / threads, threads, 0, stream>>>(a, x, y, n);
  return cudaGetLastError();
}

}  // namespace meshtrain::testing
