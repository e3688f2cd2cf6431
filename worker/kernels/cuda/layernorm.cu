// LayerNorm's kernels (launch.h): one warp per row, 128-bit loads. The forward (with the
// residual add fused in) reads its row three times, from L1 after the first; the backward
// keeps each warp's dweight and dbias partial sums in shared memory (no atomics), adds the
// warps in order per block, and a second pass adds the blocks in order.

#include <algorithm>
#include <stdexcept>
#include <string>

#include "worker/kernels/cuda/common.cuh"

namespace meshtrain::kernels::cuda {
namespace {

using namespace detail;

constexpr float kEpsilon = 1e-5f;
// Blocks of the backward's first pass: a constant, so that the order of its sums, and the
// result, do not depend on the device.
constexpr int kBackwardBlocks = 512;

// Lane l of a row's warp handles vectors l, l + 32, ... of V channels.
template <int V>
__global__ void LayerNormForwardKernel(bf16* residual, bf16* __restrict__ out, float* __restrict__ mean,
                                       float* __restrict__ rstd, const bf16* a, const bf16* b,
                                       const bf16* __restrict__ weight, const bf16* __restrict__ bias, int64_t N,
                                       int C) {
  const int lane = threadIdx.x % kWarp;
  const int64_t row = int64_t(blockIdx.x) * (blockDim.x / kWarp) + threadIdx.x / kWarp;
  if (row >= N) return;
  const int vectors = C / V;
  const int64_t offset = row * C;
  // With b, the row is the residual as stored: written here, and read back by the lane
  // that wrote it (residual may alias a or b, so the sum is not recomputed).
  const bf16* x = b != nullptr ? residual + offset : a + offset;
  float sum = 0;
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
    for (int j = 0; j < V; ++j) sum += value[j];
  }
  const float m = WarpSum(sum) / C;
  float squares = 0;
  for (int v = lane; v < vectors; v += kWarp) {
    float value[V];
    Load<V>(x + v * V, value);
#pragma unroll
    for (int j = 0; j < V; ++j) squares += (value[j] - m) * (value[j] - m);
  }
  const float s = 1.0f / sqrtf(WarpSum(squares) / C + kEpsilon);
  for (int v = lane; v < vectors; v += kWarp) {
    float value[V], w[V], beta[V];
    Load<V>(x + v * V, value);
    Load<V>(weight + v * V, w);
    Load<V>(bias + v * V, beta);
#pragma unroll
    for (int j = 0; j < V; ++j) value[j] = (s * (value[j] - m)) * w[j] + beta[j];
    Store<V>(out + offset + v * V, value);
  }
  if (lane == 0) {
    mean[row] = m;
    rstd[row] = s;
  }
}

// First pass: warps stride over rows; warp w of a block adds its rows' norm * dout and
// dout into its own 2C floats of shared memory; then the block adds its warps in order
// into partials[block][2C].
template <int V>
__global__ void LayerNormBackwardKernel(bf16* __restrict__ dinp, float* __restrict__ partials,
                                        const bf16* __restrict__ dout, const bf16* __restrict__ inp,
                                        const bf16* __restrict__ weight, const float* __restrict__ mean,
                                        const float* __restrict__ rstd, int64_t N, int C) {
  extern __shared__ float4 shared_sums[];
  float* sums = reinterpret_cast<float*>(shared_sums);
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, warps = blockDim.x / kWarp;
  for (int i = threadIdx.x; i < warps * 2 * C; i += blockDim.x) sums[i] = 0;
  __syncthreads();
  float* dweight_sums = sums + int64_t(warp) * 2 * C;
  float* dbias_sums = dweight_sums + C;
  const int vectors = C / V;
  for (int64_t row = int64_t(blockIdx.x) * warps + warp; row < N; row += int64_t(gridDim.x) * warps) {
    const int64_t offset = row * C;
    const float m = mean[row], s = rstd[row];
    // dinp = s (dnorm - mean(dnorm) - norm mean(dnorm norm)), dnorm = weight dout
    float dnorm_sum = 0, dnorm_norm_sum = 0;
    for (int v = lane; v < vectors; v += kWarp) {
      float x[V], dy[V], w[V];
      Load<V>(inp + offset + v * V, x);
      Load<V>(dout + offset + v * V, dy);
      Load<V>(weight + v * V, w);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const float dnorm = w[j] * dy[j];
        dnorm_sum += dnorm;
        dnorm_norm_sum += dnorm * ((x[j] - m) * s);
      }
    }
    const float dnorm_mean = WarpSum(dnorm_sum) / C, dnorm_norm_mean = WarpSum(dnorm_norm_sum) / C;
    for (int v = lane; v < vectors; v += kWarp) {
      float x[V], dy[V], w[V], dx[V], dw[V], db[V];
      Load<V>(inp + offset + v * V, x);
      Load<V>(dout + offset + v * V, dy);
      Load<V>(weight + v * V, w);
      Load<V>(dinp + offset + v * V, dx);
      Load<V>(dweight_sums + v * V, dw);
      Load<V>(dbias_sums + v * V, db);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const float norm = (x[j] - m) * s;
        const float dnorm = w[j] * dy[j];
        db[j] += dy[j];
        dw[j] += norm * dy[j];
        dx[j] += (dnorm - dnorm_mean - norm * dnorm_norm_mean) * s;
      }
      Store<V>(dinp + offset + v * V, dx);
      Store<V>(dweight_sums + v * V, dw);
      Store<V>(dbias_sums + v * V, db);
    }
  }
  __syncthreads();
  float* block_partials = partials + int64_t(blockIdx.x) * 2 * C;
  for (int i = threadIdx.x; i < 2 * C; i += blockDim.x) {
    float total = sums[i];
    for (int w = 1; w < warps; ++w) total += sums[int64_t(w) * 2 * C + i];
    block_partials[i] = total;
  }
}

