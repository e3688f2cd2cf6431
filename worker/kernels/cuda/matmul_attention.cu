// The matrix products of kernels.h through cuBLAS: bf16 inputs, fp32 compute, and
// attention as batched products around our own permutes and causal softmax.
//
// cuBLAS is column-major; a row-major (R,C) array is its (C,R) array with leading
// dimension C, so each product below is written for the transposes.

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

constexpr size_t kWorkspaceBytes = size_t{32} << 20;  // what cuBLAS recommends for Hopper

void CheckBlas(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS) {
    throw runtime::cuda::CudaError(std::string("cuBLAS ") + what + ": " + cublasGetStatusString(status));
  }
}

// C (m,n) = alpha * op(A) op(B) + beta * C, column-major, bf16 A and B, fp32 compute.
void Gemm(cublasHandle_t handle, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, float alpha,
          const bf16* A, int lda, const bf16* B, int ldb, float beta, void* C, cudaDataType c_type, int ldc,
          const char* what) {
  CheckBlas(cublasGemmEx(handle, ta, tb, m, n, k, &alpha, A, CUDA_R_16BF, lda, B, CUDA_R_16BF, ldb, &beta, C, c_type,
                         ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
            what);
}

void BatchedGemm(cublasHandle_t handle, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, float alpha,
                 const bf16* A, int lda, int64_t stride_a, const bf16* B, int ldb, int64_t stride_b, bf16* C, int ldc,
                 int64_t stride_c, int batches, const char* what) {
  const float beta = 0;
  CheckBlas(cublasGemmStridedBatchedEx(handle, ta, tb, m, n, k, &alpha, A, CUDA_R_16BF, lda, stride_a, B, CUDA_R_16BF,
                                       ldb, stride_b, &beta, C, CUDA_R_16BF, ldc, stride_c, batches,
                                       CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
            what);
}

__global__ void AddBiasKernel(bf16* out, const bf16* bias, int64_t N, int OC) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < N * OC) out[i] = __float2bfloat16(__bfloat162float(out[i]) + __bfloat162float(bias[i % OC]));
}

// dbias[oc] += sum over rows of dout[row][oc]: 32 columns per block, 8 row strides.
__global__ void BiasBackwardKernel(float* dbias, const bf16* dout, int N, int OC) {
  __shared__ float partial[kWarpsPerBlock][kWarp];
  const int oc = blockIdx.x * kWarp + threadIdx.x % kWarp;
  const int lane_row = threadIdx.x / kWarp;
  float sum = 0;
  if (oc < OC) {
    for (int row = blockIdx.y * kWarpsPerBlock + lane_row; row < N; row += gridDim.y * kWarpsPerBlock) {
      sum += __bfloat162float(dout[int64_t(row) * OC + oc]);
    }
  }
  partial[lane_row][threadIdx.x % kWarp] = sum;
  __syncthreads();
  if (lane_row == 0 && oc < OC) {
    for (int r = 1; r < kWarpsPerBlock; ++r) sum += partial[r][threadIdx.x];
    atomicAdd(&dbias[oc], sum);
  }
}

// The offset, in a token-major (B,T,`parts`,NH,HS) array, of element i of a
// head-major (B,NH,T,HS) one.
__device__ int64_t TokenMajor(int64_t i, int T, int NH, int HS, int parts) {
  const int64_t d = i % HS, t = i / HS % T, h = i / (int64_t(HS) * T) % NH, b = i / (int64_t(HS) * T * NH);
  return ((b * T + t) * parts * NH + h) * HS + d;
}

// inp (B,T,3,NH,HS) -> q, k, v, each (B,NH,T,HS), one after another in qkvr.
__global__ void PermuteKernel(bf16* qkvr, const bf16* inp, int B, int T, int NH, int HS) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t per = int64_t(B) * NH * T * HS;
  if (i >= per) return;
  const int C = NH * HS;
  const bf16* row = inp + TokenMajor(i, T, NH, HS, 3);
  qkvr[i] = row[0];
  qkvr[per + i] = row[C];
  qkvr[2 * per + i] = row[2 * C];
}

// Copies between head-major (B,NH,T,HS) and token-major (B,T,NH,HS): with to_heads,
// `from` is token-major and `to` head-major; without, the other way round.
__global__ void HeadsKernel(bf16* to, const bf16* from, int B, int T, int NH, int HS, bool to_heads) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;  // index in (B,NH,T,HS)
  if (i >= int64_t(B) * NH * T * HS) return;
  const int64_t j = TokenMajor(i, T, NH, HS, 1);
  if (to_heads) {
    to[i] = from[j];
  } else {
    to[j] = from[i];
  }
}

