// The Llama class's layers (model.h), for every family whose description names them
// (api/families/llama.h: Llama 2 and 3, Mistral, Qwen2, Qwen3). Pre-RMSNorm blocks of
// grouped-query attention with rotate-half RoPE on q and k, and a SwiGLU MLP; no
// position table; a tied or untied LM head. Its units (api/model_family.h): the embedding
// unit embed (Vp,C) (and norm (C) when tied); each block attn_norm (C), q (Q,C), k (KV,C),
// v (KV,C), [q, k, v biases], [q_norm (HS), k_norm (HS)], o (C,Q), mlp_norm (C), gate
// (I,C), up (I,C), down (C,I), this rank's slices, so that q, k and v are one
// (Ql + 2 KVl, C) matrix and gate and up one (2 Il, C); the head unit norm (C), lm_head
// (Vp,C) when untied. Where a block holds biases, q, k and v add them; where it holds
// q_norm and k_norm, each head of q and of k is RMS-normed before RoPE. Where it holds a
// router (Mixtral, Qwen3-MoE), its MLP is a mixture of experts (moe_block.h) in place of
// gate, up and down; a mixture's dense blocks (api::ModelShape::DenseBlock) hold gate, up
// and down, the attention's tensors at the same offsets.

#include "worker/model/layers.h"
#include "worker/model/moe_block.h"

namespace meshtrain::model {
namespace {

template <class P>
class Llama final : public Model<P> {
 public:
  using A = typename P::Act;
  using G = typename P::Acc;

  explicit Llama(const ParameterLayout& layout)
      : shape_(layout.shape()),
        embed_(layout.OffsetInUnit(Param::kEmbed)),
        norm_(layout.OffsetInUnit(Param::kNorm)),
        lm_head_(layout.has_head_unit() ? layout.OffsetInUnit(Param::kLmHead) : embed_),
        attn_norm_(layout.OffsetInUnit(Param::kAttnNorm)),
        wqkv_(layout.OffsetInUnit(Param::kWq)),
        bqkv_(layout.Has(Param::kBq) ? layout.OffsetInUnit(Param::kBq) : -1),
        q_norm_(layout.Has(Param::kQNorm) ? layout.OffsetInUnit(Param::kQNorm) : -1),
        k_norm_(layout.Has(Param::kKNorm) ? layout.OffsetInUnit(Param::kKNorm) : -1),
        wo_(layout.OffsetInUnit(Param::kWo)),
        mlp_norm_(layout.OffsetInUnit(Param::kMlpNorm)),
        wgate_up_(layout.Has(Param::kWGate) ? layout.OffsetInUnit(Param::kWGate) : -1),
        wdown_(layout.Has(Param::kWDown) ? layout.OffsetInUnit(Param::kWDown) : -1),
        moe_(layout) {}

  void EmbedForward(const Context<P>& k, Ptr<A> encoded, Ptr<const int32_t> tokens, Ptr<const A> unit,
                    const Dims& d) const override {
    // Each slice looks up its own tokens; a token outside the slice gives 0: the sum is exact.
    k.ops.EncoderForward(encoded, tokens, unit + embed_, nullptr, d.B, d.T, d.C, d.tp.vocab_begin(d.V),
                         d.tp.vocab(d.V), k.stream);
    AllReduce(k, encoded, d.N() * d.C);
  }

  void EmbedBackward(const Context<P>& k, Ptr<G> dunit, Ptr<const A> dencoded, Ptr<const int32_t> tokens,
                     const Dims& d) const override {
    k.ops.EncoderBackward(dunit + embed_, nullptr, dencoded, tokens, d.B, d.T, d.C, d.tp.vocab_begin(d.V),
                          d.tp.vocab(d.V), k.stream);
  }

