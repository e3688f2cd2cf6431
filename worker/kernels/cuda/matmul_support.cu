// The kernels around the products (launch.h): the bias gradient (column sums read once,
// per row range, then added in range order, as LayerNorm's backward adds its partials, or
// the sums cuBLASLt's BGRADB epilogue wrote, added), and the unfused bias, GELU and
// GELU-gradient steps for shapes cuBLASLt's epilogues do not take.

#include <algorithm>
#include <stdexcept>
#include <string>

#include "worker/kernels/cuda/common.cuh"

namespace meshtrain::kernels::cuda {
namespace {

using namespace detail;

constexpr int kBiasRowsPerThread = 8;  // blockDim.y: rows a block reads side by side
constexpr int kMaxBiasSplits = 256;
constexpr int64_t kMinRowsPerSplit = 64;

// Block (32, 8): thread (x, y) sums V columns over rows y, y + 8, ... of its range; the
// block then adds its 8 row lanes in order into partials[range][column].
template <int V>
__global__ void BiasPartialsKernel(float* __restrict__ partials, const bf16* __restrict__ dout, int64_t N, int OC,
                                   int64_t rows_per_split) {
  __shared__ float4 shared_lanes[kBiasRowsPerThread * kWarp * V / 4 + 1];
  float* lanes = reinterpret_cast<float*>(shared_lanes);  // [8][32 V]
  const int c = (blockIdx.x * kWarp + threadIdx.x) * V;
  const int64_t begin = int64_t(blockIdx.y) * rows_per_split;
  const int64_t end = begin + rows_per_split < N ? begin + rows_per_split : N;
  float sum[V] = {};
  if (c < OC) {
    for (int64_t row = begin + threadIdx.y; row < end; row += kBiasRowsPerThread) {
      float d[V];
      Load<V>(dout + row * OC + c, d);
#pragma unroll
      for (int j = 0; j < V; ++j) sum[j] += d[j];
    }
  }
#pragma unroll
  for (int j = 0; j < V; ++j) lanes[threadIdx.y * kWarp * V + threadIdx.x * V + j] = sum[j];
  __syncthreads();
  for (int slot = threadIdx.y * kWarp + threadIdx.x; slot < kWarp * V; slot += kBiasRowsPerThread * kWarp) {
    const int column = blockIdx.x * kWarp * V + slot;
    if (column >= OC) continue;
    float total = lanes[slot];
    for (int y = 1; y < kBiasRowsPerThread; ++y) total += lanes[y * kWarp * V + slot];
    partials[int64_t(blockIdx.y) * OC + column] = total;
  }
}

// Block (32, kColumnSumLanes): column c = 32 blockIdx.x + x; lane y sums rows y, y + lanes,
// ... of partials, then lane 0 adds the lanes in order. Each thread reads a few rows: a
// thread per column reading every row serially was latency-bound (12-22 us a launch on
// an H100 for what moves in 2).
constexpr int kColumnSumLanes = 32;

__global__ void AddColumnSumsKernel(float* __restrict__ first, float* __restrict__ second, int split,
                                    const float* __restrict__ partials, int rows, int columns) {
  __shared__ float lanes[kColumnSumLanes][kWarp + 1];
  const int c = blockIdx.x * kWarp + threadIdx.x;
  float sum = 0;
  if (c < columns) {
#pragma unroll 4
    for (int row = threadIdx.y; row < rows; row += kColumnSumLanes) sum += partials[int64_t(row) * columns + c];
  }
  lanes[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y != 0 || c >= columns) return;
  float total = lanes[0][threadIdx.x];
  for (int y = 1; y < kColumnSumLanes; ++y) total += lanes[y][threadIdx.x];
  if (c < split) {
    first[c] += total;
  } else {
    second[c - split] += total;
  }
}

__global__ void BiasGeluKernel(bf16* __restrict__ out, bf16* __restrict__ gelu_pre, const bf16* __restrict__ bias,
                               int64_t n, int OC) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float sum = __bfloat162float(out[i]);
  if (bias != nullptr) sum += __bfloat162float(bias[i % OC]);
  if (gelu_pre != nullptr) {
    gelu_pre[i] = __float2bfloat16(sum);
    sum = Gelu(sum);
  }
  out[i] = __float2bfloat16(sum);
}

__global__ void GeluBackwardKernel(bf16* __restrict__ dinp, const bf16* __restrict__ gelu_pre, int64_t n) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  dinp[i] = __float2bfloat16(__bfloat162float(dinp[i]) * GeluGrad(__bfloat162float(gelu_pre[i])));
}

}  // namespace

void BiasBackward(float* dbias, const bf16* dout, int64_t N, int OC, float* partials, int64_t partial_capacity,
                  cudaStream_t stream) {
  if (N == 0 || OC == 0) return;
  if (OC > partial_capacity) {
    throw std::invalid_argument("MatmulBackward: a bias of " + std::to_string(OC) + " outputs exceeds the " +
                                std::to_string(partial_capacity) + " the CUDA table was built for");
  }
  // Enough row ranges to fill the device, each long enough to be worth a block; the
  // count depends on the shape only, so the order of the sums does too.
  const int64_t most_splits = std::min<int64_t>(kMaxBiasSplits, partial_capacity / OC);
  const int64_t rows_per_split = std::max(kMinRowsPerSplit, CeilDiv(N, most_splits));
  const int splits = int(CeilDiv(N, rows_per_split));
  const bool vector = OC % 8 == 0 && Aligned(dout, 16);
  const dim3 block(kWarp, kBiasRowsPerThread);
  if (vector) {
    BiasPartialsKernel<8><<<dim3(Blocks(OC, kWarp * 8), splits), block, 0, stream>>>(partials, dout, N, OC,
                                                                                      rows_per_split);
  } else {
    BiasPartialsKernel<1><<<dim3(Blocks(OC, kWarp), splits), block, 0, stream>>>(partials, dout, N, OC,
                                                                                  rows_per_split);
  }
  AddColumnSums(dbias, nullptr, OC, partials, splits, OC, stream);
  CheckLaunch("MatmulBackward (bias gradient)", {{"N", N}, {"OC", OC}});
}

void AddBiasGradient(float* dbias, const float* sums, int OC, cudaStream_t stream) {
  if (OC == 0) return;
  AddColumnSums(dbias, nullptr, OC, sums, 1, OC, stream);
  CheckLaunch("MatmulBackward (adding the bias gradient)", {{"OC", OC}});
}

void AddColumnSums(float* first, float* second, int split, const float* partials, int rows, int columns,
                   cudaStream_t stream) {
  AddColumnSumsKernel<<<Blocks(columns, kWarp), dim3(kWarp, kColumnSumLanes), 0, stream>>>(first, second, split,
                                                                                            partials, rows, columns);
}

void BiasGelu(bf16* out, bf16* gelu_pre, const bf16* bias, int64_t N, int OC, cudaStream_t stream) {
  if (N * OC == 0 || (bias == nullptr && gelu_pre == nullptr)) return;
  BiasGeluKernel<<<Blocks(N * OC), kThreads, 0, stream>>>(out, gelu_pre, bias, N * OC, OC);
  CheckLaunch("MatmulForward (bias, GELU)", {{"N", N}, {"OC", OC}});
}

void GeluBackwardInPlace(bf16* dinp, const bf16* gelu_pre, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  GeluBackwardKernel<<<Blocks(n), kThreads, 0, stream>>>(dinp, gelu_pre, n);
  CheckLaunch("MatmulBackward (GELU gradient)", {{"elements", n}});
}

}  // namespace meshtrain::kernels::cuda
