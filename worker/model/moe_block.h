// A mixture of experts' MLP (api/families/moe.cc: Mixtral, Qwen3-MoE) in the Llama
// class's blocks (llama.cc), as the kernel table composes it (kernels/ops.h): the router's
// logits, the softmax and top k, the dispatch plan, the copies of the tokens grouped by
// expert, the experts' gate and up as one grouped product, SwiGLU, their downs as another,
// and the weighted sum of each token's k outputs. Dropless: every token reaches its k
// experts. The grouped products need each expert's count on the host: it is downloaded
// (a wait on the stream) in the forward and again in the backward.
//
// Under tensor parallelism each expert is split as the dense MLP is (parameters.h): TP
// rank t holds units [t I/T, (t+1) I/T) of every expert's gate and up (rows) and the same
// columns of its down, so the experts' products are not repeated on the TP ranks. The
// router is whole on every TP rank: each routes all N tokens (its input is the same on
// every rank) and dispatches them to its slice of their experts. The output is then this
// rank's part of the sum, which the block all-reduces over the TP group, as after a dense
// row-parallel product; the backward adds the routing weights' gradients (each rank's
// from its own part of the experts' outputs) over the group, so that every rank's router
// gradient is the whole one, and only TP rank 0 adds the router's part of x's gradient,
// which the block's all-reduce then counts once. The routing, its statistics and the
// expert counts are each rank's alike.
//
// Under expert parallelism a rank holds E / EP experts (parameters.h): the copies go to
// their experts' ranks by one all-to-all of rows and come back by another, and the
// gradients the same way; each rank's experts work on the rows of each member in turn.
// The expert group is of the same TP rank, so the rows meet the same slice of their
// experts. Internal to model/.
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
    // This TP rank's units of each expert (the layout refuses a TP degree that does not divide them).
    E_ = int(s.experts), K_ = int(s.experts_per_token), I_ = int(s.moe_intermediate / layout.tp_size());
    local_ = E_ / layout.ep_size();
    renormalize_ = s.norm_topk_prob;
  }

  bool enabled = false;

  // out (N,C) = the layer applied to x (N,C), plus residual (N,C; nullable; may be out);
  // with a TP group of more than one rank, this rank's part of it, which the caller sums
  // over the group, and residual must be null;
  // acts: the block's activations (api::BlockActivationBuffers). Each expert's tokens are
  // added to k.expert_counts[layer] where there is such a sink. With an expert group
  // (k.ep), each token's copies go to the members holding their experts and come back.
  void Forward(const Context<P>& k, const Carving& acts, Ptr<A> out, Ptr<const A> x, Ptr<const A> residual,
               Ptr<const A> p, int64_t N, int C, int layer) const {
    kernels::Ops<P>& ops = k.ops;
    if (Split(k) && residual != nullptr) throw std::logic_error("MoeBlock: a TP rank's part of the output takes no residual");
    const Parts a = PartsOf(acts, k.ep != nullptr);
    ops.MatmulForward(a.logits, nullptr, x, p + router_, nullptr, nullptr, N, C, E_, k.stream);
    ops.RouterTopKForward(a.probs, a.experts, a.weights, a.logits, N, E_, K_, renormalize_, k.stream);
    ops.MoePermutePlan(a.counts, a.positions, a.experts, N, K_, E_, k.stream);
    if (k.ep != nullptr) k.ep->AllGatherCounts(a.counts, a.group_counts, E_, k.stream);
    const Routes r = RoutesOf(k, a);
    if (k.expert_counts != nullptr) {
      std::vector<int64_t>& sum = (*k.expert_counts)[layer];
      sum.resize(size_t(E_), 0);
      for (int e = 0; e < E_; ++e) sum[size_t(e)] += r.mine[size_t(e)];
    }
    if (k.router_stats != nullptr) AddRouterStats(k, a, r, N);
    ops.MoePermute(a.xs, x, a.positions, N, K_, C, k.stream);
    if (k.ep != nullptr) k.ep->AllToAll(a.xs, r.send_rows, a.xs_experts, r.recv_rows, C, k.stream);
    r.ForEachSource([&](const int32_t* counts, int64_t row) {
      ops.GroupedMatmulForward(a.gate_up + row * 2 * I_, a.xs_experts + row * C, p + gate_up_, counts, local_, C,
                               2 * I_, k.stream);
    });
    ops.SwiGluForward(a.swiglu, a.gate_up, r.rows, I_, k.stream);
    r.ForEachSource([&](const int32_t* counts, int64_t row) {
      ops.GroupedMatmulForward(a.ys_experts + row * C, a.swiglu + row * I_, p + down_, counts, local_, I_, C,
                               k.stream);
    });
    if (k.ep != nullptr) k.ep->AllToAll(a.ys_experts, r.recv_rows, a.ys, r.send_rows, C, k.stream);
    ops.MoeCombineForward(out, a.ys, a.weights, a.positions, residual, N, K_, C, k.stream);
  }

  // dx (N,C) = the gradient of x for dout (N,C), the gradient of Forward's out (its
  // residual's is dout itself); dp += the router's and the experts' gradients. With a TP
  // group of more than one rank, dout is the whole output's gradient (the same on every
  // rank), dx this rank's part, which the caller sums over the group, and dp's router
  // gradient the whole router's on every rank.
  void Backward(const Context<P>& k, Ptr<G> dp, const Carving& acts, const Carving& scratch, Ptr<A> dx,
                Ptr<const A> dout, Ptr<const A> x, Ptr<const A> p, int64_t N, int C) const {
    kernels::Ops<P>& ops = k.ops;
    const bool split = k.ep != nullptr;
    const Parts a = PartsOf(acts, split);
    const Ptr<A> dys = scratch.Get<A>("dys"), dxs = scratch.Get<A>("dxs"), dswiglu = scratch.Get<A>("dswiglu"),
                 dgate_up = scratch.Get<A>("dgate_up"), dlogits = scratch.Get<A>("drouter_logits");
    const Ptr<A> dys_experts = split ? scratch.Get<A>("dys_experts") : dys;
    const Ptr<A> dxs_experts = split ? scratch.Get<A>("dxs_experts") : dxs;
    const Ptr<G> dweights = scratch.Get<G>("dexpert_weights");
    const Routes r = RoutesOf(k, a);
    ops.MoeCombineBackward(dys, dweights, dout, a.ys, a.weights, a.positions, N, K_, C, k.stream);
    if (Split(k)) {  // each rank's dweights are from its part of ys: added over the group, in rank order
      const Ptr<G> all = scratch.Get<G>("all_dexpert_weights");  // (T,N,k)
      k.tp->AllGather(dweights, all, N * K_, k.stream);
      k.backend->Zero(dweights, N * K_, k.stream);
      for (int t = 0; t < k.tp->size(); ++t) ops.Accumulate(dweights, all + t * N * K_, N * K_, 1.0f, k.stream);
    }
    if (split) k.ep->AllToAll(dys, r.send_rows, dys_experts, r.recv_rows, C, k.stream);
    r.ForEachSource([&](const int32_t* counts, int64_t row) {
      ops.GroupedMatmulBackward(dswiglu + row * I_, dp + down_, dys_experts + row * C, a.swiglu + row * I_,
                                p + down_, counts, local_, I_, C, k.stream);
    });
    ops.SwiGluBackward(dgate_up, dswiglu, a.gate_up, r.rows, I_, k.stream);
    r.ForEachSource([&](const int32_t* counts, int64_t row) {
      ops.GroupedMatmulBackward(dxs_experts + row * C, dp + gate_up_, dgate_up + row * 2 * I_,
                                a.xs_experts + row * C, p + gate_up_, counts, local_, C, 2 * I_, k.stream);
    });
    if (split) k.ep->AllToAll(dxs_experts, r.recv_rows, dxs, r.send_rows, C, k.stream);
    ops.RouterTopKBackward(dlogits, dweights, k.router_dprobs, a.probs, a.experts, N, E_, K_, renormalize_,
                           k.stream);
    ops.MatmulBackward(dx, dp + router_, nullptr, dlogits, x, p + router_, nullptr, N, C, E_, k.stream);
    // Every TP rank has the whole router's part of dx: the caller's sum takes rank 0's.
    if (Split(k) && k.tp->rank() != 0) k.backend->Zero(dx, N * C, k.stream);
    ops.MoePermuteBackward(dx, dxs, a.positions, N, K_, C, k.stream);
  }

 private:
  struct Parts;
  struct Routes;
  // Whether the experts are split over a TP group of more than one rank.
  static bool Split(const Context<P>& k) { return k.tp != nullptr && k.tp->size() > 1; }
  // k.router_stats += this block's routing: its copies per expert, and the sum of each
  // expert's probability over the N tokens (downloaded: a wait on the stream).
  void AddRouterStats(const Context<P>& k, const Parts& a, const Routes& r, int64_t N) const {
    RouterStats& s = *k.router_stats;
    s.counts.resize(size_t(E_), 0), s.probabilities.resize(size_t(E_), 0);
    std::vector<G> probs(size_t(N) * size_t(E_));
    k.backend->Download(probs.data(), Ptr<const G>(a.probs), int64_t(probs.size()), k.stream);
    k.stream.Synchronize();
    for (int64_t t = 0; t < N; ++t) {
      for (int e = 0; e < E_; ++e) s.probabilities[size_t(e)] += double(probs[size_t(t) * size_t(E_) + size_t(e)]);
    }
    for (int e = 0; e < E_; ++e) s.counts[size_t(e)] += double(r.mine[size_t(e)]);
    ++s.blocks;
  }

  struct Parts {
    Ptr<A> logits, xs, gate_up, swiglu, ys;
    Ptr<G> probs, weights;
    Ptr<int32_t> experts, positions, counts;
    Ptr<int32_t> group_counts;  // (EP,E): every member's counts, with an expert group
    Ptr<A> xs_experts, ys_experts;  // the rows this rank's experts work on (xs and ys on one rank)
  };
  static Parts PartsOf(const Carving& c, bool split) {
    Parts a;
    a.logits = c.Get<A>("router_logits"), a.xs = c.Get<A>("xs"), a.gate_up = c.Get<A>("gate_up");
    a.swiglu = c.Get<A>("swiglu"), a.ys = c.Get<A>("ys");
    a.probs = c.Get<G>("router_probs"), a.weights = c.Get<G>("expert_weights");
    a.experts = c.Get<int32_t>("experts"), a.positions = c.Get<int32_t>("positions");
    a.counts = c.Get<int32_t>("counts");
    a.group_counts = split ? c.Get<int32_t>("group_counts") : nullptr;
    a.xs_experts = split ? c.Get<A>("xs_experts") : a.xs;
    a.ys_experts = split ? c.Get<A>("ys_experts") : a.ys;
    return a;
  }

  // Where a micro-batch's copies go, from the counts on the host (a wait on the stream):
  // mine (E) this rank's copies per expert; with an expert group, the rows it sends to and
  // receives from each member; and the counts of this rank's experts in the rows each
  // member sends, which its experts work on source by source.
  struct Routes {
    std::vector<int32_t> all;  // (members, E)
    std::vector<int32_t> mine;
    std::vector<int64_t> send_rows, recv_rows;
    int64_t rows = 0;  // the rows this rank's experts work on
    int members = 1, first = 0, local = 0, E = 0;
    template <class F>
    void ForEachSource(F&& f) const {
      int64_t row = 0;
      for (int m = 0; m < members; ++m) {
        f(all.data() + size_t(m) * size_t(E) + size_t(first), row);
        row += recv_rows[size_t(m)];
      }
    }
  };
  Routes RoutesOf(const Context<P>& k, const Parts& a) const {
    if (k.backend == nullptr) throw std::logic_error("MoeBlock: the context has no backend to download counts with");
    Routes r;
    r.members = k.ep != nullptr ? k.ep->size() : 1;
    const int me = k.ep != nullptr ? k.ep->rank() : 0;
    if (local_ * r.members != E_) throw std::logic_error("MoeBlock: an expert group that does not split the experts");
    r.E = E_, r.local = local_, r.first = me * local_;
    r.all.assign(size_t(r.members) * size_t(E_), 0);
    k.backend->Download(r.all.data(), Ptr<const int32_t>(k.ep != nullptr ? a.group_counts : a.counts),
                        int64_t(r.all.size()), k.stream);
    k.stream.Synchronize();
    r.mine.assign(r.all.begin() + me * E_, r.all.begin() + (me + 1) * E_);
    for (int m = 0; m < r.members; ++m) {
      int64_t send = 0, recv = 0;
      for (int e = 0; e < local_; ++e) {
        send += r.mine[size_t(m * local_ + e)];
        recv += r.all[size_t(m) * size_t(E_) + size_t(me * local_ + e)];
      }
      r.send_rows.push_back(send);
      r.recv_rows.push_back(recv);
      r.rows += recv;
    }
    return r;
  }

  int64_t router_ = 0, gate_up_ = 0, down_ = 0;
  int E_ = 0, K_ = 0;
  int I_ = 0;  // each expert's units on this TP rank: I / T
  int local_ = 0;  // the experts this rank holds: E / the expert group's size
  bool renormalize_ = true;
};

}  // namespace meshtrain::model