  void BlockForward(const Context<P>& k, const BlockActivations<P>& acts, const BlockScratch<P>& scratch,
                    Ptr<const A> residual, Ptr<const A> p, const Dims& d) const override {
    const Acts a = ActsOf(acts);
    const Scratch s = ScratchOf(scratch);
    const int64_t N = d.N();
    const int C = d.C, Q = d.query_width(), KV = d.kv_width(), Hl = d.hidden_units();
    const bool dropout = d.dropout.p > 0;
    // Without TP's all-reduce or dropout between a projection and the residual stream, the
    // projection adds the stream in its epilogue.
    const bool into_residual = api::ProjectsIntoResidual(d.tp.size, dropout);
    kernels::Ops<P>& ops = k.ops;
    ops.RmsNormForward(a.attn_norm, a.attn_rstd, residual, p + attn_norm_, N, C, d.eps, k.stream);
    LinearForward(k, TpSplit::kRows, a.qkv, nullptr, a.attn_norm, p + wqkv_, Bias(p), nullptr, N, C, Q + 2 * KV);
    if (q_norm_ >= 0) {  // each head of q, then of k
      ops.HeadRmsNormForward(a.qkv, a.qk_raw, a.qk_rstd, p + q_norm_, N, d.heads(), d.HS, Q + 2 * KV, d.eps, k.stream);
      ops.HeadRmsNormForward(a.qkv + Q, a.qk_raw + N * Q, a.qk_rstd + N * d.heads(), p + k_norm_, N, d.kv_heads(),
                             d.HS, Q + 2 * KV, d.eps, k.stream);
    }
    Rotate(k, a.qkv, d, /*backward=*/false);
    AttentionForward(k, a.atty, a.att_state, s.attention, a.qkv, d.B, d.T, d.heads(), d.kv_heads(), d.HS);
    const int64_t q_whole = int64_t(d.NH) * d.HS, q_first = int64_t(d.tp.rank) * Q;
    if (dropout) Drop(k, d, kAttentionOutput, s.dropped, a.atty, Q, q_whole, q_first);
    if (into_residual) {
      LinearForward(k, TpSplit::kColumns, a.residual2, nullptr, a.atty, p + wo_, nullptr, residual, N, Q, C);
      ops.RmsNormForward(a.mlp_norm, a.mlp_rstd, a.residual2, p + mlp_norm_, N, C, d.eps, k.stream);
    } else {
      LinearForward(k, TpSplit::kColumns, s.proj, nullptr, dropout ? s.dropped : a.atty, p + wo_, nullptr, nullptr, N, Q, C);
      AllReduce(k, s.proj, N * C);
      if (dropout) Drop(k, d, kAttentionResidual, s.proj, s.proj, C, C, 0);
      ops.ResidualRmsNormForward(a.residual2, a.mlp_norm, a.mlp_rstd, residual, s.proj, p + mlp_norm_, N, C, d.eps,
                                 k.stream);
    }
    if (Sparse(d)) {  // a mixture of experts' MLP (moe_block.h)
      moe_.Forward(k, acts.parts, into_residual ? acts.output : s.proj, a.mlp_norm,
                   into_residual ? Ptr<const A>(a.residual2) : nullptr, p, N, C, d.layer);
      if (into_residual) return;
      AllReduce(k, s.proj, N * C);
      if (dropout) Drop(k, d, kMlpResidual, s.proj, s.proj, C, C, 0);
      ops.Add(acts.output, a.residual2, s.proj, N * C, k.stream);
      return;
    }
    LinearForward(k, TpSplit::kRows, a.gate_up, nullptr, a.mlp_norm, p + wgate_up_, nullptr, nullptr, N, C, 2 * Hl);
    ops.SwiGluForward(a.swiglu, a.gate_up, N, Hl, k.stream);
    if (into_residual) {
      LinearForward(k, TpSplit::kColumns, acts.output, nullptr, a.swiglu, p + wdown_, nullptr, a.residual2, N, Hl, C);
      return;
    }
    LinearForward(k, TpSplit::kColumns, s.proj, nullptr, a.swiglu, p + wdown_, nullptr, nullptr, N, Hl, C);
    AllReduce(k, s.proj, N * C);
    if (dropout) Drop(k, d, kMlpResidual, s.proj, s.proj, C, C, 0);
    ops.Add(acts.output, a.residual2, s.proj, N * C, k.stream);
  }

