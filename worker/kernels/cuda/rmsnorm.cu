// RMSNorm's kernels (launch.h), shaped as LayerNorm's (layernorm.cu): one warp per row,
// 128-bit loads. The forward (with the residual add fused in) reads its row twice, from
// L1 the second time; the backward keeps each warp's dweight partial sums in shared
// memory (no atomics), adds the warps in order per block, and a second pass adds the
// blocks in order, so dweight repeats bit for bit.

#include <algorithm>
#include <stdexcept>
#include <string>

#include "worker/kernels/cuda/common.cuh"

namespace meshtrain::kernels::cuda {
namespace {

using namespace detail;

// Blocks of the backward's first pass: a constant, so that the order of its sums, and the
// result, do not depend on the device.
constexpr int kBackwardBlocks = 512;

// Lane l of a row's warp handles vectors l, l + 32, ... of V channels.
template <int V>
__global__ void RmsNormForwardKernel(bf16* residual, bf16* __restrict__ out, float* __restrict__ rstd, const bf16* a,
                                     const bf16* b, const bf16* __restrict__ weight, int64_t N, int C, float eps) {
  const int lane = threadIdx.x % kWarp;
  const int64_t row = int64_t(blockIdx.x) * (blockDim.x / kWarp) + threadIdx.x / kWarp;
  if (row >= N) return;
  const int vectors = C / V;
  const int64_t offset = row * C;
  // With b, the row is the residual as stored: written here, and read back by the lane
  // that wrote it (residual may alias a or b, so the sum is not recomputed).
  const bf16* x = b != nullptr ? residual + offset : a + offset;
  float squares = 0;
  for (int v = lane; v < vectors; v += kWarp) {
    float value[V];
    Load<V>(a + offset + v * V, value);
    if (b != nullptr) {
      float other[V];
      Load<V>(b + offset + v * V, other);
#pragma unroll
      for (int j = 0; j < V; ++j) value[j] = RoundBf16(value[j] + other[j]);
      Store<V>(residual + offset + v * V, value);
    }
#pragma unroll
    for (int j = 0; j < V; ++j) squares += value[j] * value[j];
  }
  const float s = 1.0f / sqrtf(WarpSum(squares) / C + eps);
  for (int v = lane; v < vectors; v += kWarp) {
    float value[V], w[V];
    Load<V>(x + v * V, value);
    Load<V>(weight + v * V, w);
#pragma unroll
    for (int j = 0; j < V; ++j) value[j] = (value[j] * s) * w[j];
    Store<V>(out + offset + v * V, value);
  }
  if (lane == 0) rstd[row] = s;
}

// First pass: warps stride over rows; warp w of a block adds its rows' norm * dout into
// its own C floats of shared memory; then the block adds its warps in order into
// partials[block][C].
template <int V>
__global__ void RmsNormBackwardKernel(bf16* __restrict__ dinp, float* __restrict__ partials,
                                      const bf16* __restrict__ dout, const bf16* __restrict__ inp,
                                      const bf16* __restrict__ weight, const float* __restrict__ rstd, int64_t N,
                                      int C) {
  extern __shared__ float4 shared_sums[];
  float* sums = reinterpret_cast<float*>(shared_sums);
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, warps = blockDim.x / kWarp;
  for (int i = threadIdx.x; i < warps * C; i += blockDim.x) sums[i] = 0;
  __syncthreads();
  float* dweight_sums = sums + int64_t(warp) * C;
  const int vectors = C / V;
  for (int64_t row = int64_t(blockIdx.x) * warps + warp; row < N; row += int64_t(gridDim.x) * warps) {
    const int64_t offset = row * C;
    const float s = rstd[row];
    // dinp = s (dnorm - norm mean(dnorm norm)), dnorm = weight dout, norm = x s
    float dnorm_norm_sum = 0;
    for (int v = lane; v < vectors; v += kWarp) {
      float x[V], dy[V], w[V];
      Load<V>(inp + offset + v * V, x);
      Load<V>(dout + offset + v * V, dy);
      Load<V>(weight + v * V, w);
#pragma unroll
      for (int j = 0; j < V; ++j) dnorm_norm_sum += w[j] * dy[j] * (x[j] * s);
    }
    const float dnorm_norm_mean = WarpSum(dnorm_norm_sum) / C;
    for (int v = lane; v < vectors; v += kWarp) {
      float x[V], dy[V], w[V], dx[V], dw[V];
      Load<V>(inp + offset + v * V, x);
      Load<V>(dout + offset + v * V, dy);
      Load<V>(weight + v * V, w);
      Load<V>(dinp + offset + v * V, dx);
      Load<V>(dweight_sums + v * V, dw);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const float norm = x[j] * s;
        dw[j] += norm * dy[j];
        dx[j] += (w[j] * dy[j] - norm * dnorm_norm_mean) * s;
      }
      Store<V>(dinp + offset + v * V, dx);
      Store<V>(dweight_sums + v * V, dw);
    }
  }
  __syncthreads();
  float* block_partials = partials + int64_t(blockIdx.x) * C;
  for (int i = threadIdx.x; i < C; i += blockDim.x) {
    float total = sums[i];
    for (int w = 1; w < warps; ++w) total += sums[int64_t(w) * C + i];
    block_partials[i] = total;
  }
}

template <int V>
void LaunchRmsNormBackward(bf16* dinp, float* dweight, const bf16* dout, const bf16* inp, const bf16* weight,
                           const float* rstd, int64_t N, int C, float* partials, int64_t partial_capacity,
                           cudaStream_t stream) {
  // Each warp holds C floats of shared memory: as many warps as 48 KiB hold (up to 8),
  // and at least one, for which wide rows opt in to more.
  constexpr int kDefaultShared = 48 << 10;
  const int64_t per_warp = int64_t(C) * sizeof(float);
  const int warps = int(std::clamp<int64_t>(kDefaultShared / per_warp, 1, kWarpsPerBlock));
  const int64_t shared = warps * per_warp;
  if (shared > kDefaultShared) {
    const cudaError_t status = cudaFuncSetAttribute(RmsNormBackwardKernel<V>,
                                                    cudaFuncAttributeMaxDynamicSharedMemorySize, int(shared));
    if (status != cudaSuccess) {
      ThrowLaunchError(status, "RmsNormBackward (shared memory)", "C=" + std::to_string(C));
    }
  }
  const int blocks = int(std::min<int64_t>({CeilDiv(N, warps), kBackwardBlocks, partial_capacity / C}));
  RmsNormBackwardKernel<V><<<blocks, warps * kWarp, shared, stream>>>(dinp, partials, dout, inp, weight, rstd, N, C);
  // Second pass: dweight[c] += partials[0][c] + partials[1][c] + ...
  AddColumnSums(dweight, nullptr, C, partials, blocks, C, stream);
}

}  // namespace

