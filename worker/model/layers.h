// What the families' layers share (model.h): the TP group's all-reduce, the dropout
// sites, and the vocabulary-parallel LM head with its fused backward. Internal to model/.
// Thread-safety: plain functions.

#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

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

namespace float8_detail {

// An operand of a float8 product: x (rows,cols) as it enters the product, and which of
// its axes the TP group splits.
template <class P>
struct Operand {
  Ptr<const typename P::Act> x;
  int64_t rows = 0, cols = 0;
  kernels::Float8Operand operand{};
  bool rows_split = false, cols_split = false;
};

// The scales of a product's two operands, in k.float8's scratch. Each amax is of the
// whole logical tensor (or row, or column), whatever the layout: where the TP group splits
// the axis an amax runs over, the group's amaxes are gathered and their max taken. (An
// operand the group does not split is the same on every rank, so its max is itself; an
// operand whose scales are indexed by a split axis has scales of its own rows or columns.)
// FSDP gathers whole weights before a product, so their amaxes need nothing more.
template <class P>
std::pair<Ptr<const float>, Ptr<const float>> ScalesOf(const Context<P>& k, const Operand<P>& a, const Operand<P>& b) {
  const Float8Linear& f = *k.float8;
  const int tp = k.tp ? k.tp->size() : 1;
  const Ptr<float> amax = f.scratch, gathered = amax + 2 * f.width, scales = gathered + int64_t(tp) * 2 * f.width;
  int64_t offset[2] = {0, 0}, count[2] = {0, 0};
  bool reduce[2] = {false, false};
  const Operand<P>* operands[2] = {&a, &b};
  for (int i = 0; i < 2; ++i) {
    const Operand<P>& o = *operands[i];
    const kernels::Float8Cast cast = kernels::Float8CastOf(f.recipe, o.operand);
    count[i] = kernels::Float8ScaleCount(cast.scaling, o.rows, o.cols);
    offset[i] = i == 0 ? 0 : count[0];
    reduce[i] = cast.scaling == kernels::Float8Scaling::kTensor ||
                (cast.scaling == kernels::Float8Scaling::kRow ? !o.rows_split : !o.cols_split);
    k.ops.Float8Amax(amax + offset[i], o.x, o.rows, int(o.cols), cast.scaling, k.stream);
  }
  const int64_t both = count[0] + count[1];
  if (tp > 1) {
    if constexpr (std::is_same_v<typename P::Acc, float>) {
      k.tp->AllGather(amax, gathered, both, k.stream);
    } else {
      throw std::invalid_argument("float8 with tensor parallelism needs fp32 accumulation, not " +
                                  std::string(P::kName));
    }
  }
  for (int i = 0; i < 2; ++i) {
    const kernels::Float8Cast cast = kernels::Float8CastOf(f.recipe, operands[i]->operand);
    const bool across = tp > 1 && reduce[i];
    k.ops.Float8Scales(scales + offset[i], (across ? gathered : amax) + offset[i], count[i], across ? tp : 1, both,
                       cast.format, cast.power_of_2_scales, k.stream);
  }
  return {scales + offset[0], scales + offset[1]};
}

// The scales of each product's two operands (in k.float8's scratch, until the next call)
// for a linear layer whose weight (OC,K) the TP group splits by `split`: the forward's
// inp (N,K) and weight, the grad input's dout (N,OC) and weight, the grad weight's dout
// and inp.
template <class P>
std::pair<Ptr<const float>, Ptr<const float>> ForwardScales(const Context<P>& k, TpSplit split,
                                                            Ptr<const typename P::Act> inp,
                                                            Ptr<const typename P::Act> weight, int64_t N, int K,
                                                            int OC) {
  const bool rows = split == TpSplit::kRows, columns = split == TpSplit::kColumns;
  return ScalesOf(k, {inp, N, K, kernels::Float8Operand::kInpForward, false, columns},
                  {weight, OC, K, kernels::Float8Operand::kWeightForward, rows, columns});
}
template <class P>
std::pair<Ptr<const float>, Ptr<const float>> GradInputScales(const Context<P>& k, TpSplit split,
                                                              Ptr<const typename P::Act> dout,
                                                              Ptr<const typename P::Act> weight, int64_t N, int K,
                                                              int OC) {
  const bool rows = split == TpSplit::kRows, columns = split == TpSplit::kColumns;
  return ScalesOf(k, {dout, N, OC, kernels::Float8Operand::kDoutForGradInput, false, rows},
                  {weight, OC, K, kernels::Float8Operand::kWeightForGradInput, rows, columns});
}
template <class P>
std::pair<Ptr<const float>, Ptr<const float>> GradWeightScales(const Context<P>& k, TpSplit split,
                                                               Ptr<const typename P::Act> dout,
                                                               Ptr<const typename P::Act> inp, int64_t N, int K,
                                                               int OC) {
  const bool rows = split == TpSplit::kRows, columns = split == TpSplit::kColumns;
  return ScalesOf(k, {dout, N, OC, kernels::Float8Operand::kDoutForGradWeight, false, rows},
                  {inp, N, K, kernels::Float8Operand::kInpForGradWeight, false, columns});
}

}  // namespace float8_detail