  void BlockBackward(const Context<P>& k, Ptr<G> dp, const BlockScratch<P>& scratch, const BlockActivations<P>& acts,
                     Ptr<const A> residual, Ptr<const A> p, const Dims& d) const override {
    const Acts a = ActsOf(acts);
    const Scratch s = ScratchOf(scratch);
    const int64_t N = d.N();
    const int C = d.C, Q = d.query_width(), KV = d.kv_width(), Hl = d.hidden_units();
    const bool dropout = d.dropout.p > 0;
    kernels::Ops<P>& ops = k.ops;
    // output = residual2 + down: both get the output's gradient (down's through its mask).
    const Ptr<A> ddown = dropout ? s.dmasked : s.dresidual;
    if (dropout) Drop(k, d, kMlpResidual, s.dmasked, s.dresidual, C, C, 0);
    if (Sparse(d)) {
      moe_.Backward(k, dp, acts.parts, scratch.parts, s.dln, ddown, a.mlp_norm, p, N, C);
    } else {
      LinearBackward(k, TpSplit::kColumns, s.dswiglu, dp + wdown_, nullptr, ddown, a.swiglu, p + wdown_, nullptr, N, Hl, C);
      ops.SwiGluBackward(s.dgate_up, s.dswiglu, a.gate_up, N, Hl, k.stream);
      LinearBackward(k, TpSplit::kRows, s.dln, dp + wgate_up_, nullptr, s.dgate_up, a.mlp_norm, p + wgate_up_, nullptr, N, C, 2 * Hl);
    }
    AllReduce(k, s.dln, N * C);  // each rank's hidden units gave part of it
    ops.RmsNormBackward(s.dresidual, dp + mlp_norm_, s.dln, a.residual2, p + mlp_norm_, a.mlp_rstd, N, C, k.stream);
    // residual2 = residual + o: likewise.
    const int64_t q_whole = int64_t(d.NH) * d.HS, q_first = int64_t(d.tp.rank) * Q;
    const Ptr<A> dout = dropout ? s.dmasked : s.dresidual;
    if (dropout) {
      Drop(k, d, kAttentionResidual, s.dmasked, s.dresidual, C, C, 0);
      Drop(k, d, kAttentionOutput, s.dropped, a.atty, Q, q_whole, q_first);  // the projection's input again
    }
    LinearBackward(k, TpSplit::kColumns, s.datty, dp + wo_, nullptr, dout, dropout ? s.dropped : a.atty, p + wo_, nullptr, N, Q, C);
    if (dropout) Drop(k, d, kAttentionOutput, s.datty, s.datty, Q, q_whole, q_first);
    AttentionBackward(k, s.dqkv, s.attention, s.datty, a.qkv, a.atty, a.att_state, d.B, d.T, d.heads(), d.kv_heads(),
                      d.HS);
    Rotate(k, s.dqkv, d, /*backward=*/true);
    if (q_norm_ >= 0) HeadNormsBackward(k, dp, s, a, p, d);
    LinearBackward(k, TpSplit::kRows, s.dln, dp + wqkv_, Bias(dp), s.dqkv, a.attn_norm, p + wqkv_, nullptr, N, C, Q + 2 * KV);
    AllReduce(k, s.dln, N * C);  // and each rank's heads
    ops.RmsNormBackward(s.dresidual, dp + attn_norm_, s.dln, residual, p + attn_norm_, a.attn_rstd, N, C, k.stream);
  }

