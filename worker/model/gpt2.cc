// GPT-2's layers (model.h): pre-LayerNorm blocks of fused-QKV attention and a GELU MLP,
// with biases, a learned position table, and the LM head tied to the token embedding.
// Its units (api/model_family.h): the embedding unit wte (Vp,C), wpe (P,C), lnf.w, lnf.b;
// each block ln1 (C)+(C), qkv (3C,C)+(3C), attproj (C,C)+(C), ln2, fc (4C,C)+(4C),
// fcproj (C,4C)+(C), this rank's slices.

#include <algorithm>

#include "api/layout.h"
#include "worker/model/layers.h"

namespace meshtrain::model {
namespace {

template <class T>
struct Embedding {
  Ptr<T> wte, wpe, lnfw, lnfb;
};

template <class T>
struct Block {
  Ptr<T> ln1w, ln1b, qkvw, qkvb, attprojw, attprojb, ln2w, ln2b, fcw, fcb, fcprojw, fcprojb;
};

template <class P>
class Gpt2 final : public Model<P> {
 public:
  using A = typename P::Act;
  using G = typename P::Acc;

  explicit Gpt2(const ParameterLayout& layout) {
    for (Param kind : {Param::kWte, Param::kWpe, Param::kLnfW, Param::kLnfB, Param::kLn1W, Param::kLn1B, Param::kQkvW,
                       Param::kQkvB, Param::kAttProjW, Param::kAttProjB, Param::kLn2W, Param::kLn2B, Param::kFcW,
                       Param::kFcB, Param::kFcProjW, Param::kFcProjB}) {
      offsets_[size_t(kind)] = layout.OffsetInUnit(kind);
    }
  }

  void EmbedForward(const Context<P>& k, Ptr<A> encoded, Ptr<const int32_t> tokens, Ptr<const A> unit,
                    const Dims& d) const override {
    const auto p = EmbeddingAt(unit);
    // Each slice looks up its own tokens, rank 0 adds the positions: the sum is exact.
    const Ptr<const A> wpe = OnFirstRank(d, p.wpe);
    if (k.documents != nullptr) {  // each document's rows from position 0
      for (const Segment& s : SegmentsOf(*k.documents, d.B, d.T, d.cp_rank, d.cp_size)) {
        const int64_t row = int64_t(s.b) * d.T + s.row;
        k.ops.EncoderForward(encoded + row * d.C, tokens + row, p.wte, wpe ? wpe + s.position() * d.C : wpe, 1,
                             int(s.rows), d.C, d.tp.vocab_begin(d.V), d.tp.vocab(d.V), k.stream);
      }
    } else if (d.cp_size == 1) {
      k.ops.EncoderForward(encoded, tokens, p.wte, wpe, d.B, d.T, d.C, d.tp.vocab_begin(d.V), d.tp.vocab(d.V),
                           k.stream);
    } else {  // each of a sequence's two chunks from its own first position
      const api::ContextRows rows(int64_t(d.T) * d.cp_size, d.cp_rank, d.cp_size);
      for (int b = 0; b < d.B; ++b) {
        for (int j = 0; j < 2; ++j) {
          const int64_t row = int64_t(b) * d.T + j * rows.chunk;
          k.ops.EncoderForward(encoded + row * d.C, tokens + row, p.wte, wpe ? wpe + rows.first[j] * d.C : wpe, 1,
                               int(rows.chunk), d.C, d.tp.vocab_begin(d.V), d.tp.vocab(d.V), k.stream);
        }
      }
    }
    AllReduce(k, encoded, d.N() * d.C);
  }

