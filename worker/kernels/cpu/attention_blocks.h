// Attention by blocks on the CPU (kernels/ops.h, "Attention by blocks": ring context
// parallelism): the bodies of the CPU tables' AttentionBlockForward, AttentionMerge,
// AttentionRowDot and AttentionBlockBackward, as plain functions over host arrays in the
// manner of kernels.h: A the stored type of the inputs, G the type everything is
// computed and accumulated in (<float, float>, <double, double>, and <bf16, float> for
// the emulation of the GPU, which reads bf16 and keeps every intermediate in fp32, as the
// CUDA kernels do). Each keeps the contract of the operation of the same name in
// kernels/ops.h; the shape's checks are the caller's (Ops::CheckAttentionBlock).
//
// Loops run parallel over (sequence, head, row) with OpenMP, the backward over (sequence,
// key/value head), each sum in a fixed order: a run repeats bit for bit.
// Thread-safety: the functions share no state but per-thread scratch.

#pragma once

#include "worker/kernels/ops.h"

namespace meshtrain::kernels::cpu {

template <class A, class G>
void AttentionBlockForward(G* out, G* lse, const A* q, const A* k, const A* v, const AttentionBlock& s);
template <class G>
void AttentionMerge(G* out, G* lse, const G* block_out, const G* block_lse, const AttentionBlock& s);
template <class A, class G>
void AttentionRowDot(G* D, const A* dout, const A* out, const AttentionBlock& s);
template <class A, class G>
void AttentionBlockBackward(G* dq, G* dk, G* dv, const A* dout, const A* q, const A* k, const A* v, const G* lse,
                            const G* D, const AttentionBlock& s);

}  // namespace meshtrain::kernels::cpu
