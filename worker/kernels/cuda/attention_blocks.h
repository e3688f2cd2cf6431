// Attention by blocks on CUDA (kernels/ops.h, "Attention by blocks": ring context
// parallelism), the launchers behind the bf16 table's AttentionBlockForward,
// AttentionMerge, AttentionRowDot and AttentionBlockBackward. Internal to kernels/cuda;
// like launch.h it compiles as C++17 for nvcc and as C++20 for the table, so it mirrors
// kernels::AttentionBlock in a struct of its own (cuda_ops.cc copies it field by field).
//
// Plain kernels, not cuDNN: one warp per row (a query row of a head, or, for dk and dv, a
// key row of a key/value head), each lane holding HS/32 of the head's channels in
// registers, the keys (or query rows) walked in order with an online softmax in the
// forward, every sum in fp32 and nothing stored as bf16; warps of a block share their
// sequence and head, so K and V come mostly from cache. A row's sums run in a fixed
// order (warp butterflies, then keys in order): a run repeats bit for bit. The backward
// recomputes P, in two passes: dq a query row at a time, dk and dv a key row at a time
// (each summing over the query heads of its group, then over their rows), so no two
// warps add into one element.
//
// Every launcher enqueues on `stream`, returns at once, allocates nothing and never
// synchronizes the host; a failed launch throws (launch.h's ThrowLaunchError).
// REQUIRES: HS <= kMaxAttentionBlockHeadSize, KVH divides NH, Tq == Tk when causal.
// Thread-safety: launchers share no state.

#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "worker/kernels/cuda/launch.h"

namespace meshtrain::kernels::cuda {

constexpr int kMaxAttentionBlockHeadSize = 256;

// kernels::AttentionBlock: row t of sequence b of an operand at b * batch + t * row
// elements, head h's channels from h * HS; statistics (b, h, t) at b * batch + h * head + t.
struct BlockRows {
  int64_t row, batch;
};
struct BlockStats {
  int64_t head, batch;
};
struct AttentionBlockShape {
  int B, Tq, Tk, NH, KVH, HS;
  bool causal;  // query i sees keys j <= i; else every key
  BlockRows q, k, v, out;
  BlockStats stats;
  BlockRows dout, dq, dk, dv;
};

// out (shape.out) = the block's softmax(scale q k^T) v, lse (shape.stats) = its log-sum-exp
// (a row that sees no key: 0 and -inf).
void AttentionBlockForward(float* out, float* lse, const bf16* q, const bf16* k, const bf16* v,
                           const AttentionBlockShape& shape, cudaStream_t stream);
// (out, lse) = the exact combination of itself and (block_out, block_lse); lse = -inf is
// an empty result on either side.
void AttentionMerge(float* out, float* lse, const float* block_out, const float* block_lse,
                    const AttentionBlockShape& shape, cudaStream_t stream);
// D (shape.stats) = the per-head row sums of dout * out (both shape.dout).
void AttentionRowDot(float* D, const bf16* dout, const bf16* out, const AttentionBlockShape& shape,
                     cudaStream_t stream);
// dq += scale dS k, dk += scale dS^T q, dv += P^T dout, P from the final lse, dS with D.
void AttentionBlockBackward(float* dq, float* dk, float* dv, const bf16* dout, const bf16* q, const bf16* k,
                            const bf16* v, const float* lse, const float* D, const AttentionBlockShape& shape,
                            cudaStream_t stream);

}  // namespace meshtrain::kernels::cuda
