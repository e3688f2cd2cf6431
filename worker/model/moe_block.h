// A mixture of experts' MLP (api/families/moe.cc: Mixtral, Qwen3-MoE) in the Llama
// class's blocks (llama.cc), as the kernel table composes it (kernels/ops.h): the router's
// logits, the softmax and top k, the dispatch plan, the copies of the tokens grouped by
// expert, the experts' gate and up as one grouped product, SwiGLU, their downs as another,
// and the weighted sum of each token's k outputs. Dropless: every token reaches its k
// experts. The grouped products need each expert's count on the host: it is downloaded
// (a wait on the stream) in the forward and again in the backward. One TP rank only
// (api/validation.cc refuses TP for these families). Internal to model/.
// Thread-safety: immutable; the work it enqueues follows the stream's rules.

#pragma once

#include <cstdint>
#include <stdexcept>
#include <vector>

#include "worker/model/model.h"

namespace meshtrain::model {

template <class P>
class MoeBlock {
 public:
  using A = typename P::Act;
  using G = typename P::Acc;

  // A block of `layout` that holds a router (Param::kRouter); `enabled` false otherwise.
  explicit MoeBlock(const ParameterLayout& layout) {
    if (!layout.Has(api::Param::kRouter)) return;
    const api::ModelShape s = layout.shape().Resolved();
    enabled = true;
    router_ = layout.OffsetInUnit(api::Param::kRouter);
    gate_up_ = layout.OffsetInUnit(api::Param::kExpertGate);  // expert 0's gate: the (E,2I,C) stack
    down_ = layout.OffsetInUnit(api::Param::kExpertDown);     // expert 0's down: the (E,C,I) stack
    E_ = int(s.experts), K_ = int(s.experts_per_token), I_ = int(s.moe_intermediate);
    renormalize_ = s.norm_topk_prob;
  }

  bool enabled = false;

  // out (N,C) = the layer applied to x (N,C), plus residual (N,C; nullable; may be out);
  // acts: the block's activations (api::BlockActivationBuffers). Each expert's tokens are
  // added to k.expert_counts[layer] where there is such a sink.
  void Forward(const Context<P>& k, const Carving& acts, Ptr<A> out, Ptr<const A> x, Ptr<const A> residual,
               Ptr<const A> p, int64_t N, int C, int layer) const {
    kernels::Ops<P>& ops = k.ops;
    const Parts a = PartsOf(acts);
    ops.MatmulForward(a.logits, nullptr, x, p + router_, nullptr, nullptr, N, C, E_, k.stream);
    ops.RouterTopKForward(a.probs, a.experts, a.weights, a.logits, N, E_, K_, renormalize_, k.stream);
    ops.MoePermutePlan(a.counts, a.positions, a.experts, N, K_, E_, k.stream);
    const std::vector<int32_t> counts = HostCounts(k, a.counts);
    if (k.expert_counts != nullptr) {
      std::vector<int64_t>& sum = (*k.expert_counts)[layer];
      sum.resize(size_t(E_), 0);
      for (int e = 0; e < E_; ++e) sum[size_t(e)] += counts[size_t(e)];
    }
    ops.MoePermute(a.xs, x, a.positions, N, K_, C, k.stream);
    ops.GroupedMatmulForward(a.gate_up, a.xs, p + gate_up_, counts.data(), E_, C, 2 * I_, k.stream);
    ops.SwiGluForward(a.swiglu, a.gate_up, N * K_, I_, k.stream);
    ops.GroupedMatmulForward(a.ys, a.swiglu, p + down_, counts.data(), E_, I_, C, k.stream);
    ops.MoeCombineForward(out, a.ys, a.weights, a.positions, residual, N, K_, C, k.stream);
  }

  // dx (N,C) = the gradient of x for dout (N,C), the gradient of Forward's out (its
  // residual's is dout itself); dp += the router's and the experts' gradients.
  void Backward(const Context<P>& k, Ptr<G> dp, const Carving& acts, const Carving& scratch, Ptr<A> dx,
                Ptr<const A> dout, Ptr<const A> x, Ptr<const A> p, int64_t N, int C) const {
    kernels::Ops<P>& ops = k.ops;
    const Parts a = PartsOf(acts);
    const Ptr<A> dys = scratch.Get<A>("dys"), dxs = scratch.Get<A>("dxs"), dswiglu = scratch.Get<A>("dswiglu"),
                 dgate_up = scratch.Get<A>("dgate_up"), dlogits = scratch.Get<A>("drouter_logits");
    const Ptr<G> dweights = scratch.Get<G>("dexpert_weights");
    const std::vector<int32_t> counts = HostCounts(k, a.counts);
    ops.MoeCombineBackward(dys, dweights, dout, a.ys, a.weights, a.positions, N, K_, C, k.stream);
    ops.GroupedMatmulBackward(dswiglu, dp + down_, dys, a.swiglu, p + down_, counts.data(), E_, I_, C, k.stream);
    ops.SwiGluBackward(dgate_up, dswiglu, a.gate_up, N * K_, I_, k.stream);
    ops.GroupedMatmulBackward(dxs, dp + gate_up_, dgate_up, a.xs, p + gate_up_, counts.data(), E_, C, 2 * I_,
                              k.stream);
    ops.RouterTopKBackward(dlogits, dweights, nullptr, a.probs, a.experts, N, E_, K_, renormalize_, k.stream);
    ops.MatmulBackward(dx, dp + router_, nullptr, dlogits, x, p + router_, nullptr, N, C, E_, k.stream);
    ops.MoePermuteBackward(dx, dxs, a.positions, N, K_, C, k.stream);
  }

 private:
  struct Parts {
    Ptr<A> logits, xs, gate_up, swiglu, ys;
    Ptr<G> probs, weights;
    Ptr<int32_t> experts, positions, counts;
  };
  static Parts PartsOf(const Carving& c) {
    return {c.Get<A>("router_logits"), c.Get<A>("xs"),         c.Get<A>("gate_up"),
            c.Get<A>("swiglu"),        c.Get<A>("ys"),         c.Get<G>("router_probs"),
            c.Get<G>("expert_weights"), c.Get<int32_t>("experts"), c.Get<int32_t>("positions"),
            c.Get<int32_t>("counts")};
  }
  std::vector<int32_t> HostCounts(const Context<P>& k, Ptr<int32_t> device) const {
    if (k.backend == nullptr) throw std::logic_error("MoeBlock: the context has no backend to download counts with");
    std::vector<int32_t> counts(size_t(E_), 0);
    k.backend->Download(counts.data(), Ptr<const int32_t>(device), E_, k.stream);
    k.stream.Synchronize();
    return counts;
  }

  int64_t router_ = 0, gate_up_ = 0, down_ = 0;
  int E_ = 0, K_ = 0, I_ = 0;
  bool renormalize_ = true;
};

}  // namespace meshtrain::model
