// What the families' layers share (model.h): the TP group's all-reduce, the dropout
// sites, and the vocabulary-parallel LM head with its fused backward. Internal to model/.
// Thread-safety: plain functions.

#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>

#include "worker/kernels/dropout.h"
#include "worker/model/model.h"

namespace meshtrain::model {

template <class P>
std::unique_ptr<Model<P>> MakeGpt2(const ParameterLayout& layout);
template <class P>
std::unique_ptr<Model<P>> MakeLlama(const ParameterLayout& layout);

// The places a block drops elements, each with its own masks.
enum DropoutSite : uint64_t { kAttentionOutput, kAttentionResidual, kMlpResidual };

// out (N, width) = in with the site's mask applied: this rank's columns [first_column,
// first_column + width) of the site's (N, row_stride) tensor. The same call applies it to
// a gradient.
template <class P>
void Drop(const Context<P>& k, const Dims& d, DropoutSite site, Ptr<typename P::Act> out,
          Ptr<const typename P::Act> in, int width, int64_t row_stride, int64_t first_column) {
  k.ops.Dropout(out, in, d.N(), width, d.dropout.p, kernels::MixKey(d.dropout.key, site), d.dropout.first_sample * d.T,
                row_stride, first_column, k.stream);
}

// The all-reduce that joins the TP group's partial sums; nothing without a group.
template <class P>
void AllReduce(const Context<P>& k, Ptr<typename P::Act> data, int64_t n) {
  if (k.tp) k.tp->AllReduceSum(data, n, k.stream);
}

// What the all-reduce after a row-parallel product (or the embedding) must add once: the
// bias (or the positions), given on the group's first rank only.
template <class T>
Ptr<T> OnFirstRank(const Dims& d, Ptr<T> bias) {
  return d.tp.rank == 0 ? bias : nullptr;
}

// The LM head after the final norm, whose output is h.lnf (N,C): the logits against
// `weight` (this rank's padded vocabulary rows, Vp x C), a chunk of rows at a time, their
// cross-entropy against targets, and *loss_sum += loss_weight * the sum of the losses (a
// masked target, -1, has none). In training
// (dweight non-null), dweight += the head matrix's gradient, and for each chunk of `rows`
// rows from r0 the gradient of the norm's output lands in h.dlnf (summed over the TP
// group) and norm_backward(r0, rows) takes it through the norm.
template <class P, class NormBackward>
void VocabHead(const Context<P>& k, const HeadActivations<P>& h, Ptr<const typename P::Act> weight,
               Ptr<typename P::Acc> dweight, Ptr<const int32_t> targets, Ptr<double> loss_sum, double loss_weight,
               const Dims& d, NormBackward&& norm_backward) {
  const int64_t N = d.N(), V = d.V, v_rows = d.tp.vocab(V), Vp = d.tp.padded_vocab(V), v_begin = d.tp.vocab_begin(V);
  const int C = d.C;
  kernels::Ops<P>& ops = k.ops;
  const float dloss = float(loss_weight);
  for (int64_t r0 = 0; r0 < N; r0 += h.chunk_rows) {
    const int64_t rows = std::min(h.chunk_rows, N - r0);
    Ptr<typename P::Act> dlogits = dweight ? h.logits : nullptr;  // in place over the chunk's logits
    ops.MatmulForward(h.logits, nullptr, h.lnf + r0 * C, weight, nullptr, nullptr, rows, C, int(Vp), k.stream);
    if (k.tp) {
      ops.VocabSliceStats(h.stats, h.logits, targets + r0, rows, v_rows, Vp, v_begin, k.stream);
      k.tp->AllGather(h.stats, h.all_stats, rows * 3, k.stream);
      ops.VocabSliceCrossEntropy(h.losses + r0, dlogits, h.logits, h.all_stats, k.tp->size(), targets + r0, rows,
                                 v_rows, Vp, v_begin, dloss, k.stream);
    } else {
      ops.CrossEntropy(h.losses + r0, dlogits, h.logits, targets + r0, rows, v_rows, Vp, dloss, k.stream);
    }
    if (!dweight) continue;
    ops.MatmulBackward(h.dlnf, dweight, nullptr, dlogits, h.lnf + r0 * C, weight, nullptr, rows, C, int(Vp), k.stream);
    AllReduce(k, h.dlnf, rows * C);  // each slice of the vocabulary gave part of it
    norm_backward(r0, rows);
  }
  ops.AddLoss(loss_sum, h.losses, N, loss_weight, k.stream);
}

}  // namespace meshtrain::model
