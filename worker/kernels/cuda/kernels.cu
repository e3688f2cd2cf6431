// The elementwise, normalisation, loss and optimizer kernels of kernels.h. One thread
// per element for elementwise work; one warp per row for row reductions, reading bf16
// and reducing in fp32.

#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "worker/kernels/cuda/common.cuh"
#include "worker/kernels/cuda/kernels.h"
#include "worker/runtime/cuda.h"

namespace meshtrain::kernels::cuda {
namespace {

using namespace detail;

// Enough blocks to fill an H100 a few times over; each adds its partial sums once.
constexpr int kLayerNormBackwardBlocks = 512;


// ---- encoder ----

__global__ void EncoderForwardKernel(bf16* out, const int32_t* inp, const bf16* wte, const bf16* wpe, int N, int T,
                                     int C) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= int64_t(N) * C) return;
  const int row = int(i / C), c = int(i % C);
  const int t = row % T;
  out[i] = __float2bfloat16(__bfloat162float(wte[int64_t(inp[row]) * C + c]) + __bfloat162float(wpe[int64_t(t) * C + c]));
}

__global__ void EncoderBackwardKernel(float* dwte, float* dwpe, const bf16* dout, const int32_t* inp, int N, int T,
                                      int C) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= int64_t(N) * C) return;
  const int row = int(i / C), c = int(i % C);
  const float d = __bfloat162float(dout[i]);
  atomicAdd(&dwte[int64_t(inp[row]) * C + c], d);
  atomicAdd(&dwpe[int64_t(row % T) * C + c], d);
}

// ---- LayerNorm: one warp per row ----

__global__ void LayerNormForwardKernel(bf16* out, float* mean, float* rstd, const bf16* inp, const bf16* weight,
                                       const bf16* bias, int N, int C) {
  const int row = blockIdx.x * kWarpsPerBlock + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (row >= N) return;
  const bf16* x = inp + int64_t(row) * C;
  float sum = 0;
  for (int c = lane; c < C; c += kWarp) sum += __bfloat162float(x[c]);
  const float m = WarpSum(sum) / C;
  float squares = 0;
  for (int c = lane; c < C; c += kWarp) {
    const float d = __bfloat162float(x[c]) - m;
    squares += d * d;
  }
  const float s = rsqrtf(WarpSum(squares) / C + 1e-5f);
  bf16* y = out + int64_t(row) * C;
  for (int c = lane; c < C; c += kWarp) {
    const float normed = (__bfloat162float(x[c]) - m) * s;
    y[c] = __float2bfloat16(normed * __bfloat162float(weight[c]) + __bfloat162float(bias[c]));
  }
  if (lane == 0) {
    mean[row] = m;
    rstd[row] = s;
  }
}

// Warps stride over rows; each block sums its rows' dweight and dbias in shared memory
// (2C floats) and adds them to the global ones once, not once per row.
__global__ void LayerNormBackwardKernel(bf16* dinp, float* dweight, float* dbias, const bf16* dout, const bf16* inp,
                                        const bf16* weight, const float* mean, const float* rstd, int N, int C) {
  extern __shared__ float sums[];  // dweight (C), then dbias (C)
  for (int c = threadIdx.x; c < 2 * C; c += blockDim.x) sums[c] = 0;
  __syncthreads();
  const int lane = threadIdx.x % kWarp;
  for (int row = blockIdx.x * kWarpsPerBlock + threadIdx.x / kWarp; row < N; row += gridDim.x * kWarpsPerBlock) {
    const bf16* x = inp + int64_t(row) * C;
    const bf16* dy = dout + int64_t(row) * C;
    const float m = mean[row], s = rstd[row];
    // dnorm = dout * weight; dinp = s * (dnorm - mean(dnorm) - norm * mean(dnorm * norm))
    float dnorm_sum = 0, dnorm_norm_sum = 0;
    for (int c = lane; c < C; c += kWarp) {
      const float norm = (__bfloat162float(x[c]) - m) * s;
      const float dnorm = __bfloat162float(dy[c]) * __bfloat162float(weight[c]);
      dnorm_sum += dnorm;
      dnorm_norm_sum += dnorm * norm;
    }
    const float dnorm_mean = WarpSum(dnorm_sum) / C, dnorm_norm_mean = WarpSum(dnorm_norm_sum) / C;
    bf16* dx = dinp + int64_t(row) * C;
    for (int c = lane; c < C; c += kWarp) {
      const float norm = (__bfloat162float(x[c]) - m) * s;
      const float d = __bfloat162float(dy[c]);
      atomicAdd(&sums[c], norm * d);
      atomicAdd(&sums[C + c], d);
      const float dnorm = d * __bfloat162float(weight[c]);
      dx[c] = __float2bfloat16(__bfloat162float(dx[c]) + s * (dnorm - dnorm_mean - norm * dnorm_norm_mean));
    }
  }
  __syncthreads();
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    atomicAdd(&dweight[c], sums[c]);
    atomicAdd(&dbias[c], sums[C + c]);
  }
}