  void EmbedBackward(const Context<P>& k, Ptr<G> dunit, Ptr<const A> dencoded, Ptr<const int32_t> tokens,
                     const Dims& d) const override {
    const auto dp = EmbeddingAt(dunit);
    if (k.documents != nullptr) {
      for (const Segment& s : SegmentsOf(*k.documents, d.B, d.T, d.cp_rank, d.cp_size)) {
        const int64_t row = int64_t(s.b) * d.T + s.row;
        k.ops.EncoderBackward(dp.wte, dp.wpe + s.position() * d.C, dencoded + row * d.C, tokens + row, 1, int(s.rows),
                              d.C, d.tp.vocab_begin(d.V), d.tp.vocab(d.V), k.stream);
      }
      return;
    }
    if (d.cp_size == 1) {
      return k.ops.EncoderBackward(dp.wte, dp.wpe, dencoded, tokens, d.B, d.T, d.C, d.tp.vocab_begin(d.V),
                                   d.tp.vocab(d.V), k.stream);
    }
    const api::ContextRows rows(int64_t(d.T) * d.cp_size, d.cp_rank, d.cp_size);
    for (int b = 0; b < d.B; ++b) {
      for (int j = 0; j < 2; ++j) {
        const int64_t row = int64_t(b) * d.T + j * rows.chunk;
        k.ops.EncoderBackward(dp.wte, dp.wpe + rows.first[j] * d.C, dencoded + row * d.C, tokens + row, 1,
                              int(rows.chunk), d.C, d.tp.vocab_begin(d.V), d.tp.vocab(d.V), k.stream);
      }
    }
  }

  void BlockForward(const Context<P>& k, const BlockActivations<P>& acts, const BlockScratch<P>& scratch,
                    Ptr<const A> residual, Ptr<const A> block, const Dims& d) const override {
    const Acts a = ActsOf(acts);
    const Scratch s = ScratchOf(scratch);
    const auto p = BlockAt(block);
    const int64_t N = d.N();
    const int C = d.C, Cl = d.query_width(), Hl = d.hidden_units(), heads = d.heads();
    const bool dropout = d.dropout.p > 0;
    // Without TP's all-reduce or dropout between a projection and the residual stream, the
    // projection adds the stream in its epilogue: no separate add, no proj round trip.
    const bool into_residual = api::ProjectsIntoResidual(d.tp.size, dropout);
    kernels::Ops<P>& ops = k.ops;
    ops.LayerNormForward(a.ln1, a.ln1_mean, a.ln1_rstd, residual, p.ln1w, p.ln1b, N, C, k.stream);
    LinearForward(k, TpSplit::kRows, a.qkv, nullptr, a.ln1, p.qkvw, p.qkvb, nullptr, N, C, 3 * Cl);
    AttentionForward(k, a.atty, a.att_state, s.attention, a.qkv, d.B, d.T, heads, heads, d.HS);
    // The backward needs attention's own output; the projection reads it after dropout.
    if (dropout) Drop(k, d, kAttentionOutput, s.dropped, a.atty, Cl, C, int64_t(d.tp.rank) * Cl);
    if (into_residual) {
      LinearForward(k, TpSplit::kColumns, a.residual2, nullptr, a.atty, p.attprojw, p.attprojb, residual, N, Cl, C);
      ops.LayerNormForward(a.ln2, a.ln2_mean, a.ln2_rstd, a.residual2, p.ln2w, p.ln2b, N, C, k.stream);
    } else {
      LinearForward(k, TpSplit::kColumns, s.proj, nullptr, dropout ? s.dropped : a.atty, p.attprojw, OnFirstRank(d, p.attprojb),
                        nullptr, N, Cl, C);
      AllReduce(k, s.proj, N * C);
      if (dropout) Drop(k, d, kAttentionResidual, s.proj, s.proj, C, C, 0);
      ops.ResidualLayerNormForward(a.residual2, a.ln2, a.ln2_mean, a.ln2_rstd, residual, s.proj, p.ln2w, p.ln2b, N,
                                   C, k.stream);
    }
    LinearForward(k, TpSplit::kRows, a.fch_gelu, a.fch, a.ln2, p.fcw, p.fcb, nullptr, N, C, Hl);
    if (into_residual) {
      LinearForward(k, TpSplit::kColumns, acts.output, nullptr, a.fch_gelu, p.fcprojw, p.fcprojb, a.residual2, N, Hl, C);
      return;
    }
    LinearForward(k, TpSplit::kColumns, s.proj, nullptr, a.fch_gelu, p.fcprojw, OnFirstRank(d, p.fcprojb), nullptr, N, Hl, C);
    AllReduce(k, s.proj, N * C);
    if (dropout) Drop(k, d, kMlpResidual, s.proj, s.proj, C, C, 0);
    ops.Add(acts.output, a.residual2, s.proj, N * C, k.stream);
  }

