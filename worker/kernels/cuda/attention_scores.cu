// The softmax steps of attention's scores path (launch.h), for the shapes cuDNN's fused
// attention refuses: one block per row of T scores, reductions in a fixed order; and the
// store of the key/value gradients it sums in fp32 over a group of query heads.

#include "worker/kernels/cuda/common.cuh"

namespace meshtrain::kernels::cuda {
namespace {

using namespace detail;

constexpr int kRowThreads = 128;

// Row r holds query position t = r % T: scores [0, t] take part, the rest are masked.
__global__ void CausalSoftmaxForwardKernel(float* __restrict__ probs, bf16* __restrict__ probs_bf16, int T) {
  const int64_t row = blockIdx.x;
  const int t = int(row % T);
  float* p = probs + row * T;
  float largest = -INFINITY;
  for (int k = threadIdx.x; k <= t; k += blockDim.x) largest = fmaxf(largest, p[k]);
  const float row_max = BlockMax(largest);
  float sum = 0;
  for (int k = threadIdx.x; k <= t; k += blockDim.x) sum += expf(p[k] - row_max);
  const float inverse = 1.0f / BlockSum(sum);
  for (int k = threadIdx.x; k < T; k += blockDim.x) {
    const float value = k <= t ? expf(p[k] - row_max) * inverse : 0.0f;
    p[k] = value;
    probs_bf16[row * T + k] = __float2bfloat16(value);
  }
}

__global__ void CausalSoftmaxBackwardKernel(bf16* __restrict__ dscores, bf16* __restrict__ probs_bf16,
                                            const float* __restrict__ dprobs, const float* __restrict__ probs, int T,
                                            float scale) {
  const int64_t row = blockIdx.x;
  const int t = int(row % T);
  const float* p = probs + row * T;
  const float* dp = dprobs + row * T;
  float dot = 0;
  for (int k = threadIdx.x; k <= t; k += blockDim.x) dot += p[k] * dp[k];
  dot = BlockSum(dot);
  for (int k = threadIdx.x; k < T; k += blockDim.x) {
    const float value = k <= t ? scale * p[k] * (dp[k] - dot) : 0.0f;
    dscores[row * T + k] = __float2bfloat16(value);
    probs_bf16[row * T + k] = __float2bfloat16(k <= t ? p[k] : 0.0f);
  }
}

// One thread per element: out[r * out_stride + c] = in[r * width + c] as bf16.
__global__ void StoreRowsKernel(bf16* __restrict__ out, int64_t out_stride, const float* __restrict__ in,
                                int64_t rows, int width) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * width) return;
  const int64_t row = i / width;
  const int column = int(i % width);
  out[row * out_stride + column] = __float2bfloat16(in[i]);
}

}  // namespace

void CausalSoftmaxForward(float* probs, bf16* probs_bf16, int64_t rows, int T, cudaStream_t stream) {
  if (rows == 0) return;
  CausalSoftmaxForwardKernel<<<rows, kRowThreads, 0, stream>>>(probs, probs_bf16, T);
  CheckLaunch("AttentionForward (softmax)", {{"rows", rows}, {"T", T}});
}

void CausalSoftmaxBackward(bf16* dscores, bf16* probs_bf16, const float* dprobs, const float* probs, int64_t rows,
                           int T, float scale, cudaStream_t stream) {
  if (rows == 0) return;
  CausalSoftmaxBackwardKernel<<<rows, kRowThreads, 0, stream>>>(dscores, probs_bf16, dprobs, probs, T, scale);
  CheckLaunch("AttentionBackward (softmax)", {{"rows", rows}, {"T", T}});
}

void StoreRows(bf16* out, int64_t out_stride, const float* in, int64_t rows, int width, cudaStream_t stream) {
  if (rows * width == 0) return;
  StoreRowsKernel<<<Blocks(rows * width), kThreads, 0, stream>>>(out, out_stride, in, rows, width);
  CheckLaunch("AttentionBackward (key/value gradients)", {{"rows", rows}, {"width", width}});
}

}  // namespace meshtrain::kernels::cuda