// ---- elementwise ----

constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2/pi)

__global__ void GeluForwardKernel(bf16* out, const bf16* inp, int64_t N) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= N) return;
  const float x = __bfloat162float(inp[i]);
  out[i] = __float2bfloat16(0.5f * x * (1.0f + tanhf(kGeluScale * (x + 0.044715f * x * x * x))));
}

__global__ void GeluBackwardKernel(bf16* dinp, const bf16* inp, const bf16* dout, int64_t N) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= N) return;
  const float x = __bfloat162float(inp[i]);
  const float tanh_out = tanhf(kGeluScale * (x + 0.044715f * x * x * x));
  const float sech2 = 1.0f - tanh_out * tanh_out;
  const float local = 0.5f * (1.0f + tanh_out) + x * 0.5f * sech2 * kGeluScale * (1.0f + 3.0f * 0.044715f * x * x);
  dinp[i] = __float2bfloat16(__bfloat162float(dinp[i]) + local * __bfloat162float(dout[i]));
}

__global__ void ResidualForwardKernel(bf16* out, const bf16* inp1, const bf16* inp2, int64_t N) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < N) out[i] = __float2bfloat16(__bfloat162float(inp1[i]) + __bfloat162float(inp2[i]));
}

__global__ void ToBf16Kernel(bf16* out, const float* in, int64_t N) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < N) out[i] = __float2bfloat16(in[i]);
}

// ---- softmax cross-entropy: one block per row ----

__device__ float BlockReduce(float value, bool is_max) {
  __shared__ float partial[kWarpsPerBlock];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  value = is_max ? WarpMax(value) : WarpSum(value);
  __syncthreads();  // `partial` may still be read by a previous reduction
  if (lane == 0) partial[warp] = value;
  __syncthreads();
  float result = partial[0];
  for (int w = 1; w < kWarpsPerBlock; ++w) result = is_max ? fmaxf(result, partial[w]) : result + partial[w];
  return result;
}

__global__ void CrossEntropyKernel(float* losses, bf16* dlogits, const bf16* logits, const int32_t* targets,
                                   float dloss, int V) {
  const int64_t row = blockIdx.x;
  const bf16* x = logits + row * V;
  float largest = -INFINITY;
  for (int v = threadIdx.x; v < V; v += blockDim.x) largest = fmaxf(largest, __bfloat162float(x[v]));
  largest = BlockReduce(largest, true);
  float sum = 0;
  for (int v = threadIdx.x; v < V; v += blockDim.x) sum += expf(__bfloat162float(x[v]) - largest);
  sum = BlockReduce(sum, false);
  const int target = targets[row];
  const float target_logit = __bfloat162float(x[target]);
  __syncthreads();  // every thread has read x[target] before dlogits (maybe x) is written
  if (threadIdx.x == 0) losses[row] = logf(sum) + largest - target_logit;
  if (dlogits == nullptr) return;
  bf16* dx = dlogits + row * V;
  for (int v = threadIdx.x; v < V; v += blockDim.x) {
    const float p = expf(__bfloat162float(x[v]) - largest) / sum;
    dx[v] = __float2bfloat16((p - (v == target ? 1.0f : 0.0f)) * dloss);
  }
}

// ---- optimizer ----

__global__ void AddSquaresKernel(float* sum, const float* grads, int64_t N) {
  float local = 0;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < N; i += int64_t(gridDim.x) * blockDim.x) {
    local += grads[i] * grads[i];
  }
  local = BlockReduce(local, false);
  if (threadIdx.x == 0) atomicAdd(sum, local);
}

__global__ void ClipScaleKernel(float* scale, const float* sum_of_squares, float max_norm) {
  const float norm = sqrtf(*sum_of_squares);
  *scale = (max_norm > 0 && norm > max_norm) ? max_norm / norm : 1.0f;
}

__global__ void AdamWKernel(float* master, bf16* params, const float* grads, float* m, float* v, int64_t N, float lr,
                            float beta1, float beta2, float eps, float weight_decay, float correction1,
                            float correction2, const float* grad_scale) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= N) return;
  const float g = grads[i] * (grad_scale ? *grad_scale : 1.0f);
  const float mi = beta1 * m[i] + (1.0f - beta1) * g;
  const float vi = beta2 * v[i] + (1.0f - beta2) * g * g;
  m[i] = mi;
  v[i] = vi;
  const float w = master[i];
  const float updated = w - lr * ((mi / correction1) / (sqrtf(vi / correction2) + eps) + weight_decay * w);
  master[i] = updated;
  params[i] = __float2bfloat16(updated);
}

}  // namespace