  void BlockBackward(const Context<P>& k, Ptr<G> dblock, const BlockScratch<P>& scratch,
                     const BlockActivations<P>& acts, Ptr<const A> residual, Ptr<const A> block,
                     const Dims& d) const override {
    const Acts a = ActsOf(acts);
    const Scratch s = ScratchOf(scratch);
    const auto p = BlockAt(block);
    const auto dp = BlockAt(dblock);
    const int64_t N = d.N();
    const int C = d.C, Cl = d.query_width(), Hl = d.hidden_units(), heads = d.heads();
    const bool dropout = d.dropout.p > 0;
    kernels::Ops<P>& ops = k.ops;
    // output = residual2 + fcproj: both get the output's gradient (fcproj's through its mask).
    const Ptr<A> dfcproj = dropout ? s.dmasked : s.dresidual;
    if (dropout) Drop(k, d, kMlpResidual, s.dmasked, s.dresidual, C, C, 0);
    LinearBackward(k, TpSplit::kColumns, s.dfch, dp.fcprojw, dp.fcprojb, dfcproj, a.fch_gelu, p.fcprojw, a.fch, N, Hl, C);
    LinearBackward(k, TpSplit::kRows, s.dln, dp.fcw, dp.fcb, s.dfch, a.ln2, p.fcw, nullptr, N, C, Hl);
    AllReduce(k, s.dln, N * C);  // each rank's hidden units gave part of it
    ops.LayerNormBackward(s.dresidual, dp.ln2w, dp.ln2b, s.dln, a.residual2, p.ln2w, a.ln2_mean, a.ln2_rstd, N, C,
                          k.stream);
    // residual2 = residual + attproj: likewise.
    const Ptr<A> dattproj = dropout ? s.dmasked : s.dresidual;
    if (dropout) {
      Drop(k, d, kAttentionResidual, s.dmasked, s.dresidual, C, C, 0);
      Drop(k, d, kAttentionOutput, s.dropped, a.atty, Cl, C, int64_t(d.tp.rank) * Cl);  // the projection's input again
    }
    LinearBackward(k, TpSplit::kColumns, s.datty, dp.attprojw, dp.attprojb, dattproj, dropout ? s.dropped : a.atty, p.attprojw, nullptr,
                       N, Cl, C);
    if (dropout) Drop(k, d, kAttentionOutput, s.datty, s.datty, Cl, C, int64_t(d.tp.rank) * Cl);
    AttentionBackward(k, s.dqkv, s.attention, s.datty, a.qkv, a.atty, a.att_state, d.B, d.T, heads, heads, d.HS);
    LinearBackward(k, TpSplit::kRows, s.dln, dp.qkvw, dp.qkvb, s.dqkv, a.ln1, p.qkvw, nullptr, N, C, 3 * Cl);
    AllReduce(k, s.dln, N * C);  // and each rank's heads
    ops.LayerNormBackward(s.dresidual, dp.ln1w, dp.ln1b, s.dln, residual, p.ln1w, a.ln1_mean, a.ln1_rstd, N, C,
                          k.stream);
  }

  void HeadForward(const Context<P>& k, const HeadActivations<P>& h, Ptr<const A> x, Ptr<const A> unit,
                   Ptr<const int32_t> targets, Ptr<double> loss_sum, double loss_weight, Ptr<G> dunit, Ptr<A> dx,
                   const Dims& d) const override {
    const auto p = EmbeddingAt(unit);
    const int C = d.C;
    k.ops.LayerNormForward(h.lnf, h.lnf_mean, h.lnf_rstd, x, p.lnfw, p.lnfb, d.N(), C, k.stream);
    const Embedding<G> dp = dunit ? EmbeddingAt(dunit) : Embedding<G>{};
    VocabHead<P>(k, h, p.wte, dp.wte, targets, loss_sum, loss_weight, d, [&](int64_t r0, int64_t rows) {
      k.ops.LayerNormBackward(dx + r0 * C, dp.lnfw, dp.lnfb, h.dlnf, x + r0 * C, p.lnfw, h.lnf_mean + r0,
                              h.lnf_rstd + r0, rows, C, k.stream);
    });
  }