template <int V>
void LaunchLayerNormBackward(bf16* dinp, float* dweight, float* dbias, const bf16* dout, const bf16* inp,
                             const bf16* weight, const float* mean, const float* rstd, int64_t N, int C,
                             float* partials, int64_t partial_capacity, cudaStream_t stream) {
  // Each warp holds 2C floats of shared memory: as many warps as 48 KiB hold (up to 8),
  // and at least one, for which wide rows opt in to more.
  constexpr int kDefaultShared = 48 << 10;
  const int64_t per_warp = int64_t(2) * C * sizeof(float);
  const int warps = int(std::clamp<int64_t>(kDefaultShared / per_warp, 1, kWarpsPerBlock));
  const int64_t shared = warps * per_warp;
  if (shared > kDefaultShared) {
    const cudaError_t status = cudaFuncSetAttribute(LayerNormBackwardKernel<V>,
                                                    cudaFuncAttributeMaxDynamicSharedMemorySize, int(shared));
    if (status != cudaSuccess) {
      ThrowLaunchError(status, "LayerNormBackward (shared memory)", "C=" + std::to_string(C));
    }
  }
  const int blocks = int(std::min<int64_t>({CeilDiv(N, warps), kBackwardBlocks, partial_capacity / (2 * C)}));
  LayerNormBackwardKernel<V><<<blocks, warps * kWarp, shared, stream>>>(dinp, partials, dout, inp, weight, mean,
                                                                         rstd, N, C);
  // Second pass: dweight[c] += partials[0][c] + partials[1][c] + ..., and dbias likewise.
  AddColumnSums(dweight, dbias, C, partials, blocks, 2 * C, stream);
}

}  // namespace

void LayerNormForward(bf16* residual, bf16* out, float* mean, float* rstd, const bf16* a, const bf16* b,
                      const bf16* weight, const bf16* bias, int64_t N, int C, cudaStream_t stream) {
  if (N == 0 || C == 0) return;
  const bool vector = C % 8 == 0 && Aligned(residual, 16) && Aligned(out, 16) && Aligned(a, 16) &&
                      Aligned(b, 16) && Aligned(weight, 16) && Aligned(bias, 16);
  const int blocks = Blocks(N, kWarpsPerBlock);
  if (vector) {
    LayerNormForwardKernel<8><<<blocks, kThreads, 0, stream>>>(residual, out, mean, rstd, a, b, weight, bias, N, C);
  } else {
    LayerNormForwardKernel<1><<<blocks, kThreads, 0, stream>>>(residual, out, mean, rstd, a, b, weight, bias, N, C);
  }
  CheckLaunch(b != nullptr ? "ResidualLayerNormForward" : "LayerNormForward", {{"N", N}, {"C", C}});
}

void LayerNormBackward(bf16* dinp, float* dweight, float* dbias, const bf16* dout, const bf16* inp,
                       const bf16* weight, const float* mean, const float* rstd, int64_t N, int C, float* partials,
                       int64_t partial_capacity, cudaStream_t stream) {
  if (N == 0 || C == 0) return;
  if (C > kMaxLayerNormChannels || int64_t(2) * C > partial_capacity) {
    throw std::invalid_argument("LayerNormBackward: C = " + std::to_string(C) + " exceeds the " +
                                std::to_string(std::min<int64_t>(kMaxLayerNormChannels, partial_capacity / 2)) +
                                " channels the CUDA table was built for");
  }
  const bool vector = C % 8 == 0 && Aligned(dinp, 16) && Aligned(dout, 16) && Aligned(inp, 16) &&
                      Aligned(weight, 16);
  if (vector) {
    LaunchLayerNormBackward<8>(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C, partials, partial_capacity,
                               stream);
  } else {
    LaunchLayerNormBackward<1>(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C, partials, partial_capacity,
                               stream);
  }
  CheckLaunch("LayerNormBackward", {{"N", N}, {"C", C}});
}

}  // namespace meshtrain::kernels::cuda