void EncoderForward(bf16* out, const int32_t* inp, const bf16* wte, const bf16* wpe, int N, int T, int C,
                    cudaStream_t stream) {
  if (N == 0) return;
  EncoderForwardKernel<<<Blocks(int64_t(N) * C), kThreads, 0, stream>>>(out, inp, wte, wpe, N, T, C);
  CheckLaunch("EncoderForward");
}

void EncoderBackward(float* dwte, float* dwpe, const bf16* dout, const int32_t* inp, int N, int T, int C,
                     cudaStream_t stream) {
  if (N == 0) return;
  EncoderBackwardKernel<<<Blocks(int64_t(N) * C), kThreads, 0, stream>>>(dwte, dwpe, dout, inp, N, T, C);
  CheckLaunch("EncoderBackward");
}

void LayerNormForward(bf16* out, float* mean, float* rstd, const bf16* inp, const bf16* weight, const bf16* bias,
                      int N, int C, cudaStream_t stream) {
  if (N == 0) return;
  LayerNormForwardKernel<<<Blocks(N, kWarpsPerBlock), kThreads, 0, stream>>>(out, mean, rstd, inp, weight, bias, N,
                                                                               C);
  CheckLaunch("LayerNormForward");
}

void LayerNormBackward(bf16* dinp, float* dweight, float* dbias, const bf16* dout, const bf16* inp,
                       const bf16* weight, const float* mean, const float* rstd, int N, int C, cudaStream_t stream) {
  if (N == 0) return;
  const int blocks = std::min(Blocks(N, kWarpsPerBlock), kLayerNormBackwardBlocks);
  LayerNormBackwardKernel<<<blocks, kThreads, 2 * C * sizeof(float), stream>>>(dinp, dweight, dbias, dout, inp,
                                                                                weight, mean, rstd, N, C);
  CheckLaunch("LayerNormBackward");
}

void GeluForward(bf16* out, const bf16* inp, int64_t N, cudaStream_t stream) {
  if (N == 0) return;
  GeluForwardKernel<<<Blocks(N), kThreads, 0, stream>>>(out, inp, N);
  CheckLaunch("GeluForward");
}

void GeluBackward(bf16* dinp, const bf16* inp, const bf16* dout, int64_t N, cudaStream_t stream) {
  if (N == 0) return;
  GeluBackwardKernel<<<Blocks(N), kThreads, 0, stream>>>(dinp, inp, dout, N);
  CheckLaunch("GeluBackward");
}

void ResidualForward(bf16* out, const bf16* inp1, const bf16* inp2, int64_t N, cudaStream_t stream) {
  if (N == 0) return;
  ResidualForwardKernel<<<Blocks(N), kThreads, 0, stream>>>(out, inp1, inp2, N);
  CheckLaunch("ResidualForward");
}

void ToBf16(bf16* out, const float* in, int64_t N, cudaStream_t stream) {
  if (N == 0) return;
  ToBf16Kernel<<<Blocks(N), kThreads, 0, stream>>>(out, in, N);
  CheckLaunch("ToBf16");
}

void CrossEntropy(float* losses, bf16* dlogits, const bf16* logits, const int32_t* targets, float dloss, int N,
                  int V, cudaStream_t stream) {
  if (N == 0) return;
  CrossEntropyKernel<<<N, kThreads, 0, stream>>>(losses, dlogits, logits, targets, dloss, V);
  CheckLaunch("CrossEntropy");
}

void AddSquares(float* sum, const float* grads, int64_t N, cudaStream_t stream) {
  if (N == 0) return;
  const int blocks = std::min(Blocks(N), 1024);
  AddSquaresKernel<<<blocks, kThreads, 0, stream>>>(sum, grads, N);
  CheckLaunch("AddSquares");
}

void ClipScale(float* scale, const float* sum_of_squares, float max_norm, cudaStream_t stream) {
  ClipScaleKernel<<<1, 1, 0, stream>>>(scale, sum_of_squares, max_norm);
  CheckLaunch("ClipScale");
}

void AdamWUpdate(float* master, bf16* params, const float* grads, float* m, float* v, int64_t N, float lr,
                 float beta1, float beta2, float eps, float weight_decay, int64_t t, const float* grad_scale,
                 cudaStream_t stream) {
  if (N == 0) return;
  const float correction1 = 1.0f - std::pow(beta1, float(t));
  const float correction2 = 1.0f - std::pow(beta2, float(t));
  AdamWKernel<<<Blocks(N), kThreads, 0, stream>>>(master, params, grads, m, v, N, lr, beta1, beta2, eps,
                                                  weight_decay, correction1, correction2, grad_scale);
  CheckLaunch("AdamWUpdate");
}

}  // namespace meshtrain::kernels::cuda