  void HeadLogits(const Context<P>& k, const HeadActivations<P>& h, Ptr<const A> x, Ptr<const A> unit, int64_t row,
                  const Dims& d) const override {
    const auto p = EmbeddingAt(unit);
    k.ops.LayerNormForward(h.lnf, h.lnf_mean, h.lnf_rstd, x + row * d.C, p.lnfw, p.lnfb, 1, d.C, k.stream);
    k.ops.MatmulForward(h.logits, nullptr, h.lnf, p.wte, nullptr, nullptr, 1, d.C, int(d.tp.padded_vocab(d.V)),
                        k.stream);
  }

 private:
  struct Acts {
    Ptr<A> ln1, qkv, atty, residual2, ln2, fch, fch_gelu;
    Ptr<G> ln1_mean, ln1_rstd, att_state, ln2_mean, ln2_rstd;
  };
  struct Scratch {
    Ptr<A> dresidual, proj, dln, dfch, datty, dqkv, dmasked, dropped;
    runtime::DeviceBytes attention;
  };
  static Acts ActsOf(const BlockActivations<P>& b) {
    const Carving& c = b.parts;
    return {c.Get<A>("ln1"),      c.Get<A>("qkv"),      c.Get<A>("atty"),     c.Get<A>("residual2"),
            c.Get<A>("ln2"),      c.Get<A>("fch"),      c.Get<A>("fch_gelu"), c.Get<G>("ln1_mean"),
            c.Get<G>("ln1_rstd"), c.Get<G>("att_state"), c.Get<G>("ln2_mean"), c.Get<G>("ln2_rstd")};
  }
  static Scratch ScratchOf(const BlockScratch<P>& b) {
    const Carving& c = b.parts;
    return {b.dresidual,      c.Get<A>("proj"),     c.Get<A>("dln"),     c.Get<A>("dfch"),
            c.Get<A>("datty"), c.Get<A>("dqkv"),     c.Find<A>("dmasked"), c.Find<A>("dropped"),
            c.Get<std::byte>("attention")};
  }
  template <class T>
  Embedding<T> EmbeddingAt(Ptr<T> unit) const {
    return {At(unit, Param::kWte), At(unit, Param::kWpe), At(unit, Param::kLnfW), At(unit, Param::kLnfB)};
  }
  template <class T>
  Block<T> BlockAt(Ptr<T> unit) const {
    using enum Param;
    return {At(unit, kLn1W),     At(unit, kLn1B),     At(unit, kQkvW), At(unit, kQkvB),
            At(unit, kAttProjW), At(unit, kAttProjB), At(unit, kLn2W), At(unit, kLn2B),
            At(unit, kFcW),      At(unit, kFcB),      At(unit, kFcProjW), At(unit, kFcProjB)};
  }
  template <class T>
  Ptr<T> At(Ptr<T> unit, Param kind) const {
    return unit + offsets_[size_t(kind)];
  }

  int64_t offsets_[size_t(Param::kFcProjB) + 1] = {};
};

}  // namespace

template <class P>
std::unique_ptr<Model<P>> MakeGpt2(const ParameterLayout& layout) {
  return std::make_unique<Gpt2<P>>(layout);
}

template std::unique_ptr<Model<kernels::Fp32>> MakeGpt2<kernels::Fp32>(const ParameterLayout&);
template std::unique_ptr<Model<kernels::Bf16>> MakeGpt2<kernels::Bf16>(const ParameterLayout&);
template std::unique_ptr<Model<kernels::Fp64>> MakeGpt2<kernels::Fp64>(const ParameterLayout&);

}  // namespace meshtrain::model
