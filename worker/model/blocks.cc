#include "worker/model/blocks.h"

#include <algorithm>
#include <stdexcept>
#include <vector>

#include "worker/kernels/cpu/kernels.h"

namespace meshtrain::model {

namespace k = kernels::cpu;

void MicroBatch::Set(const int32_t* in, const int32_t* out, int b, int tn, int max_batch, int max_seq, int64_t vocab) {
  if (b > max_batch || tn > max_seq) throw std::invalid_argument("micro-batch larger than the model was sized for");
  for (int i = 0; i < b * tn; ++i) {
    if (in[i] < 0 || in[i] >= vocab || (out && (out[i] < 0 || out[i] >= vocab))) {
      throw std::out_of_range("token id outside the vocabulary");
    }
  }
  B = b, Tn = tn;
  inputs.assign(in, in + b * tn);
  if (out) targets.assign(out, out + b * tn);
  else targets.clear();
}

template <class T>
RootParams<T> RootParams<T>::At(T* unit, const ParameterLayout& layout) {
  return {unit + layout.Offset(Param::kWte), unit + layout.Offset(Param::kWpe), unit + layout.Offset(Param::kLnfW),
          unit + layout.Offset(Param::kLnfB)};
}

template <class T>
BlockParams<T> BlockParams<T>::At(T* unit, const ParameterLayout& layout) {
  const int64_t begin = layout.Offset(Param::kLn1W, 0);
  auto at = [&](Param kind) { return unit + (layout.Offset(kind, 0) - begin); };
  return {at(Param::kLn1W),     at(Param::kLn1B), at(Param::kQkvW), at(Param::kQkvB),
          at(Param::kAttProjW), at(Param::kAttProjB), at(Param::kLn2W), at(Param::kLn2B),
          at(Param::kFcW),      at(Param::kFcB),      at(Param::kFcProjW), at(Param::kFcProjB)};
}

namespace {

// Hands out consecutive slices of a buffer; with a null base it only counts.
template <class T>
struct Carver {
  T* base;
  int64_t used = 0;
  T* Take(int64_t n) {
    T* at = base == nullptr ? nullptr : base + used;
    used += n;
    return at;
  }
};

template <class T>
BlockActivations<T> CarveBlock(T* base, int max_batch, int max_seq, const api::ModelShape& s, TpSlice tp) {
  const int64_t bt = int64_t(max_batch) * max_seq, btc = bt * s.hidden, btc_local = btc / tp.size,
                bhtt = int64_t(max_batch) * (s.heads / tp.size) * max_seq * max_seq;
  Carver<T> c{base};
  BlockActivations<T> a{};
  a.ln1 = c.Take(btc);
  a.ln1_mean = c.Take(bt);
  a.ln1_rstd = c.Take(bt);
  a.qkv = c.Take(3 * btc_local);
  a.atty = c.Take(btc_local);
  a.preatt = c.Take(bhtt);
  a.att = c.Take(bhtt);
  a.attproj = c.Take(btc);
  a.residual2 = c.Take(btc);
  a.ln2 = c.Take(btc);
  a.ln2_mean = c.Take(bt);
  a.ln2_rstd = c.Take(bt);
  a.fch = c.Take(4 * btc_local);
  a.fch_gelu = c.Take(4 * btc_local);
  a.fcproj = c.Take(btc);
  a.residual3 = c.Take(btc);
  a.base = base;
  a.size = c.used;
  if (a.size != api::BlockActivationElements(max_batch, max_seq, s, tp.size)) {
    throw std::logic_error("BlockActivations: carving disagrees with api::BlockActivationElements");
  }
  return a;
}

template <class T>
HeadActivations<T> CarveHead(T* base, int max_batch, int max_seq, const api::ModelShape& s, TpSlice tp, int64_t* size) {
  const int64_t bt = int64_t(max_batch) * max_seq, vocab = tp.vocab(s.vocab_size);
  Carver<T> c{base};
  HeadActivations<T> h{};
  h.lnf = c.Take(bt * s.hidden);
  h.lnf_mean = c.Take(bt);
  h.lnf_rstd = c.Take(bt);
  h.logits = c.Take(bt * vocab);
  h.probs = c.Take(bt * vocab);
  h.losses = c.Take(bt);
  if (tp.size > 1) {
    h.stats = c.Take(3 * bt);
    h.all_stats = c.Take(3 * bt * tp.size);
  }
  *size = c.used;
  if (c.used != api::HeadActivationElements(max_batch, max_seq, s, tp.rank, tp.size)) {
    throw std::logic_error("HeadActivations: carving disagrees with api::HeadActivationElements");
  }
  return h;
}

}  // namespace

template <class T>
int64_t BlockActivations<T>::Size(int max_batch, int max_seq, const api::ModelShape& shape, TpSlice tp) {
  return api::BlockActivationElements(max_batch, max_seq, shape, tp.size);
}

template <class T>
BlockActivations<T> BlockActivations<T>::At(T* base, int max_batch, int max_seq, const api::ModelShape& shape,
                                            TpSlice tp) {
  return CarveBlock(base, max_batch, max_seq, shape, tp);
}

template <class T>
int64_t HeadActivations<T>::Size(int max_batch, int max_seq, const api::ModelShape& shape, TpSlice tp) {
  return api::HeadActivationElements(max_batch, max_seq, shape, tp.rank, tp.size);
}

template <class T>
HeadActivations<T> HeadActivations<T>::At(T* base, int max_batch, int max_seq, const api::ModelShape& shape,
                                          TpSlice tp) {
  int64_t size = 0;
  return CarveHead(base, max_batch, max_seq, shape, tp, &size);
}

template <class T>
int64_t ModelActivations<T>::Size(int max_batch, int max_seq, const api::ModelShape& shape) {
  const int64_t btc = int64_t(max_batch) * max_seq * shape.hidden;
  return btc * 3 + shape.layers * BlockActivations<T>::Size(max_batch, max_seq, shape) +
         BlockActivations<T>::Size(max_batch, max_seq, shape) + 2 * HeadActivations<T>::Size(max_batch, max_seq, shape);
}

template <class T>
ModelActivations<T> ModelActivations<T>::At(T* base, int max_batch, int max_seq, const api::ModelShape& shape) {
  const int64_t btc = int64_t(max_batch) * max_seq * shape.hidden, block = BlockActivations<T>::Size(max_batch, max_seq, shape),
                head = HeadActivations<T>::Size(max_batch, max_seq, shape);
  ModelActivations a{};
  a.encoded = base;
  T* next = base + btc;
  for (int64_t l = 0; l < shape.layers; ++l, next += block) a.blocks.push_back(BlockActivations<T>::At(next, max_batch, max_seq, shape));
  a.head = HeadActivations<T>::At(next, max_batch, max_seq, shape);
  next += head;
  a.dhead = HeadActivations<T>::At(next, max_batch, max_seq, shape);
  next += head;
  a.dblock = BlockActivations<T>::At(next, max_batch, max_seq, shape);
  next += block;
  a.dresidual[0] = next;
  a.dresidual[1] = next + btc;
  return a;
}

Dims Dims::ForLayer(int l) const {
  Dims d = *this;
  d.dropout.key = k::MixKey(dropout.key, uint64_t(l));
  return d;
}

namespace {

// The places a block drops elements, each with its own masks.
enum DropoutSite : uint64_t { kAttentionOutput, kAttentionResidual, kMlpResidual };

// Dropout of x (B,Tn,width), this rank's columns [first_column, first_column + width) of
// the site's whole (B,Tn,C) tensor; the same call applies the mask to its gradient.
template <class T>
void Drop(const Dims& d, DropoutSite site, T* x, int width, int64_t first_column) {
  if (d.dropout.p <= 0) return;
  k::Dropout(x, int64_t(d.B) * d.Tn, width, d.dropout.p, k::MixKey(d.dropout.key, site),
             d.dropout.first_sample * d.Tn, d.C, first_column);
}

// The tensor-parallel all-reduce that joins partial sums; nothing without a group.
void AllReduce(const Dims& d, float* data, int64_t n) {
  if (d.tp) d.tp->AllReduceSum(data, n);
}
void AllReduce(const Dims& d, double*, int64_t) {
  if (d.tp) throw std::logic_error("tensor parallelism runs in float");
}
void AllGather(const Dims& d, const float* in, float* out, int64_t n) { d.tp->AllGather(in, out, n); }
void AllGather(const Dims&, const double*, double*, int64_t) {
  throw std::logic_error("tensor parallelism runs in float");
}

// What the all-reduce after a row-parallel product (or the embedding) must add once: the
// bias (or the positions), given on the group's first rank only.
template <class T>
const T* OnFirstRank(const Dims& d, const T* bias) {
  return d.slice().rank == 0 ? bias : nullptr;
}

}  // namespace

template <class T>
void EmbedForward(T* encoded, const int32_t* inputs, const RootParams<const T>& p, const Dims& d) {
  if (!d.tp) return k::EncoderForward(encoded, inputs, p.wte, p.wpe, d.B, d.Tn, d.C);
  // Each slice looks up its own tokens, rank 0 adds the positions: the sum is exact.
  const TpSlice tp = d.slice();
  const int begin = int(tp.vocab_begin(d.V)), end = begin + int(tp.vocab(d.V));
  k::EncoderForward(encoded, inputs, p.wte, OnFirstRank(d, p.wpe), d.B, d.Tn, d.C, begin, end);
  AllReduce(d, encoded, int64_t(d.B) * d.Tn * d.C);
}

template <class T>
void EmbedBackward(const RootParams<T>& dp, const T* dencoded, const int32_t* inputs, const Dims& d) {
  const TpSlice tp = d.slice();
  const int begin = int(tp.vocab_begin(d.V)), end = begin + int(tp.vocab(d.V));
  k::EncoderBackward(dp.wte, dp.wpe, dencoded, inputs, d.B, d.Tn, d.C, begin, end);
}

template <class T>
void BlockForward(const BlockActivations<T>& a, const T* residual, const BlockParams<const T>& p, const Dims& d) {
  const int B = d.B, Tn = d.Tn, C = d.C, tp = d.slice().size;
  const int Cl = C / tp, NHl = d.NH / tp;  // this rank's attention width and heads
  const int64_t BTC = int64_t(B) * Tn * C;
  k::LayerNormForward(a.ln1, a.ln1_mean, a.ln1_rstd, residual, p.ln1w, p.ln1b, B, Tn, C);
  k::MatmulForward(a.qkv, a.ln1, p.qkvw, p.qkvb, B, Tn, C, 3 * Cl);
  k::AttentionForward(a.atty, a.preatt, a.att, a.qkv, B, Tn, Cl, NHl);
  Drop(d, kAttentionOutput, a.atty, Cl, int64_t(d.slice().rank) * Cl);
  k::MatmulForward(a.attproj, a.atty, p.attprojw, OnFirstRank(d, p.attprojb), B, Tn, Cl, C);
  AllReduce(d, a.attproj, BTC);
  Drop(d, kAttentionResidual, a.attproj, C, 0);
  k::ResidualForward(a.residual2, residual, a.attproj, BTC);
  k::LayerNormForward(a.ln2, a.ln2_mean, a.ln2_rstd, a.residual2, p.ln2w, p.ln2b, B, Tn, C);
  k::MatmulForward(a.fch, a.ln2, p.fcw, p.fcb, B, Tn, C, 4 * Cl);
  k::GeluForward(a.fch_gelu, a.fch, 4 * BTC / tp);
  k::MatmulForward(a.fcproj, a.fch_gelu, p.fcprojw, OnFirstRank(d, p.fcprojb), B, Tn, 4 * Cl, C);
  AllReduce(d, a.fcproj, BTC);
  Drop(d, kMlpResidual, a.fcproj, C, 0);
  k::ResidualForward(a.residual3, a.residual2, a.fcproj, BTC);
}

template <class T>
void BlockBackward(const BlockParams<T>& dp, T* dresidual, const BlockActivations<T>& g, const T* dout,
                   const BlockActivations<T>& a, const T* residual, const BlockParams<const T>& p, const Dims& d) {
  const int B = d.B, Tn = d.Tn, C = d.C, tp = d.slice().size;
  const int Cl = C / tp, NHl = d.NH / tp;
  const int64_t BTC = int64_t(B) * Tn * C;
  std::fill(g.base, g.base + g.size, T(0));
  k::ResidualBackward(g.residual2, g.fcproj, dout, BTC);
  Drop(d, kMlpResidual, g.fcproj, C, 0);
  k::MatmulBackward(g.fch_gelu, dp.fcprojw, dp.fcprojb, g.fcproj, a.fch_gelu, p.fcprojw, B, Tn, 4 * Cl, C);
  k::GeluBackward(g.fch, a.fch, g.fch_gelu, 4 * BTC / tp);
  k::MatmulBackward(g.ln2, dp.fcw, dp.fcb, g.fch, a.ln2, p.fcw, B, Tn, C, 4 * Cl);
  AllReduce(d, g.ln2, BTC);  // each rank's hidden units gave part of it
  k::LayerNormBackward(g.residual2, dp.ln2w, dp.ln2b, g.ln2, a.residual2, p.ln2w, a.ln2_mean, a.ln2_rstd, B, Tn, C);
  k::ResidualBackward(dresidual, g.attproj, g.residual2, BTC);
  Drop(d, kAttentionResidual, g.attproj, C, 0);
  k::MatmulBackward(g.atty, dp.attprojw, dp.attprojb, g.attproj, a.atty, p.attprojw, B, Tn, Cl, C);
  Drop(d, kAttentionOutput, g.atty, Cl, int64_t(d.slice().rank) * Cl);
  k::AttentionBackward(g.qkv, g.preatt, g.att, g.atty, a.qkv, a.att, B, Tn, Cl, NHl);
  k::MatmulBackward(g.ln1, dp.qkvw, dp.qkvb, g.qkv, a.ln1, p.qkvw, B, Tn, C, 3 * Cl);
  AllReduce(d, g.ln1, BTC);  // and each rank's heads
  k::LayerNormBackward(dresidual, dp.ln1w, dp.ln1b, g.ln1, residual, p.ln1w, a.ln1_mean, a.ln1_rstd, B, Tn, C);
}

template <class T>
double HeadForward(const HeadActivations<T>& h, const T* x, const RootParams<const T>& p, const int32_t* targets,
                   const Dims& d) {
  const int B = d.B, Tn = d.Tn, C = d.C;
  const TpSlice tp = d.slice();
  const int V = int(tp.vocab(d.V));  // this rank's slice of the vocabulary
  k::LayerNormForward(h.lnf, h.lnf_mean, h.lnf_rstd, x, p.lnfw, p.lnfb, B, Tn, C);
  k::MatmulForward(h.logits, h.lnf, p.wte, static_cast<const T*>(nullptr), B, Tn, C, V);
  if (d.tp) {
    const int64_t bt = int64_t(B) * Tn;
    k::VocabSliceStats(h.stats, h.logits, targets, B, Tn, V, int(tp.vocab_begin(d.V)));
    AllGather(d, h.stats, h.all_stats, 3 * bt);
    k::VocabSliceSoftmax(h.probs, targets ? h.losses : static_cast<T*>(nullptr), h.logits, h.all_stats, tp.size, B,
                         Tn, V);
  } else if (targets == nullptr) {
    const std::vector<int32_t> zeros(size_t(B) * Tn, 0);  // targets of 0 keep the softmax right
    k::SoftmaxCrossEntropyForward(h.probs, h.losses, h.logits, zeros.data(), B, Tn, V);
  } else {
    k::SoftmaxCrossEntropyForward(h.probs, h.losses, h.logits, targets, B, Tn, V);
  }
  if (targets == nullptr) return 0;
  double sum = 0;
  for (int64_t i = 0; i < int64_t(B) * Tn; ++i) sum += double(h.losses[i]);
  return sum / (double(B) * Tn);
}

template <class T>
void HeadBackward(const RootParams<T>& dp, T* dx, const HeadActivations<T>& g, const HeadActivations<T>& h,
                  const T* x, const RootParams<const T>& p, const int32_t* targets, T loss_scale, const Dims& d) {
  const int B = d.B, Tn = d.Tn, C = d.C;
  const TpSlice tp = d.slice();
  const int V = int(tp.vocab(d.V));
  const int64_t bt = int64_t(B) * Tn;
  std::fill(g.lnf, g.lnf + bt * C, T(0));
  std::fill(g.logits, g.logits + bt * V, T(0));
  k::SoftmaxCrossEntropyBackward(g.logits, h.probs, targets, loss_scale / T(B * Tn), B, Tn, V,
                                 int(tp.vocab_begin(d.V)));
  k::MatmulBackward(g.lnf, dp.wte, static_cast<T*>(nullptr), g.logits, h.lnf, p.wte, B, Tn, C, V);
  AllReduce(d, g.lnf, bt * C);  // each slice of the vocabulary gave part of it
  k::LayerNormBackward(dx, dp.lnfw, dp.lnfb, g.lnf, x, p.lnfw, h.lnf_mean, h.lnf_rstd, B, Tn, C);
}

#define MESHTRAIN_BLOCKS(T)                                                                                         \
  template struct RootParams<T>;                                                                                    \
  template struct RootParams<const T>;                                                                              \
  template struct BlockParams<T>;                                                                                   \
  template struct BlockParams<const T>;                                                                             \
  template struct BlockActivations<T>;                                                                              \
  template struct HeadActivations<T>;                                                                               \
  template struct ModelActivations<T>;                                                                              \
  template void EmbedForward<T>(T*, const int32_t*, const RootParams<const T>&, const Dims&);                        \
  template void EmbedBackward<T>(const RootParams<T>&, const T*, const int32_t*, const Dims&);                      \
  template void BlockForward<T>(const BlockActivations<T>&, const T*, const BlockParams<const T>&, const Dims&);    \
  template void BlockBackward<T>(const BlockParams<T>&, T*, const BlockActivations<T>&, const T*,                   \
                                 const BlockActivations<T>&, const T*, const BlockParams<const T>&, const Dims&);   \
  template double HeadForward<T>(const HeadActivations<T>&, const T*, const RootParams<const T>&, const int32_t*,  \
                                 const Dims&);                                                                      \
  template void HeadBackward<T>(const RootParams<T>&, T*, const HeadActivations<T>&, const HeadActivations<T>&,    \
                                const T*, const RootParams<const T>&, const int32_t*, T, const Dims&);

MESHTRAIN_BLOCKS(float)
MESHTRAIN_BLOCKS(double)

}  // namespace meshtrain::model