// dinp (B,T,3,NH,HS) += dq, dk, dv (each (B,NH,T,HS), one after another in dqkvr).
__global__ void UnpermuteAddKernel(bf16* dinp, const bf16* dqkvr, int B, int T, int NH, int HS) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t per = int64_t(B) * NH * T * HS;
  if (i >= per) return;
  const int C = NH * HS;
  bf16* row = dinp + TokenMajor(i, T, NH, HS, 3);
  for (int part = 0; part < 3; ++part) {
    row[part * C] = __float2bfloat16(__bfloat162float(row[part * C]) + __bfloat162float(dqkvr[part * per + i]));
  }
}

// att rows (B*NH*T of T): softmax over keys 0..t of the scaled scores, zero above.
__global__ void CausalSoftmaxKernel(bf16* att, int64_t rows, int T) {
  const int64_t row = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (row >= rows) return;
  const int t = int(row % T);
  bf16* x = att + row * T;
  float largest = -INFINITY;
  for (int j = lane; j <= t; j += kWarp) largest = fmaxf(largest, __bfloat162float(x[j]));
  largest = WarpMax(largest);
  float sum = 0;
  for (int j = lane; j <= t; j += kWarp) sum += expf(__bfloat162float(x[j]) - largest);
  const float inv = 1.0f / WarpSum(sum);
  for (int j = lane; j < T; j += kWarp) {
    x[j] = __float2bfloat16(j <= t ? expf(__bfloat162float(x[j]) - largest) * inv : 0.0f);
  }
}

// datt -> dpreatt in place: att * (datt - sum(att * datt)) on keys 0..t, zero above.
__global__ void CausalSoftmaxBackwardKernel(bf16* datt, const bf16* att, int64_t rows, int T) {
  const int64_t row = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (row >= rows) return;
  const int t = int(row % T);
  bf16* d = datt + row * T;
  const bf16* a = att + row * T;
  float dot = 0;
  for (int j = lane; j <= t; j += kWarp) dot += __bfloat162float(a[j]) * __bfloat162float(d[j]);
  dot = WarpSum(dot);
  for (int j = lane; j < T; j += kWarp) {
    d[j] = __float2bfloat16(j <= t ? __bfloat162float(a[j]) * (__bfloat162float(d[j]) - dot) : 0.0f);
  }
}

}  // namespace

Blas::Blas() {
  CheckBlas(cublasCreate(&handle_), "cublasCreate");
  runtime::cuda::Check(cudaMalloc(&workspace_, kWorkspaceBytes), "cudaMalloc of the cuBLAS workspace");
  CheckBlas(cublasSetWorkspace(handle_, workspace_, kWorkspaceBytes), "cublasSetWorkspace");
}

Blas::~Blas() {
  if (handle_ != nullptr) cublasDestroy(handle_);
  if (workspace_ != nullptr) cudaFree(workspace_);
}

cublasHandle_t Blas::Bind(cudaStream_t stream) {
  CheckBlas(cublasSetStream(handle_, stream), "cublasSetStream");
  return handle_;
}

void MatmulForward(Blas& blas, bf16* out, const bf16* inp, const bf16* weight, const bf16* bias, int N, int C,
                   int OC, cudaStream_t stream) {
  if (N == 0) return;
  // out^T (OC,N) = weight^T^T (OC,C) . inp^T (C,N)
  Gemm(blas.Bind(stream), CUBLAS_OP_T, CUBLAS_OP_N, OC, N, C, 1.0f, weight, C, inp, C, 0.0f, out, CUDA_R_16BF, OC,
       "matmul forward");
  if (bias != nullptr) {
    AddBiasKernel<<<Blocks(int64_t(N) * OC), kThreads, 0, stream>>>(out, bias, N, OC);
    CheckLaunch("AddBias");
  }
}

void MatmulBackward(Blas& blas, bf16* dinp, float* dweight, float* dbias, const bf16* dout, const bf16* inp,
                    const bf16* weight, int N, int C, int OC, cudaStream_t stream) {
  if (N == 0) return;
  cublasHandle_t handle = blas.Bind(stream);
  // dinp^T (C,N) += weight^T (C,OC) . dout^T (OC,N)
  Gemm(handle, CUBLAS_OP_N, CUBLAS_OP_N, C, N, OC, 1.0f, weight, C, dout, OC, 1.0f, dinp, CUDA_R_16BF, C,
       "matmul backward (input)");
  // dweight^T (C,OC) += inp^T (C,N) . dout (N,OC), accumulated in fp32
  Gemm(handle, CUBLAS_OP_N, CUBLAS_OP_T, C, OC, N, 1.0f, inp, C, dout, OC, 1.0f, dweight, CUDA_R_32F, C,
       "matmul backward (weight)");
  if (dbias != nullptr) {
    const dim3 grid((OC + kWarp - 1) / kWarp, std::min(64, Blocks(N, kWarpsPerBlock)));
    BiasBackwardKernel<<<grid, kThreads, 0, stream>>>(dbias, dout, N, OC);
    CheckLaunch("BiasBackward");
  }
}

