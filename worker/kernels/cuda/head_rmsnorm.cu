// The per-head RMSNorm of q and k (launch.h; Qwen3's q_norm and k_norm): one warp per
// head. The forward keeps each head as it was and normalises it in place; the backward
// replaces each head's gradient in place, keeps each warp's dweight partial sums in
// shared memory (no atomics), adds the warps in order per block, and a second pass adds
// the blocks in order, so dweight repeats bit for bit, as RMSNorm's does (rmsnorm.cu).

#include <algorithm>
#include <stdexcept>
#include <string>

#include "worker/kernels/cuda/common.cuh"

namespace meshtrain::kernels::cuda {
namespace {

using namespace detail;

// Blocks of the backward's first pass: a constant, so that the order of its sums does not
// depend on the device.
constexpr int kHeadBackwardBlocks = 256;

__global__ void HeadRmsNormForwardKernel(bf16* x, bf16* __restrict__ saved, float* __restrict__ rstd,
                                         const bf16* __restrict__ weight, int64_t N, int heads, int HS,
                                         int64_t stride, float eps) {
  const int lane = threadIdx.x % kWarp;
  const int64_t head = int64_t(blockIdx.x) * (blockDim.x / kWarp) + threadIdx.x / kWarp;
  if (head >= N * heads) return;
  bf16* row = x + (head / heads) * stride + (head % heads) * HS;
  bf16* kept = saved + head * HS;
  float squares = 0;
  for (int i = lane; i < HS; i += kWarp) {
    const float v = __bfloat162float(row[i]);
    kept[i] = row[i];
    squares += v * v;
  }
  const float s = 1.0f / sqrtf(WarpSum(squares) / HS + eps);
  for (int i = lane; i < HS; i += kWarp) {
    row[i] = __float2bfloat16((__bfloat162float(kept[i]) * s) * __bfloat162float(weight[i]));
  }
  if (lane == 0) rstd[head] = s;
}

__global__ void HeadRmsNormBackwardKernel(bf16* dx, float* __restrict__ partials, const bf16* __restrict__ saved,
                                          const bf16* __restrict__ weight, const float* __restrict__ rstd,
                                          int64_t N, int heads, int HS, int64_t stride) {
  extern __shared__ float head_sums[];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, warps = blockDim.x / kWarp;
  for (int i = threadIdx.x; i < warps * HS; i += blockDim.x) head_sums[i] = 0;
  __syncthreads();
  float* dweight_sums = head_sums + int64_t(warp) * HS;
  for (int64_t head = int64_t(blockIdx.x) * warps + warp; head < N * heads; head += int64_t(gridDim.x) * warps) {
    bf16* d = dx + (head / heads) * stride + (head % heads) * HS;
    const bf16* x = saved + head * HS;
    const float s = rstd[head];
    float dot = 0;  // dx = s (dnorm - norm mean(dnorm norm)), dnorm = weight dy, norm = x s
    for (int i = lane; i < HS; i += kWarp) {
      dot += __bfloat162float(weight[i]) * __bfloat162float(d[i]) * (__bfloat162float(x[i]) * s);
    }
    const float mean = WarpSum(dot) / HS;
    for (int i = lane; i < HS; i += kWarp) {
      const float norm = __bfloat162float(x[i]) * s, dy = __bfloat162float(d[i]);
      dweight_sums[i] += norm * dy;
      d[i] = __float2bfloat16((__bfloat162float(weight[i]) * dy - norm * mean) * s);
    }
  }
  __syncthreads();
  float* block_partials = partials + int64_t(blockIdx.x) * HS;
  for (int i = threadIdx.x; i < HS; i += blockDim.x) {
    float total = head_sums[i];
    for (int w = 1; w < warps; ++w) total += head_sums[int64_t(w) * HS + i];
    block_partials[i] = total;
  }
}

}  // namespace

void HeadRmsNormForward(bf16* x, bf16* saved, float* rstd, const bf16* weight, int64_t N, int heads, int HS,
                        int64_t stride, float eps, cudaStream_t stream) {
  const int64_t rows = N * heads;
  if (rows == 0) return;
  const int per_block = kThreads / kWarp;
  HeadRmsNormForwardKernel<<<int(CeilDiv(rows, per_block)), kThreads, 0, stream>>>(x, saved, rstd, weight, N, heads,
                                                                                   HS, stride, eps);
  CheckLaunch("HeadRmsNormForward", {{"N", N}, {"heads", heads}, {"HS", HS}});
}

void HeadRmsNormBackward(bf16* dx, float* dweight, const bf16* saved, const bf16* weight, const float* rstd,
                         int64_t N, int heads, int HS, int64_t stride, float* partials, int64_t partial_capacity,
                         cudaStream_t stream) {
  const int64_t rows = N * heads;
  if (rows == 0) return;
  if (HS > kMaxHeadRmsNormChannels || HS > partial_capacity) {
    throw std::invalid_argument("HeadRmsNormBackward: HS = " + std::to_string(HS) + " exceeds the " +
                                std::to_string(std::min<int64_t>(kMaxHeadRmsNormChannels, partial_capacity)) +
                                " channels its kernel takes");
  }
  const int warps = kThreads / kWarp;
  const int blocks = int(std::min<int64_t>({CeilDiv(rows, warps), kHeadBackwardBlocks, partial_capacity / HS}));
  const size_t shared = size_t(warps) * size_t(HS) * sizeof(float);
  HeadRmsNormBackwardKernel<<<blocks, kThreads, shared, stream>>>(dx, partials, saved, weight, rstd, N, heads, HS,
                                                                  stride);
  CheckLaunch("HeadRmsNormBackward", {{"N", N}, {"heads", heads}, {"HS", HS}});
  // dweight[i] = the blocks' sums, in order.
  if (const cudaError_t status = cudaMemsetAsync(dweight, 0, size_t(HS) * sizeof(float), stream);
      status != cudaSuccess) {
    ThrowLaunchError(status, "HeadRmsNormBackward (zeroing dweight)", "HS=" + std::to_string(HS));
  }
  AddColumnSums(dweight, nullptr, HS, partials, blocks, HS, stream);
}

}  // namespace meshtrain::kernels::cuda
