// What the kernel files of kernels/cuda share: launch shapes, the launch check, 128-bit
// loads and stores of bf16 and fp32, and reductions in a fixed order (so that a sum
// repeats bit for bit). Internal to kernels/cuda; CUDA C++17.

#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>

#include "worker/kernels/cuda/launch.h"

namespace meshtrain::kernels::cuda::detail {

constexpr int kWarp = 32;
constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / kWarp;

// Throws (launch.h) when the last launch failed; the shape is formatted only then.
inline void CheckLaunch(const char* kernel, std::initializer_list<std::pair<const char*, int64_t>> shape) {
  const cudaError_t status = cudaGetLastError();
  if (status == cudaSuccess) return;
  std::string text;
  for (const auto& [name, value] : shape) {
    if (!text.empty()) text += ' ';
    text += std::string(name) + '=' + std::to_string(value);
  }
  ThrowLaunchError(status, kernel, text);
}

inline int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline int Blocks(int64_t n, int per_block = kThreads) { return int(CeilDiv(n, per_block)); }

inline bool Aligned(const void* p, int bytes) { return reinterpret_cast<uintptr_t>(p) % uintptr_t(bytes) == 0; }

// --- 128-bit access: V elements at once (V = 8 for bf16 or 4 for fp32), or one ---

template <int V>
__device__ __forceinline__ void Load(const bf16* p, float (&out)[V]) {
  if constexpr (V == 8) {
    const int4 raw = *reinterpret_cast<const int4*>(p);
    const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __bfloat1622float2(pairs[i]);
      out[2 * i] = f.x;
      out[2 * i + 1] = f.y;
    }
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i) out[i] = __bfloat162float(p[i]);
  }
}

template <int V>
__device__ __forceinline__ void Store(bf16* p, const float (&in)[V]) {
  if constexpr (V == 8) {
    int4 raw;
    __nv_bfloat162* pairs = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) pairs[i] = __floats2bfloat162_rn(in[2 * i], in[2 * i + 1]);
    *reinterpret_cast<int4*>(p) = raw;
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i) p[i] = __float2bfloat16(in[i]);
  }
}

template <int V>
__device__ __forceinline__ void Load(const float* p, float (&out)[V]) {
  if constexpr (V % 4 == 0) {
#pragma unroll
    for (int i = 0; i < V; i += 4) {
      const float4 f = *reinterpret_cast<const float4*>(p + i);
      out[i] = f.x;
      out[i + 1] = f.y;
      out[i + 2] = f.z;
      out[i + 3] = f.w;
    }
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i) out[i] = p[i];
  }
}

template <int V>
__device__ __forceinline__ void Store(float* p, const float (&in)[V]) {
  if constexpr (V % 4 == 0) {
#pragma unroll
    for (int i = 0; i < V; i += 4) *reinterpret_cast<float4*>(p + i) = make_float4(in[i], in[i + 1], in[i + 2], in[i + 3]);
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i) p[i] = in[i];
  }
}

// What storing x as bf16 and reading it back gives.
__device__ __forceinline__ float RoundBf16(float x) { return __bfloat162float(__float2bfloat16(x)); }

// --- Reductions: butterflies within a warp, then warps in order ---

template <class T>
__device__ __forceinline__ T WarpSum(T value) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset /= 2) value += __shfl_xor_sync(0xffffffffu, value, offset);
  return value;
}

__device__ __forceinline__ float WarpMax(float value) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset /= 2) value = fmaxf(value, __shfl_xor_sync(0xffffffffu, value, offset));
  return value;
}

// The sum over the block, on every thread. REQUIRES: blockDim.x a multiple of 32, at most
// 1024; every thread calls it.
template <class T>
__device__ inline T BlockSum(T value) {
  __shared__ T partial[kWarp];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, warps = blockDim.x / kWarp;
  value = WarpSum(value);
  __syncthreads();  // a previous call may still be reading `partial`
  if (lane == 0) partial[warp] = value;
  __syncthreads();
  T total = partial[0];
  for (int w = 1; w < warps; ++w) total += partial[w];
  return total;
}

__device__ inline float BlockMax(float value) {
  __shared__ float partial[kWarp];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, warps = blockDim.x / kWarp;
  value = WarpMax(value);
  __syncthreads();
  if (lane == 0) partial[warp] = value;
  __syncthreads();
  float total = partial[0];
  for (int w = 1; w < warps; ++w) total = fmaxf(total, partial[w]);
  return total;
}

// An online softmax's running (max, sum of exp(x - max)).
struct MaxSum {
  float max, sum;
};

__device__ __forceinline__ MaxSum Combine(MaxSum a, MaxSum b) {
  if (a.max == -INFINITY) return b;
  if (b.max == -INFINITY) return a;
  const float m = fmaxf(a.max, b.max);
  return {m, a.sum * expf(a.max - m) + b.sum * expf(b.max - m)};
}

__device__ __forceinline__ MaxSum WarpCombine(MaxSum value) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset /= 2) {
    const MaxSum other{__shfl_xor_sync(0xffffffffu, value.max, offset),
                       __shfl_xor_sync(0xffffffffu, value.sum, offset)};
    value = Combine(value, other);
  }
  return value;
}

__device__ inline MaxSum BlockCombine(MaxSum value) {
  __shared__ MaxSum partial[kWarp];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, warps = blockDim.x / kWarp;
  value = WarpCombine(value);
  __syncthreads();
  if (lane == 0) partial[warp] = value;
  __syncthreads();
  MaxSum total = partial[0];
  for (int w = 1; w < warps; ++w) total = Combine(total, partial[w]);
  return total;
}

// The tanh form of GELU and its derivative, as llm.c and cuBLASLt's epilogues compute them.
constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2/pi)

__device__ __forceinline__ float Gelu(float x) {
  return 0.5f * x * (1.0f + tanhf(kGeluScale * (x + 0.044715f * x * x * x)));
}

__device__ __forceinline__ float GeluGrad(float x) {
  const float tanh_out = tanhf(kGeluScale * (x + 0.044715f * x * x * x));
  const float sech2 = 1.0f - tanh_out * tanh_out;
  return 0.5f * (1.0f + tanh_out) + x * 0.5f * sech2 * kGeluScale * (1.0f + 3.0f * 0.044715f * x * x);
}

}  // namespace meshtrain::kernels::cuda::detail
