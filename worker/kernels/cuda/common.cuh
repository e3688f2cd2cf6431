// What the kernel files of kernels/cuda share: launch shapes, the launch check and warp
// reductions. Internal to kernels/cuda.

#pragma once

#include <cstdint>
#include <string>

#include "worker/runtime/cuda.h"

namespace meshtrain::kernels::cuda::detail {

constexpr int kWarp = 32;
constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / kWarp;

inline void CheckLaunch(const char* kernel) {
  runtime::cuda::Check(cudaGetLastError(), std::string("launch of ") + kernel);
}

// Blocks of `per_block` work items that cover n.
inline int Blocks(int64_t n, int per_block = kThreads) { return int((n + per_block - 1) / per_block); }

__device__ inline float WarpSum(float value) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2) value += __shfl_xor_sync(0xffffffff, value, offset);
  return value;
}

__device__ inline float WarpMax(float value) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2) value = fmaxf(value, __shfl_xor_sync(0xffffffff, value, offset));
  return value;
}

}  // namespace meshtrain::kernels::cuda::detail