  void HeadForward(const Context<P>& k, const HeadActivations<P>& h, Ptr<const A> x, Ptr<const A> unit,
                   Ptr<const int32_t> targets, Ptr<double> loss_sum, double loss_weight, Ptr<G> dunit, Ptr<A> dx,
                   const Dims& d) const override {
    const int C = d.C;
    k.ops.RmsNormForward(h.lnf, h.lnf_rstd, x, unit + norm_, d.N(), C, d.eps, k.stream);
    const Ptr<G> dweight = dunit ? dunit + lm_head_ : nullptr;
    VocabHead<P>(k, h, unit + lm_head_, dweight, targets, loss_sum, loss_weight, d, [&](int64_t r0, int64_t rows) {
      k.ops.RmsNormBackward(dx + r0 * C, dunit + norm_, h.dlnf, x + r0 * C, unit + norm_, h.lnf_rstd + r0, rows, C,
                            k.stream);
    });
  }

  std::vector<double> FamilyBufferValues(std::string_view name, const std::vector<int64_t>& positions) const override {
    if (name != "rope") return Model<P>::FamilyBufferValues(name, positions);
    return RopeTable(shape_, positions);
  }

  void HeadLogits(const Context<P>& k, const HeadActivations<P>& h, Ptr<const A> x, Ptr<const A> unit, int64_t row,
                  const Dims& d) const override {
    k.ops.RmsNormForward(h.lnf, h.lnf_rstd, x + row * d.C, unit + norm_, 1, d.C, d.eps, k.stream);
    k.ops.MatmulForward(h.logits, nullptr, h.lnf, unit + lm_head_, nullptr, nullptr, 1, d.C,
                        int(d.tp.padded_vocab(d.V)), k.stream);
  }

 private:
  // RoPE's table (FamilyBufferValues): cos, then sin, each (seq, HS/2).
  struct Rope {
    Ptr<const G> cos, sin;
  };
  static Rope RopeOf(const Context<P>& k) {
    const Ptr<const G> table = k.buffers.template Get<G>("rope");
    return {table, table + k.buffers.Elements("rope") / 2};
  }
  // RoPE on the q and k heads of qkv (N, Q + 2 KV), or its backward: each row at its
  // position in the window (the table's row), or with k.documents in its document (the
  // table then holds positions 0, 1, ...; each segment starts at its position's row).
  void Rotate(const Context<P>& k, Ptr<A> qkv, const Dims& d, bool backward) const {
    const Rope rope = RopeOf(k);
    auto rotate = [&](Ptr<A> x, int64_t position, int B, int T) {
      const int64_t at = position * (d.HS / 2);
      if (backward) {
        return k.ops.RopeBackward(x, rope.cos + at, rope.sin + at, B, T, d.heads(), d.kv_heads(), d.HS, k.stream);
      }
      k.ops.RopeForward(x, rope.cos + at, rope.sin + at, B, T, d.heads(), d.kv_heads(), d.HS, k.stream);
    };
    if (k.documents == nullptr) return rotate(qkv, 0, d.B, d.T);
    const int64_t row = d.query_width() + 2 * d.kv_width();
    for (const Segment& s : SegmentsOf(*k.documents, d.B, d.T, d.cp_rank, d.cp_size)) {
      rotate(qkv + (int64_t(s.b) * d.T + s.row) * row, s.position(), 1, int(s.rows));
    }
  }

