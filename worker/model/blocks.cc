#include "worker/model/blocks.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "worker/kernels/dropout.h"

namespace meshtrain::model {

template <class T>
RootParams<T> RootParams<T>::At(Ptr<T> unit, const ParameterLayout& layout) {
  return {unit + layout.Offset(Param::kWte), unit + layout.Offset(Param::kWpe), unit + layout.Offset(Param::kLnfW),
          unit + layout.Offset(Param::kLnfB)};
}

template <class T>
BlockParams<T> BlockParams<T>::At(Ptr<T> unit, const ParameterLayout& layout) {
  const int64_t begin = layout.Offset(Param::kLn1W, 0);
  auto at = [&](Param kind) { return unit + (layout.Offset(kind, 0) - begin); };
  return {at(Param::kLn1W),     at(Param::kLn1B),     at(Param::kQkvW), at(Param::kQkvB),
          at(Param::kAttProjW), at(Param::kAttProjB), at(Param::kLn2W), at(Param::kLn2B),
          at(Param::kFcW),      at(Param::kFcB),      at(Param::kFcProjW), at(Param::kFcProjB)};
}

template <class P>
api::EngineTypes TypesOf(kernels::Ops<P>& ops, int B, int T, int NH, int HS) {
  api::EngineTypes types;
  types.act_bytes = int(sizeof(typename P::Act));
  types.acc_bytes = int(sizeof(typename P::Acc));
  types.attention_keeps_scores = ops.Attention(B, T, NH, HS) == kernels::AttentionKind::kScores;
  types.attention_scratch_bytes = ops.AttentionScratchBytes(B, T, NH, HS);
  return types;
}

namespace {

// Hands out consecutive buffers of one allocation, each starting aligned, in the order
// api/engine_memory.cc counts them.
struct Carver {
  runtime::DeviceBytes base;
  int64_t used = 0;
  template <class T>
  Ptr<T> Take(int64_t n) {
    Ptr<T> p = (base + used).template As<T>();
    used += api::Aligned(n * int64_t(sizeof(T)));
    return p;
  }
  void Check(int64_t expected, const char* what) const {
    if (used != expected) {
      throw std::logic_error(std::string(what) + ": the carving (" + std::to_string(used) +
                             " bytes) disagrees with api/engine_memory.h (" + std::to_string(expected) + ")");
    }
  }
};

}  // namespace

template <class P>
int64_t BlockActivations<P>::Bytes(int batch, int seq, const api::ModelShape& shape, TpSlice tp,
                                   const api::EngineTypes& types) {
  return api::BlockActivationBytes(batch, seq, shape, tp.size, types);
}

template <class P>
BlockActivations<P> BlockActivations<P>::At(runtime::DeviceBytes base, int batch, int seq,
                                            const api::ModelShape& s, TpSlice tp, const api::EngineTypes& types) {
  const int64_t N = int64_t(batch) * seq, C = s.hidden, Cl = C / tp.size, heads = s.heads / tp.size;
  Carver c{base};
  BlockActivations a;
  a.ln1 = c.Take<A>(N * C);
  a.ln1_mean = c.Take<G>(N);
  a.ln1_rstd = c.Take<G>(N);
  a.qkv = c.Take<A>(N * 3 * Cl);
  a.atty = c.Take<A>(N * Cl);
  a.att_state = c.Take<G>(types.attention_keeps_scores ? int64_t(batch) * heads * seq * seq : int64_t(batch) * heads * seq);
  a.residual2 = c.Take<A>(N * C);
  a.ln2 = c.Take<A>(N * C);
  a.ln2_mean = c.Take<G>(N);
  a.ln2_rstd = c.Take<G>(N);
  a.fch = c.Take<A>(N * 4 * Cl);
  a.fch_gelu = c.Take<A>(N * 4 * Cl);
  a.output = c.Take<A>(N * C);
  c.Check(Bytes(batch, seq, s, tp, types), "BlockActivations");
  return a;
}

template <class P>
int64_t BlockScratch<P>::Bytes(int batch, int seq, const api::ModelShape& shape, TpSlice tp,
                               const api::EngineTypes& types, bool dropout) {
  return api::BlockScratchBytes(batch, seq, shape, tp.size, types, dropout);
}

template <class P>
BlockScratch<P> BlockScratch<P>::At(runtime::DeviceBytes base, int batch, int seq, const api::ModelShape& s,
                                    TpSlice tp, const api::EngineTypes& types, bool dropout) {
  const int64_t N = int64_t(batch) * seq, C = s.hidden, Cl = C / tp.size;
  Carver c{base};
  BlockScratch b;
  b.proj = c.Take<A>(N * C);
  b.dresidual = c.Take<A>(N * C);
  b.dln = c.Take<A>(N * C);
  b.dfch = c.Take<A>(N * 4 * Cl);
  b.datty = c.Take<A>(N * Cl);
  b.dqkv = c.Take<A>(N * 3 * Cl);
  if (dropout) {
    b.dmasked = c.Take<A>(N * C);
    b.dropped = c.Take<A>(N * C);
  }
  b.attention = c.Take<std::byte>(types.attention_scratch_bytes);
  c.Check(Bytes(batch, seq, s, tp, types, dropout), "BlockScratch");
  return b;
}

template <class P>
int64_t HeadActivations<P>::Bytes(int batch, int seq, const api::ModelShape& shape, TpSlice tp,
                                  const api::EngineTypes& types) {
  return api::HeadActivationBytes(batch, seq, shape, tp.rank, tp.size, types);
}

template <class P>
HeadActivations<P> HeadActivations<P>::At(runtime::DeviceBytes base, int batch, int seq, const api::ModelShape& s,
                                          TpSlice tp, const api::EngineTypes& types) {
  const int64_t N = int64_t(batch) * seq, C = s.hidden, Vp = tp.padded_vocab(s.vocab_size);
  Carver c{base};
  HeadActivations h;
  h.chunk_rows = api::HeadChunkRows(N, Vp);
  h.lnf = c.Take<A>(N * C);
  h.lnf_mean = c.Take<G>(N);
  h.lnf_rstd = c.Take<G>(N);
  h.losses = c.Take<G>(N);
  h.logits = c.Take<A>(h.chunk_rows * Vp);
  h.dlnf = c.Take<A>(h.chunk_rows * C);
  if (tp.size > 1) {
    h.stats = c.Take<G>(h.chunk_rows * 3);
    h.all_stats = c.Take<G>(tp.size * h.chunk_rows * 3);
  }
  c.Check(Bytes(batch, seq, s, tp, types), "HeadActivations");
  return h;
}

Dims Dims::ForLayer(int l) const {
  Dims d = *this;
  d.dropout.key = kernels::MixKey(dropout.key, uint64_t(l));
  return d;
}

namespace {

// The places a block drops elements, each with its own masks.
enum DropoutSite : uint64_t { kAttentionOutput, kAttentionResidual, kMlpResidual };

// out (N, width) = in with the site's mask applied: this rank's columns [first_column,
// first_column + width) of the site's (N, C) tensor. The same call applies it to a gradient.
template <class P>
void Drop(const Context<P>& k, const Dims& d, DropoutSite site, Ptr<typename P::Act> out,
          Ptr<const typename P::Act> in, int width, int64_t first_column) {
  k.ops.Dropout(out, in, d.N(), width, d.dropout.p, kernels::MixKey(d.dropout.key, site), d.dropout.first_sample * d.T,
                d.C, first_column, k.stream);
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

}  // namespace

template <class P>
void EmbedForward(const Context<P>& k, Ptr<typename P::Act> encoded, Ptr<const int32_t> tokens,
                  const RootParams<const typename P::Act>& p, const Dims& d) {
  // Each slice looks up its own tokens, rank 0 adds the positions: the sum is exact.
  k.ops.EncoderForward(encoded, tokens, p.wte, OnFirstRank(d, p.wpe), d.B, d.T, d.C, d.tp.vocab_begin(d.V),
                       d.tp.vocab(d.V), k.stream);
  AllReduce(k, encoded, d.N() * d.C);
}

template <class P>
void EmbedBackward(const Context<P>& k, const RootParams<typename P::Acc>& dp, Ptr<const typename P::Act> dencoded,
                   Ptr<const int32_t> tokens, const Dims& d) {
  k.ops.EncoderBackward(dp.wte, dp.wpe, dencoded, tokens, d.B, d.T, d.C, d.tp.vocab_begin(d.V), d.tp.vocab(d.V),
                        k.stream);
}

template <class P>
void BlockForward(const Context<P>& k, const BlockActivations<P>& a, const BlockScratch<P>& s,
                  Ptr<const typename P::Act> residual, const BlockParams<const typename P::Act>& p, const Dims& d) {
  const int64_t N = d.N();
  const int C = d.C, Cl = C / d.tp.size, Hl = 4 * C / d.tp.size, heads = d.NH / d.tp.size;
  const bool dropout = d.dropout.p > 0;
  // Without TP's all-reduce or dropout between a projection and the residual stream, the
  // projection adds the stream in its epilogue: no separate add, no proj round trip.
  const bool into_residual = d.tp.size == 1 && !dropout;
  kernels::Ops<P>& ops = k.ops;
  ops.LayerNormForward(a.ln1, a.ln1_mean, a.ln1_rstd, residual, p.ln1w, p.ln1b, N, C, k.stream);
  ops.MatmulForward(a.qkv, nullptr, a.ln1, p.qkvw, p.qkvb, nullptr, N, C, 3 * Cl, k.stream);
  ops.AttentionForward(a.atty, a.att_state, a.qkv, d.B, d.T, Cl, heads, k.stream);
  // The backward needs attention's own output; the projection reads it after dropout.
  if (dropout) Drop(k, d, kAttentionOutput, s.dropped, a.atty, Cl, int64_t(d.tp.rank) * Cl);
  if (into_residual) {
    ops.MatmulForward(a.residual2, nullptr, a.atty, p.attprojw, p.attprojb, residual, N, Cl, C, k.stream);
    ops.LayerNormForward(a.ln2, a.ln2_mean, a.ln2_rstd, a.residual2, p.ln2w, p.ln2b, N, C, k.stream);
  } else {
    ops.MatmulForward(s.proj, nullptr, dropout ? s.dropped : a.atty, p.attprojw, OnFirstRank(d, p.attprojb), nullptr,
                      N, Cl, C, k.stream);
    AllReduce(k, s.proj, N * C);
    if (dropout) Drop(k, d, kAttentionResidual, s.proj, s.proj, C, 0);
    ops.ResidualLayerNormForward(a.residual2, a.ln2, a.ln2_mean, a.ln2_rstd, residual, s.proj, p.ln2w, p.ln2b, N, C,
                                 k.stream);
  }
  ops.MatmulForward(a.fch_gelu, a.fch, a.ln2, p.fcw, p.fcb, nullptr, N, C, Hl, k.stream);
  if (into_residual) {
    ops.MatmulForward(a.output, nullptr, a.fch_gelu, p.fcprojw, p.fcprojb, a.residual2, N, Hl, C, k.stream);
    return;
  }
  ops.MatmulForward(s.proj, nullptr, a.fch_gelu, p.fcprojw, OnFirstRank(d, p.fcprojb), nullptr, N, Hl, C, k.stream);
  AllReduce(k, s.proj, N * C);
  if (dropout) Drop(k, d, kMlpResidual, s.proj, s.proj, C, 0);
  ops.Add(a.output, a.residual2, s.proj, N * C, k.stream);
}

template <class P>
void BlockBackward(const Context<P>& k, const BlockParams<typename P::Acc>& dp, const BlockScratch<P>& s,
                   const BlockActivations<P>& a, Ptr<const typename P::Act> residual,
                   const BlockParams<const typename P::Act>& p, const Dims& d) {
  const int64_t N = d.N();
  const int C = d.C, Cl = C / d.tp.size, Hl = 4 * C / d.tp.size, heads = d.NH / d.tp.size;
  const bool dropout = d.dropout.p > 0;
  kernels::Ops<P>& ops = k.ops;
  // output = residual2 + fcproj: both get the output's gradient (fcproj's through its mask).
  const Ptr<typename P::Act> dfcproj = dropout ? s.dmasked : s.dresidual;
  if (dropout) Drop(k, d, kMlpResidual, s.dmasked, s.dresidual, C, 0);
  ops.MatmulBackward(s.dfch, dp.fcprojw, dp.fcprojb, dfcproj, a.fch_gelu, p.fcprojw, a.fch, N, Hl, C, k.stream);
  ops.MatmulBackward(s.dln, dp.fcw, dp.fcb, s.dfch, a.ln2, p.fcw, nullptr, N, C, Hl, k.stream);
  AllReduce(k, s.dln, N * C);  // each rank's hidden units gave part of it
  ops.LayerNormBackward(s.dresidual, dp.ln2w, dp.ln2b, s.dln, a.residual2, p.ln2w, a.ln2_mean, a.ln2_rstd, N, C,
                        k.stream);
  // residual2 = residual + attproj: likewise.
  const Ptr<typename P::Act> dattproj = dropout ? s.dmasked : s.dresidual;
  if (dropout) {
    Drop(k, d, kAttentionResidual, s.dmasked, s.dresidual, C, 0);
    Drop(k, d, kAttentionOutput, s.dropped, a.atty, Cl, int64_t(d.tp.rank) * Cl);  // the projection's input again
  }
  ops.MatmulBackward(s.datty, dp.attprojw, dp.attprojb, dattproj, dropout ? s.dropped : a.atty, p.attprojw, nullptr, N,
                     Cl, C, k.stream);
  if (dropout) Drop(k, d, kAttentionOutput, s.datty, s.datty, Cl, int64_t(d.tp.rank) * Cl);
  ops.AttentionBackward(s.dqkv, s.attention, s.datty, a.qkv, a.atty, a.att_state, d.B, d.T, Cl, heads, k.stream);
  ops.MatmulBackward(s.dln, dp.qkvw, dp.qkvb, s.dqkv, a.ln1, p.qkvw, nullptr, N, C, 3 * Cl, k.stream);
  AllReduce(k, s.dln, N * C);  // and each rank's heads
  ops.LayerNormBackward(s.dresidual, dp.ln1w, dp.ln1b, s.dln, residual, p.ln1w, a.ln1_mean, a.ln1_rstd, N, C,
                        k.stream);
}

template <class P>
void HeadForward(const Context<P>& k, const HeadActivations<P>& h, Ptr<const typename P::Act> x,
                 const RootParams<const typename P::Act>& p, Ptr<const int32_t> targets, Ptr<double> loss_sum,
                 double loss_weight, const RootParams<typename P::Acc>* dp, Ptr<typename P::Act> dx, const Dims& d) {
  const int64_t N = d.N(), V = d.V, v_rows = d.tp.vocab(V), Vp = d.tp.padded_vocab(V), v_begin = d.tp.vocab_begin(V);
  const int C = d.C;
  kernels::Ops<P>& ops = k.ops;
  ops.LayerNormForward(h.lnf, h.lnf_mean, h.lnf_rstd, x, p.lnfw, p.lnfb, N, C, k.stream);
  const float dloss = float(loss_weight / double(N));
  for (int64_t r0 = 0; r0 < N; r0 += h.chunk_rows) {
    const int64_t rows = std::min(h.chunk_rows, N - r0);
    Ptr<typename P::Act> dlogits = dp ? h.logits : nullptr;  // in place over the chunk's logits
    ops.MatmulForward(h.logits, nullptr, h.lnf + r0 * C, p.wte, nullptr, nullptr, rows, C, int(Vp), k.stream);
    if (k.tp) {
      ops.VocabSliceStats(h.stats, h.logits, targets + r0, rows, v_rows, Vp, v_begin, k.stream);
      k.tp->AllGather(h.stats, h.all_stats, rows * 3, k.stream);
      ops.VocabSliceCrossEntropy(h.losses + r0, dlogits, h.logits, h.all_stats, k.tp->size(), targets + r0, rows,
                                 v_rows, Vp, v_begin, dloss, k.stream);
    } else {
      ops.CrossEntropy(h.losses + r0, dlogits, h.logits, targets + r0, rows, v_rows, Vp, dloss, k.stream);
    }
    if (!dp) continue;
    ops.MatmulBackward(h.dlnf, dp->wte, nullptr, dlogits, h.lnf + r0 * C, p.wte, nullptr, rows, C, int(Vp), k.stream);
    AllReduce(k, h.dlnf, rows * C);  // each slice of the vocabulary gave part of it
    ops.LayerNormBackward(dx + r0 * C, dp->lnfw, dp->lnfb, h.dlnf, x + r0 * C, p.lnfw, h.lnf_mean + r0,
                          h.lnf_rstd + r0, rows, C, k.stream);
  }
  ops.AddLoss(loss_sum, h.losses, N, loss_weight / double(N), k.stream);
}

template <class P>
void HeadLogits(const Context<P>& k, const HeadActivations<P>& h, Ptr<const typename P::Act> x,
                const RootParams<const typename P::Act>& p, int64_t row, const Dims& d) {
  k.ops.LayerNormForward(h.lnf, h.lnf_mean, h.lnf_rstd, x + row * d.C, p.lnfw, p.lnfb, 1, d.C, k.stream);
  k.ops.MatmulForward(h.logits, nullptr, h.lnf, p.wte, nullptr, nullptr, 1, d.C, int(d.tp.padded_vocab(d.V)),
                      k.stream);
}

#define MESHTRAIN_BLOCKS(P)                                                                                          \
  template api::EngineTypes TypesOf<P>(kernels::Ops<P>&, int, int, int, int);                                       \
  template struct BlockActivations<P>;                                                                               \
  template struct BlockScratch<P>;                                                                                   \
  template struct HeadActivations<P>;                                                                                \
  template void EmbedForward<P>(const Context<P>&, Ptr<P::Act>, Ptr<const int32_t>, const RootParams<const P::Act>&, \
                                const Dims&);                                                                        \
  template void EmbedBackward<P>(const Context<P>&, const RootParams<P::Acc>&, Ptr<const P::Act>, Ptr<const int32_t>, \
                                 const Dims&);                                                                       \
  template void BlockForward<P>(const Context<P>&, const BlockActivations<P>&, const BlockScratch<P>&,              \
                                Ptr<const P::Act>, const BlockParams<const P::Act>&, const Dims&);                   \
  template void BlockBackward<P>(const Context<P>&, const BlockParams<P::Acc>&, const BlockScratch<P>&,             \
                                 const BlockActivations<P>&, Ptr<const P::Act>, const BlockParams<const P::Act>&,    \
                                 const Dims&);                                                                       \
  template void HeadForward<P>(const Context<P>&, const HeadActivations<P>&, Ptr<const P::Act>,                     \
                               const RootParams<const P::Act>&, Ptr<const int32_t>, Ptr<double>, double,             \
                               const RootParams<P::Acc>*, Ptr<P::Act>, const Dims&);                                 \
  template void HeadLogits<P>(const Context<P>&, const HeadActivations<P>&, Ptr<const P::Act>,                      \
                              const RootParams<const P::Act>&, int64_t, const Dims&);

MESHTRAIN_BLOCKS(kernels::Fp32)
MESHTRAIN_BLOCKS(kernels::Bf16)
MESHTRAIN_BLOCKS(kernels::Fp64)
#undef MESHTRAIN_BLOCKS

template struct RootParams<float>;
template struct RootParams<const float>;
template struct RootParams<double>;
template struct RootParams<const double>;
template struct RootParams<const runtime::bf16>;
template struct BlockParams<float>;
template struct BlockParams<const float>;
template struct BlockParams<double>;
template struct BlockParams<const double>;
template struct BlockParams<const runtime::bf16>;

}  // namespace meshtrain::model