void AttentionForward(Blas& blas, bf16* out, bf16* qkvr, bf16* att, bf16* heads, const bf16* inp, int B, int T,
                      int C, int NH, cudaStream_t stream) {
  if (B == 0 || T == 0) return;
  const int HS = C / NH;
  const int64_t per = int64_t(B) * NH * T * HS, tt = int64_t(T) * T, rows = int64_t(B) * NH * T, ths = int64_t(T) * HS;
  const bf16 *q = qkvr, *k = qkvr + per, *v = qkvr + 2 * per;
  PermuteKernel<<<Blocks(per), kThreads, 0, stream>>>(qkvr, inp, B, T, NH, HS);
  CheckLaunch("Permute");
  cublasHandle_t handle = blas.Bind(stream);
  // Per head, att (T,T) = scale * q k^T; as column-major: att^T = k . q^T.
  BatchedGemm(handle, CUBLAS_OP_T, CUBLAS_OP_N, T, T, HS, 1.0f / std::sqrt(float(HS)), k, HS, ths, q, HS, ths, att, T,
              tt, B * NH, "attention scores");
  CausalSoftmaxKernel<<<Blocks(rows, kWarpsPerBlock), kThreads, 0, stream>>>(att, rows, T);
  CheckLaunch("CausalSoftmax");
  // heads (T,HS) = att v; as column-major: heads^T = v^T . att^T.
  BatchedGemm(handle, CUBLAS_OP_N, CUBLAS_OP_N, HS, T, T, 1.0f, v, HS, ths, att, T, tt, heads, HS, ths, B * NH,
              "attention values");
  HeadsKernel<<<Blocks(per), kThreads, 0, stream>>>(out, heads, B, T, NH, HS, false);
  CheckLaunch("Heads");
}

void AttentionBackward(Blas& blas, bf16* dinp, bf16* dqkvr, bf16* datt, bf16* dy, const bf16* dout,
                       const bf16* qkvr, const bf16* att, int B, int T, int C, int NH, cudaStream_t stream) {
  if (B == 0 || T == 0) return;
  const int HS = C / NH;
  const int64_t per = int64_t(B) * NH * T * HS, tt = int64_t(T) * T, rows = int64_t(B) * NH * T, ths = int64_t(T) * HS;
  const bf16 *q = qkvr, *k = qkvr + per, *v = qkvr + 2 * per;
  bf16 *dq = dqkvr, *dk = dqkvr + per, *dv = dqkvr + 2 * per;
  const float scale = 1.0f / std::sqrt(float(HS));
  HeadsKernel<<<Blocks(per), kThreads, 0, stream>>>(dy, dout, B, T, NH, HS, true);
  CheckLaunch("Heads");
  cublasHandle_t handle = blas.Bind(stream);
  // datt (T,T) = dy v^T; column-major: datt^T = v . dy^T.
  BatchedGemm(handle, CUBLAS_OP_T, CUBLAS_OP_N, T, T, HS, 1.0f, v, HS, ths, dy, HS, ths, datt, T, tt, B * NH,
              "attention backward (probabilities)");
  // dv (T,HS) = att^T dy; column-major: dv^T = dy^T . att.
  BatchedGemm(handle, CUBLAS_OP_N, CUBLAS_OP_T, HS, T, T, 1.0f, dy, HS, ths, att, T, tt, dv, HS, ths, B * NH,
              "attention backward (values)");
  CausalSoftmaxBackwardKernel<<<Blocks(rows, kWarpsPerBlock), kThreads, 0, stream>>>(datt, att, rows, T);
  CheckLaunch("CausalSoftmaxBackward");
  // dq (T,HS) = scale * dpreatt k; column-major: dq^T = k^T . dpreatt^T.
  BatchedGemm(handle, CUBLAS_OP_N, CUBLAS_OP_N, HS, T, T, scale, k, HS, ths, datt, T, tt, dq, HS, ths, B * NH,
              "attention backward (queries)");
  // dk (T,HS) = scale * dpreatt^T q; column-major: dk^T = q^T . dpreatt.
  BatchedGemm(handle, CUBLAS_OP_N, CUBLAS_OP_T, HS, T, T, scale, q, HS, ths, datt, T, tt, dk, HS, ths, B * NH,
              "attention backward (keys)");
  UnpermuteAddKernel<<<Blocks(per), kThreads, 0, stream>>>(dinp, dqkvr, B, T, NH, HS);
  CheckLaunch("UnpermuteAdd");
}

}  // namespace meshtrain::kernels::cuda
