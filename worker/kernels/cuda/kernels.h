// GPT-2 layers on CUDA in bf16 with fp32 accumulation: the mixed-precision twins of
// kernels/cpu (DESIGN.md, "Mixed precision").
//
// Activations and their gradients are bf16; LayerNorm statistics, losses, parameter
// gradients, master weights and optimizer state are fp32. Shapes follow kernels/cpu
// (N = B*T rows where a layer does not care about sequences). As there, backward
// functions *accumulate* (+=) into every d... output. Matrix products go through
// cuBLAS (bf16 inputs, fp32 compute); everything else is our own kernels. Everything is
// enqueued on `stream` and returns at once; launch errors throw runtime::cuda::CudaError.
// Sums into parameter gradients use atomics, so they are not bitwise reproducible.
// Every function has its CPU reference in kernels/cpu; tests/gpu compares the two.
// Thread-safety: a Blas handle belongs to one host thread at a time; the free
// functions share no state.

#pragma once

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace meshtrain::kernels::cuda {

using bf16 = __nv_bfloat16;

// A cuBLAS handle with its workspace, bound to one stream per call.
class Blas {
 public:
  Blas();
  ~Blas();
  Blas(const Blas&) = delete;
  Blas& operator=(const Blas&) = delete;
  cublasHandle_t Bind(cudaStream_t stream);

 private:
  cublasHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
};

// out (N,C) = wte[inp] + wpe[t], t = row % T; inp (N) token ids, wte (V,C), wpe (maxT,C)
void EncoderForward(bf16* out, const int32_t* inp, const bf16* wte, const bf16* wpe, int N, int T, int C,
                    cudaStream_t stream);
// dwte (V,C) += scatter of dout by token, dwpe (maxT,C) += dout summed over sequences
void EncoderBackward(float* dwte, float* dwpe, const bf16* dout, const int32_t* inp, int N, int T, int C,
                     cudaStream_t stream);

// out (N,C) = (inp - mean) * rstd * weight + bias; mean, rstd (N) saved for backward
void LayerNormForward(bf16* out, float* mean, float* rstd, const bf16* inp, const bf16* weight, const bf16* bias,
                      int N, int C, cudaStream_t stream);
void LayerNormBackward(bf16* dinp, float* dweight, float* dbias, const bf16* dout, const bf16* inp,
                       const bf16* weight, const float* mean, const float* rstd, int N, int C, cudaStream_t stream);

// out (N,OC) = inp (N,C) @ weight (OC,C)^T + bias (OC); bias may be null
void MatmulForward(Blas& blas, bf16* out, const bf16* inp, const bf16* weight, const bf16* bias, int N, int C,
                   int OC, cudaStream_t stream);
// dinp (N,C) += dout @ weight; dweight (OC,C) += dout^T @ inp; dbias (OC) += column sums
// of dout (skipped when null)
void MatmulBackward(Blas& blas, bf16* dinp, float* dweight, float* dbias, const bf16* dout, const bf16* inp,
                    const bf16* weight, int N, int C, int OC, cudaStream_t stream);

// Causal self-attention, NH heads of HS = C/NH. inp (B,T,3C) holds q, k, v.
// qkvr (3,B,NH,T,HS) keeps q, k, v head-major and att (B,NH,T,T) the probabilities,
// both for backward; out (B,T,C). Scratch: heads (B,NH,T,HS).
void AttentionForward(Blas& blas, bf16* out, bf16* qkvr, bf16* att, bf16* heads, const bf16* inp, int B, int T,
                      int C, int NH, cudaStream_t stream);
// dinp (B,T,3C) += the gradient through attention. Scratch: dqkvr (3,B,NH,T,HS),
// datt (B,NH,T,T), dy (B,NH,T,HS).
void AttentionBackward(Blas& blas, bf16* dinp, bf16* dqkvr, bf16* datt, bf16* dy, const bf16* dout,
                       const bf16* qkvr, const bf16* att, int B, int T, int C, int NH, cudaStream_t stream);

// out = gelu(inp), the tanh approximation; dinp += gelu'(inp) * dout. N elements.
void GeluForward(bf16* out, const bf16* inp, int64_t N, cudaStream_t stream);
void GeluBackward(bf16* dinp, const bf16* inp, const bf16* dout, int64_t N, cudaStream_t stream);

// out = inp1 + inp2; N elements
void ResidualForward(bf16* out, const bf16* inp1, const bf16* inp2, int64_t N, cudaStream_t stream);

// Fused softmax and cross-entropy over logits (N,V): losses (N) = -log softmax[target].
// With dlogits, also writes dlogits (N,V) = (softmax - onehot(target)) * dloss, which
// may be `logits` itself (the probabilities are never stored). Targets must lie in [0, V).
void CrossEntropy(float* losses, bf16* dlogits, const bf16* logits, const int32_t* targets, float dloss, int N,
                  int V, cudaStream_t stream);

// *sum += the sum of squares of grads (N); *sum must be zeroed by the caller.
void AddSquares(float* sum, const float* grads, int64_t N, cudaStream_t stream);

// AdamW on fp32 master weights with decoupled weight decay; t counts steps from 1.
// grads are multiplied by *grad_scale (a device scalar: clipping without a host sync,
// null for 1), and the updated master weights are written to params as bf16.
void AdamWUpdate(float* master, bf16* params, const float* grads, float* m, float* v, int64_t N, float lr,
                 float beta1, float beta2, float eps, float weight_decay, int64_t t, const float* grad_scale,
                 cudaStream_t stream);

// *scale = min(1, max_norm / sqrt(*sum_of_squares)): the clipping factor, on the device.
void ClipScale(float* scale, const float* sum_of_squares, float max_norm, cudaStream_t stream);

// out = bf16(in); N elements
void ToBf16(bf16* out, const float* in, int64_t N, cudaStream_t stream);

}  // namespace meshtrain::kernels::cuda
