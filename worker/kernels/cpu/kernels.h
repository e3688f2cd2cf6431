// GPT-2 layers on the CPU, as forward/backward pairs of plain functions (llm.c style).
//
// Outputs come first; backward functions *accumulate* (+=) into gradients named d...,
// so callers zero them once per step. Shapes are in the comments: B batch, T time,
// C channels, OC output channels, NH heads, V vocabulary. Arrays are row-major and
// contiguous. Each function is instantiated for float (the training path) and
// double (the reference that gradient checks use); matrix products go through
// OpenBLAS (cblas_sgemm / cblas_dgemm), the rest are loops parallel over B*T.
// Thread-safety: the functions share no state; calls on disjoint outputs may run concurrently.

#pragma once

#include <climits>
#include <cstdint>

namespace meshtrain::kernels::cpu {

// out (B,T,C) = wte[inp] + wpe[t]; inp (B,T) token ids, wte (V,C), wpe (maxT,C).
// With a vocabulary slice (tensor parallelism), wte holds rows [v_begin, v_end) and a
// token outside them contributes 0; wpe may be null (0): the slices' sum is the whole.
template <class T>
void EncoderForward(T* out, const int32_t* inp, const T* wte, const T* wpe, int B, int Tn, int C, int v_begin = 0,
                    int v_end = INT32_MAX);
// dwte (rows [v_begin, v_end)) and dwpe += the gradient of EncoderForward.
template <class T>
void EncoderBackward(T* dwte, T* dwpe, const T* dout, const int32_t* inp, int B, int Tn, int C, int v_begin = 0,
                     int v_end = INT32_MAX);

// out (B,T,C) = (inp - mean) * rstd * weight + bias; mean, rstd (B,T) saved for backward
template <class T>
void LayerNormForward(T* out, T* mean, T* rstd, const T* inp, const T* weight, const T* bias, int B, int Tn, int C);
template <class T>
void LayerNormBackward(T* dinp, T* dweight, T* dbias, const T* dout, const T* inp, const T* weight, const T* mean,
                       const T* rstd, int B, int Tn, int C);

// out (B,T,OC) = inp (B,T,C) @ weight(OC,C)^T + bias (OC); bias may be null
template <class T>
void MatmulForward(T* out, const T* inp, const T* weight, const T* bias, int B, int Tn, int C, int OC);
template <class T>
void MatmulBackward(T* dinp, T* dweight, T* dbias, const T* dout, const T* inp, const T* weight, int B, int Tn, int C,
                    int OC);

// Causal self-attention. inp (B,T,3C) holds q, k, v; out (B,T,C);
// preatt, att (B,NH,T,T) are the scores before and after softmax, saved for backward.
template <class T>
void AttentionForward(T* out, T* preatt, T* att, const T* inp, int B, int Tn, int C, int NH);
template <class T>
void AttentionBackward(T* dinp, T* dpreatt, T* datt, const T* dout, const T* inp, const T* att, int B, int Tn, int C,
                       int NH);

// out = gelu(inp), the tanh approximation; N elements
template <class T>
void GeluForward(T* out, const T* inp, int64_t N);
template <class T>
void GeluBackward(T* dinp, const T* inp, const T* dout, int64_t N);

// out = inp1 + inp2; N elements
template <class T>
void ResidualForward(T* out, const T* inp1, const T* inp2, int64_t N);
template <class T>
void ResidualBackward(T* dinp1, T* dinp2, const T* dout, int64_t N);

// probs (B,T,V) = softmax(logits); losses (B,T) = -log probs[target]
template <class T>
void SoftmaxCrossEntropyForward(T* probs, T* losses, const T* logits, const int32_t* targets, int B, int Tn, int V);
// The softmax over a vocabulary split in slices (tensor parallelism), without the whole
// logits on one rank. Each rank computes stats (B*T,3) of its slice logits (B,T,V)
// holding [v_begin, v_begin + V): the max, the sum of exp(logit - max), and the target's
// logit (0 if another slice holds it; targets may be null). Given every slice's stats
// (slices, B*T, 3), VocabSliceSoftmax writes this slice's probs (B,T,V) and, with
// targets, losses (B,T) = log(sum) + max - target logit, the same on every rank.
template <class T>
void VocabSliceStats(T* stats, const T* logits, const int32_t* targets, int B, int Tn, int V, int v_begin);
template <class T>
void VocabSliceSoftmax(T* probs, T* losses, const T* logits, const T* all_stats, int slices, int B, int Tn, int V);
// dlogits (B,T,V) += (probs - onehot(target)) * dloss, dloss the same for every position;
// the logits are vocabulary entries [v_begin, v_begin + V)
template <class T>
void SoftmaxCrossEntropyBackward(T* dlogits, const T* probs, const int32_t* targets, T dloss, int B, int Tn, int V,
                                 int v_begin = 0);

// Inverted dropout in place: x (rows, width) *= keep / (1 - p), where element (i, j) is
// element (first_row + i, first_column + j) of a tensor with row_stride columns, and
// keep = DropoutKeeps(key, its index in that tensor). The mask is a pure function of the
// key and the index, so every slice of a tensor (a micro-batch's rank, a TP rank's
// columns) drops what the whole tensor drops, and the backward (the same call on the
// gradient) needs nothing saved.
template <class T>
void Dropout(T* x, int64_t rows, int width, float p, uint64_t key, int64_t first_row, int64_t row_stride,
             int64_t first_column);
// Whether element `index` under `key` is kept at drop probability p.
bool DropoutKeeps(uint64_t key, uint64_t index, float p);
// A key from a parent key and a counter: the step, the micro-batch, the layer, the site.
uint64_t MixKey(uint64_t key, uint64_t counter);

// One AdamW step on N parameters with decoupled weight decay; t counts steps from 1.
void AdamWUpdate(float* params, const float* grads, float* m, float* v, int64_t N, float lr, float beta1, float beta2,
                 float eps, float weight_decay, int64_t t);

}  // namespace meshtrain::kernels::cpu