// A block's linear layer, whose weight (OC,K) the TP group splits by its rows (the
// outputs: q/k/v, gate/up, GPT-2's fc) or its columns (the inputs: o, down, the
// projections into the residual stream, whose partial sums AllReduce joins): the table's
// MatmulForward (its contract, kernels/ops.h), or with k.float8 its Float8MatmulForward
// with scales of the whole logical operands.
template <class P>
void LinearForward(const Context<P>& k, TpSplit split, Ptr<typename P::Act> out, Ptr<typename P::Act> gelu_pre,
                   Ptr<const typename P::Act> inp, Ptr<const typename P::Act> weight, Ptr<const typename P::Act> bias,
                   Ptr<const typename P::Act> residual, int64_t N, int K, int OC) {
  if (k.float8 == nullptr) return k.ops.MatmulForward(out, gelu_pre, inp, weight, bias, residual, N, K, OC, k.stream);
  const auto [inp_scale, weight_scale] = float8_detail::ForwardScales(k, split, inp, weight, N, K, OC);
  k.ops.Float8MatmulForward(out, gelu_pre, inp, inp_scale, weight, weight_scale, bias, residual, N, K, OC,
                            k.float8->recipe, k.stream);
}

// Its backward: the table's MatmulBackward, or with k.float8 Float8MatmulGradInput and
// Float8MatmulGradWeight, each operand scaled as the recipe scales it in that product.
template <class P>
void LinearBackward(const Context<P>& k, TpSplit split, Ptr<typename P::Act> dinp, Ptr<typename P::Acc> dweight,
                    Ptr<typename P::Acc> dbias, Ptr<const typename P::Act> dout, Ptr<const typename P::Act> inp,
                    Ptr<const typename P::Act> weight, Ptr<const typename P::Act> gelu_pre, int64_t N, int K, int OC) {
  if (k.float8 == nullptr) {
    return k.ops.MatmulBackward(dinp, dweight, dbias, dout, inp, weight, gelu_pre, N, K, OC, k.stream);
  }
  const auto [dout_scale, weight_scale] = float8_detail::GradInputScales(k, split, dout, weight, N, K, OC);
  k.ops.Float8MatmulGradInput(dinp, dout, dout_scale, weight, weight_scale, gelu_pre, N, K, OC, k.float8->recipe,
                              k.stream);
  // (The scratch's scales are reused: the stream runs the grad input's product first.)
  const auto [dout_weight_scale, inp_scale] = float8_detail::GradWeightScales(k, split, dout, inp, N, K, OC);
  k.ops.Float8MatmulGradWeight(dweight, dbias, dout, dout_weight_scale, inp, inp_scale, N, K, OC, k.float8->recipe,
                               k.stream);
}

// What the all-reduce after a row-parallel product (or the embedding) must add once: the
// bias (or the positions), given on the group's first rank only.
template <class T>
Ptr<T> OnFirstRank(const Dims& d, Ptr<T> bias) {
  return api::AddsBias(TpSplit::kColumns, d.tp.rank) ? bias : nullptr;
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
