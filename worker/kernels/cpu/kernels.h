// The model families' kernels on the CPU as plain functions over host arrays (llm.c style), the
// bodies of the CPU kernel tables (cpu_ops.h). Each keeps the contract of the operation
// of the same name in kernels/ops.h, which says what is written and what accumulated.
//
// They are templates over the stored type A of activations and compute copies and the
// type G that everything is computed and accumulated in: <float, float> for the CPU
// engine, <double, double> for the reference, and <bf16, float> for the emulation of the
// GPU, which reads bf16, computes in fp32 and rounds what it stores to bf16, as the CUDA
// kernels do. Products go through OpenBLAS (sgemm, dgemm); loops are parallel over rows
// with OpenMP, and every sum whose order could change the result (over rows into a
// parameter gradient, a norm, a loss) runs in a fixed order, so a run repeats bit for bit.
// Thread-safety: the functions share no state but per-thread scratch; calls on disjoint
// outputs may run concurrently.

#pragma once

#include <cstdint>

#include "worker/kernels/ops.h"

namespace meshtrain::kernels::cpu {

template <class A, class G>
void EncoderForward(A* out, const int32_t* tokens, const A* wte, const A* wpe, int B, int T, int C, int64_t v_begin,
                    int64_t v_rows);
template <class A, class G>
void EncoderBackward(G* dwte, G* dwpe, const A* dout, const int32_t* tokens, int B, int T, int C, int64_t v_begin,
                     int64_t v_rows);

template <class A, class G>
void LayerNormForward(A* out, G* mean, G* rstd, const A* inp, const A* weight, const A* bias, int64_t N, int C);
template <class A, class G>
void ResidualLayerNormForward(A* residual, A* out, G* mean, G* rstd, const A* a, const A* b, const A* weight,
                              const A* bias, int64_t N, int C);
template <class A, class G>
void LayerNormBackward(A* dinp, G* dweight, G* dbias, const A* dout, const A* inp, const A* weight, const G* mean,
                       const G* rstd, int64_t N, int C);

template <class A, class G>
void MatmulForward(A* out, A* gelu_pre, const A* inp, const A* weight, const A* bias, const A* residual, int64_t N,
                   int K, int OC);
template <class A, class G>
void MatmulBackward(A* dinp, G* dweight, G* dbias, const A* dout, const A* inp, const A* weight, const A* gelu_pre,
                    int64_t N, int K, int OC);

// The table's float8 products and amax (ops.h) over values stored as A: each operand
// taken as fp32, cast and multiplied as cpu/float8_matmul.h does, then MatmulForward's
// and MatmulBackward's epilogues in G.
template <class A, class G>
void Float8MatmulForward(A* out, A* gelu_pre, const A* inp, const float* inp_scale, const A* weight,
                         const float* weight_scale, const A* bias, const A* residual, int64_t N, int K, int OC,
                         Float8Recipe recipe);
template <class A, class G>
void Float8MatmulGradInput(A* dinp, const A* dout, const float* dout_scale, const A* weight, const float* weight_scale,
                           const A* gelu_pre, int64_t N, int K, int OC, Float8Recipe recipe);
template <class A, class G>
void Float8MatmulGradWeight(G* dweight, G* dbias, const A* dout, const float* dout_scale, const A* inp,
                            const float* inp_scale, int64_t N, int K, int OC, Float8Recipe recipe);
template <class A>
void Float8AmaxOf(float* amax, const A* x, int64_t rows, int64_t cols, Float8Scaling scaling);

// state: the probabilities (B,NH,T,T), masked entries 0.
template <class A, class G>
void AttentionForward(A* out, G* state, const A* qkv, int B, int T, int NH, int KVH, int HS);
template <class A, class G>
void AttentionBackward(A* dqkv, const A* dout, const A* qkv, const G* state, int B, int T, int NH, int KVH, int HS);

template <class A, class G>
void RmsNormForward(A* out, G* rstd, const A* inp, const A* weight, int64_t N, int C, float eps);
template <class A, class G>
void ResidualRmsNormForward(A* residual, A* out, G* rstd, const A* a, const A* b, const A* weight, int64_t N, int C,
                            float eps);
template <class A, class G>
void RmsNormBackward(A* dinp, G* dweight, const A* dout, const A* inp, const A* weight, const G* rstd, int64_t N,
                     int C);
template <class A, class G>
void HeadRmsNormForward(A* x, A* saved, G* rstd, const A* weight, int64_t N, int heads, int HS, int64_t stride,
                        float eps);
template <class A, class G>
void HeadRmsNormBackward(A* dx, G* dweight, const A* saved, const A* weight, const G* rstd, int64_t N, int heads,
                         int HS, int64_t stride);

// backward: rotates by the negative angle.
template <class A, class G>
void Rope(A* qkv, const G* cos, const G* sin, int B, int T, int NH, int KVH, int HS, bool backward);

template <class A, class G>
void SwiGluForward(A* out, const A* gate_up, int64_t N, int H);
template <class A, class G>
void SwiGluBackward(A* dgate_up, const A* dout, const A* gate_up, int64_t N, int H);

// Mixture of experts (moe.cc). counts of GroupedMatmul*: E row counts on the host.
template <class A, class G>
void RouterTopKForward(G* probs, int32_t* experts, G* weights, const A* logits, int64_t N, int E, int k,
                       bool renormalize);
template <class A, class G>
void RouterTopKBackward(A* dlogits, const G* dweights, const G* dprobs, const G* probs, const int32_t* experts,
                        int64_t N, int E, int k, bool renormalize);
void MoePermutePlan(int32_t* counts, int32_t* positions, const int32_t* experts, int64_t N, int k, int E);
template <class A, class G>
void MoePermute(A* xs, const A* x, const int32_t* positions, int64_t N, int k, int C);
template <class A, class G>
void MoePermuteBackward(A* dx, const A* dxs, const int32_t* positions, int64_t N, int k, int C);
template <class A, class G>
void MoeCombineForward(A* out, const A* ys, const G* weights, const int32_t* positions, const A* residual, int64_t N,
                       int k, int C);
template <class A, class G>
void MoeCombineBackward(A* dys, G* dweights, const A* dout, const A* ys, const G* weights, const int32_t* positions,
                        int64_t N, int k, int C);
template <class A, class G>
void GroupedMatmulForward(A* out, const A* inp, const A* weight, const int32_t* counts, int E, int K, int OC);
template <class A, class G>
void GroupedMatmulBackward(A* dinp, G* dweight, const A* dout, const A* inp, const A* weight, const int32_t* counts,
                           int E, int K, int OC);

template <class A, class G>
void Add(A* out, const A* a, const A* b, int64_t n);
template <class A, class G>
void Dropout(A* out, const A* in, int64_t rows, int width, float p, uint64_t key, int64_t first_row,
             int64_t row_stride, int64_t first_column);

template <class A, class G>
void CrossEntropy(G* losses, A* dlogits, const A* logits, const int32_t* targets, int64_t R, int64_t v_rows,
                  int64_t Vp, float dloss);
template <class A, class G>
void VocabSliceStats(G* stats, const A* logits, const int32_t* targets, int64_t R, int64_t v_rows, int64_t Vp,
                     int64_t v_begin);
template <class A, class G>
void VocabSliceCrossEntropy(G* losses, A* dlogits, const A* logits, const G* all_stats, int slices,
                            const int32_t* targets, int64_t R, int64_t v_rows, int64_t Vp, int64_t v_begin,
                            float dloss);
template <class G>
void AddLoss(double* sum, const G* losses, int64_t R, double scale);

template <class G>
void Accumulate(G* into, const G* from, int64_t n, float scale);
template <class A, class G>
void Cast(A* to, const G* from, int64_t n);
template <class G>
void SumSquares(double* sum, const G* grads, const ShardSegment* segments, int count);
void ClipScale(float* scale, const double* sum_of_squares, float max_norm);
template <class A, class G>
void AdamW(G* master, A* params, const G* grads, G* m, G* v, const ShardSegment* segments, int count,
           const AdamWStep& step, const float* clip_scale);

}  // namespace meshtrain::kernels::cpu