void RmsNormForward(bf16* residual, bf16* out, float* rstd, const bf16* a, const bf16* b, const bf16* weight,
                    int64_t N, int C, float eps, cudaStream_t stream) {
  if (N == 0 || C == 0) return;
  const bool vector = C % 8 == 0 && Aligned(residual, 16) && Aligned(out, 16) && Aligned(a, 16) && Aligned(b, 16) &&
                      Aligned(weight, 16);
  const int blocks = Blocks(N, kWarpsPerBlock);
  if (vector) {
    RmsNormForwardKernel<8><<<blocks, kThreads, 0, stream>>>(residual, out, rstd, a, b, weight, N, C, eps);
  } else {
    RmsNormForwardKernel<1><<<blocks, kThreads, 0, stream>>>(residual, out, rstd, a, b, weight, N, C, eps);
  }
  CheckLaunch(b != nullptr ? "ResidualRmsNormForward" : "RmsNormForward", {{"N", N}, {"C", C}});
}

void RmsNormBackward(bf16* dinp, float* dweight, const bf16* dout, const bf16* inp, const bf16* weight,
                     const float* rstd, int64_t N, int C, float* partials, int64_t partial_capacity,
                     cudaStream_t stream) {
  if (N == 0 || C == 0) return;
  if (C > kMaxRmsNormChannels || C > partial_capacity) {
    throw std::invalid_argument("RmsNormBackward: C = " + std::to_string(C) + " exceeds the " +
                                std::to_string(std::min<int64_t>(kMaxRmsNormChannels, partial_capacity)) +
                                " channels the CUDA table was built for");
  }
  const bool vector = C % 8 == 0 && Aligned(dinp, 16) && Aligned(dout, 16) && Aligned(inp, 16) &&
                      Aligned(weight, 16);
  if (vector) {
    LaunchRmsNormBackward<8>(dinp, dweight, dout, inp, weight, rstd, N, C, partials, partial_capacity, stream);
  } else {
    LaunchRmsNormBackward<1>(dinp, dweight, dout, inp, weight, rstd, N, C, partials, partial_capacity, stream);
  }
  CheckLaunch("RmsNormBackward", {{"N", N}, {"C", C}});
}

}  // namespace meshtrain::kernels::cuda