  struct Acts {
    Ptr<A> attn_norm, qkv, atty, residual2, mlp_norm, gate_up, swiglu;
    Ptr<G> attn_rstd, att_state, mlp_rstd;
    Ptr<A> qk_raw;  // q's and k's heads before their norms; null without them
    Ptr<G> qk_rstd;
  };
  struct Scratch {
    Ptr<A> dresidual, proj, dln, dswiglu, dgate_up, datty, dqkv, dmasked, dropped;
    runtime::DeviceBytes attention;
    Ptr<G> dhead_norms, all_head_norms;  // q_norm's and k_norm's gradients: this rank's, the TP group's
  };
  static Acts ActsOf(const BlockActivations<P>& b) {
    const Carving& c = b.parts;
    return {c.Get<A>("attn_norm"), c.Get<A>("qkv"),      c.Get<A>("atty"),     c.Get<A>("residual2"),
            c.Get<A>("mlp_norm"),  c.Get<A>("gate_up"),  c.Get<A>("swiglu"),   c.Get<G>("attn_rstd"),
            c.Get<G>("att_state"), c.Get<G>("mlp_rstd"), c.Find<A>("qk_raw"),  c.Find<G>("qk_rstd")};
  }
  static Scratch ScratchOf(const BlockScratch<P>& b) {
    const Carving& c = b.parts;
    return {b.dresidual,          c.Get<A>("proj"),  c.Get<A>("dln"),      c.Get<A>("dswiglu"),
            c.Get<A>("dgate_up"), c.Get<A>("datty"), c.Get<A>("dqkv"),     c.Find<A>("dmasked"),
            c.Find<A>("dropped"), c.Get<std::byte>("attention"), c.Find<G>("dhead_norms"),
            c.Find<G>("all_head_norms")};
  }
  // The per-head norms' backward: dqkv's q and k heads in place, and their weights'
  // gradients, each TP rank's from its own heads, added over the group in rank order.
  void HeadNormsBackward(const Context<P>& k, Ptr<G> dp, const Scratch& s, const Acts& a, Ptr<const A> p,
                         const Dims& d) const {
    const int64_t N = d.N(), Q = d.query_width(), row = Q + 2 * d.kv_width(), HS = d.HS;
    k.ops.HeadRmsNormBackward(s.dqkv, s.dhead_norms, a.qk_raw, p + q_norm_, a.qk_rstd, N, d.heads(), d.HS, row,
                              k.stream);
    k.ops.HeadRmsNormBackward(s.dqkv + Q, s.dhead_norms + HS, a.qk_raw + N * Q, p + k_norm_,
                              a.qk_rstd + N * d.heads(), N, d.kv_heads(), d.HS, row, k.stream);
    auto add = [&](Ptr<const G> both) {  // q_norm's gradient, then k_norm's
      k.ops.Accumulate(dp + q_norm_, both, HS, 1.0f, k.stream);
      k.ops.Accumulate(dp + k_norm_, both + HS, HS, 1.0f, k.stream);
    };
    if (k.tp == nullptr || k.tp->size() == 1) return add(s.dhead_norms);
    k.tp->AllGather(s.dhead_norms, s.all_head_norms, 2 * HS, k.stream);
    for (int r = 0; r < k.tp->size(); ++r) add(s.all_head_norms + r * 2 * HS);
  }

  // Whether the block of `d` is a mixture of experts' sparse one.
  bool Sparse(const Dims& d) const {
    if (!moe_.enabled) return false;
    if (d.layer < 0) throw std::logic_error("Llama: a mixture's block without its index");
    return !shape_.DenseBlock(d.layer);
  }

  // q's, k's and v's biases, one vector: Qwen2's; null for the rest.
  template <class T>
  Ptr<T> Bias(Ptr<T> block) const {
    return bqkv_ < 0 ? Ptr<T>{} : block + bqkv_;
  }

  api::ModelShape shape_;
  int64_t embed_, norm_, lm_head_;  // in the embedding or head unit
  int64_t attn_norm_, wqkv_, bqkv_, q_norm_, k_norm_, wo_, mlp_norm_, wgate_up_, wdown_;  // in a block
  MoeBlock<P> moe_;  // a mixture of experts' MLP in place of gate, up and down, where the block has a router
};

}  // namespace

template <class P>
std::unique_ptr<Model<P>> MakeLlama(const ParameterLayout& layout) {
  return std::make_unique<Llama<P>>(layout);
}

template std::unique_ptr<Model<kernels::Fp32>> MakeLlama<kernels::Fp32>(const ParameterLayout&);
template std::unique_ptr<Model<kernels::Bf16>> MakeLlama<kernels::Bf16>(const ParameterLayout&);
template std::unique_ptr<Model<kernels::Fp64>> MakeLlama<kernels::Fp64>(const ParameterLayout&);

}  // namespace meshtrain::model
