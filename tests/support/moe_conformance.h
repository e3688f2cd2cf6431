// The mixture-of-experts kernels of a table (kernels/ops.h) against the CPU's Fp64 table,
// as tests/support/ops_conformance.h checks the rest, with its fixture and tolerances:
// the router's softmax and top k (ties, k = 1, 2 and 8, renormalised or not, with and
// without a load-balancing gradient), the dispatch order and its row moves (an expert
// with no tokens), the weighted combine (with a residual, and in place over it), the
// grouped products (experts with no rows), and a whole layer.
//
// The router's logits lie on a grid of 1/64, so that equal logits (ties) are common and
// distinct ones are e^(1/64) apart in probability: every table must choose the same
// experts as the reference, exactly. A table is checked by instantiating the suite as
// OpsConformance is:
//
//   INSTANTIATE_TYPED_TEST_SUITE_P(Cpu, MoeConformance, ::testing::Types<CpuBf16>);

#pragma once

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>
#include <tuple>
#include <vector>

#include "tests/support/ops_conformance.h"

namespace meshtrain::testing {

template <class Impl>
class MoeConformance : public OpsConformance<Impl> {
 protected:
  // n logits of a standard normal's spread on the grid of 1/64 in (-4, 4): values bf16
  // holds exactly.
  std::vector<double> GridLogits(int64_t n) {
    std::normal_distribution<double> normal(0.0, 1.0);
    std::vector<double> values(static_cast<size_t>(n));
    for (double& v : values) v = std::clamp(std::round(normal(this->rng_) * 64), -255.0, 255.0) / 64;
    return values;
  }
  // For each of N tokens, k distinct experts of E in random order, never `skip`.
  std::vector<double> Choices(int64_t N, int k, int E, int skip) {
    std::vector<int> pool;
    for (int e = 0; e < E; ++e) {
      if (e != skip) pool.push_back(e);
    }
    std::vector<double> choices;
    for (int64_t n = 0; n < N; ++n) {
      std::shuffle(pool.begin(), pool.end(), this->rng_);
      for (int j = 0; j < k; ++j) choices.push_back(pool[size_t(j)]);
    }
    return choices;
  }
  // A random order of the rows 0..rows-1.
  std::vector<double> Shuffled(int64_t rows) {
    std::vector<double> order(static_cast<size_t>(rows));
    std::iota(order.begin(), order.end(), 0.0);
    std::shuffle(order.begin(), order.end(), this->rng_);
    return order;
  }
  // |values| scaled into (0, 1): router weights.
  template <class T>
  std::vector<double> Weights(int64_t n) {
    std::vector<double> w = this->template Random<T>(n, 0.5);
    for (double& x : w) x = std::min(std::abs(x), 1.0);
    return w;
  }
  static std::vector<int32_t> Ints(const std::vector<double>& values) {
    return std::vector<int32_t>(values.begin(), values.end());
  }
  // Every element of got within `bound` of 0 (a gradient that must vanish).
  static void ExpectZero(const std::vector<double>& got, double bound, const std::string& what) {
    for (size_t i = 0; i < got.size(); ++i) ASSERT_LE(std::abs(got[i]), bound) << what << ": element " << i;
  }
};

TYPED_TEST_SUITE_P(MoeConformance);

TYPED_TEST_P(MoeConformance, RouterTopK) {
  using Act = typename TestFixture::A;
  using Acc = typename TestFixture::G;
  auto& impl = this->impl_;
  auto& ref = this->ref_;
  struct Case {
    int64_t N;
    int E, k;
    bool renormalize;
  };
  for (const Case c : {Case{37, 8, 2, true}, Case{37, 8, 2, false}, Case{37, 8, 1, true}, Case{37, 8, 1, false},
                       Case{19, 128, 8, true}, Case{19, 128, 8, false}, Case{5, 3, 3, true}}) {
    const int64_t N = c.N;
    const int E = c.E, k = c.k;
    const std::string at = " (N " + std::to_string(N) + ", top " + std::to_string(k) + " of " + std::to_string(E) +
                           (c.renormalize ? ", renormalised)" : ")");
    auto logits = this->GridLogits(N * E);
    // Ties: row 0 all equal (the first k experts), row 1 its two largest equal at E-1 and 1
    // and the rest equal (1, E-1, then 0, 2, 3, ...).
    for (int e = 0; e < E; ++e) logits[size_t(e)] = 0.5, logits[size_t(E + e)] = -1.0;
    logits[size_t(E + E - 1)] = logits[size_t(E + 1)] = 2.0;
    auto probs = impl.template Poisoned<Acc>(N * E), weights = impl.template Poisoned<Acc>(N * k);
    auto experts = impl.template Poisoned<int32_t>(N * k);
    impl.ops->RouterTopKForward(probs, experts, weights, impl.template Put<Act>(logits), N, E, k, c.renormalize,
                                *impl.stream);
    auto ref_probs = ref.template Poisoned<double>(N * E), ref_weights = ref.template Poisoned<double>(N * k);
    auto ref_experts = ref.template Poisoned<int32_t>(N * k);
    ref.ops->RouterTopKForward(ref_probs, ref_experts, ref_weights, ref.template Put<double>(logits), N, E, k,
                               c.renormalize, *ref.stream);
    const auto got_experts = impl.Get(experts, N * k), want_experts = ref.Get(ref_experts, N * k);
    ASSERT_EQ(got_experts, want_experts) << "RouterTopKForward experts" << at;
    std::vector<double> row1 = {1, double(E - 1), 0};
    for (int e = 2; e < E - 1; ++e) row1.push_back(e);
    for (int j = 0; j < k; ++j) {
      EXPECT_EQ(want_experts[size_t(j)], j) << "equal probabilities: the lower index first" << at;
      EXPECT_EQ(want_experts[size_t(k + j)], row1[size_t(j)]) << "equal probabilities: the lower index first" << at;
    }
    const auto got_probs = impl.Get(probs, N * E), got_weights = impl.Get(weights, N * k);
    this->ExpectClose(got_probs, ref.Get(ref_probs, N * E), "RouterTopKForward probs" + at);
    this->ExpectClose(got_weights, ref.Get(ref_weights, N * k), "RouterTopKForward weights" + at);
    for (int64_t n = 0; n < N && c.renormalize; ++n) {
      double sum = 0;
      for (int j = 0; j < k; ++j) sum += got_weights[size_t(n * k + j)];
      ASSERT_NEAR(sum, 1.0, 1e-5) << "renormalised weights of row " << n << at;
    }

    // The backward from the table's own probabilities and choices, on both sides.
    const auto dweights = this->template Random<Acc>(N * k), dprobs = this->template Random<Acc>(N * E, 0.1);
    for (const bool with_dprobs : {false, true}) {
      const std::string how = std::string(with_dprobs ? ", with dprobs" : "") + at;
      auto dlogits = impl.template Poisoned<Act>(N * E);
      impl.ops->RouterTopKBackward(dlogits, impl.template Put<Acc>(dweights),
                                   with_dprobs ? impl.template Put<Acc>(dprobs) : nullptr,
                                   impl.template Put<Acc>(got_probs), impl.template Put<int32_t>(got_experts), N, E, k,
                                   c.renormalize, *impl.stream);
      auto ref_dlogits = ref.template Poisoned<double>(N * E);
      ref.ops->RouterTopKBackward(ref_dlogits, ref.template Put<double>(dweights),
                                  with_dprobs ? ref.template Put<double>(dprobs) : nullptr,
                                  ref.template Put<double>(got_probs), ref.template Put<int32_t>(got_experts), N, E, k,
                                  c.renormalize, *ref.stream);
      const auto got = impl.Get(dlogits, N * E);
      if (k == 1 && c.renormalize && !with_dprobs) {
        // One expert renormalised weighs 1 whatever the logits: no gradient.
        this->ExpectZero(got, 1e-6, "RouterTopKBackward dlogits" + how);
      } else {
        this->ExpectClose(got, ref.Get(ref_dlogits, N * E), "RouterTopKBackward dlogits" + how);
      }
    }
    impl.keep.clear();
    ref.keep.clear();
  }
}

// The dispatch order, then x's rows moved into it and their gradients back; expert
// `skip` gets no tokens.
TYPED_TEST_P(MoeConformance, Dispatch) {
  using Act = typename TestFixture::A;
  auto& impl = this->impl_;
  auto& ref = this->ref_;
  for (const auto& [N, k, E, C] : {std::tuple<int64_t, int, int, int>{37, 2, 8, 96}, {37, 1, 8, 96},
                                   {41, 8, 64, 40}, {29, 2, 5, 333}, {300, 4, 16, 8}}) {
    const int skip = 3;
    const std::string at = " (N " + std::to_string(N) + ", k " + std::to_string(k) + ", E " + std::to_string(E) +
                           ", C " + std::to_string(C) + ")";
    const auto choices = this->Choices(N, k, E, skip);
    auto counts = impl.template Poisoned<int32_t>(E), positions = impl.template Poisoned<int32_t>(N * k);
    impl.ops->MoePermutePlan(counts, positions, impl.template Put<int32_t>(choices), N, k, E, *impl.stream);
    auto ref_counts = ref.template Poisoned<int32_t>(E), ref_positions = ref.template Poisoned<int32_t>(N * k);
    ref.ops->MoePermutePlan(ref_counts, ref_positions, ref.template Put<int32_t>(choices), N, k, E, *ref.stream);
    const auto got_counts = impl.Get(counts, E), got_positions = impl.Get(positions, N * k);
    ASSERT_EQ(got_counts, ref.Get(ref_counts, E)) << "MoePermutePlan counts" << at;
    ASSERT_EQ(got_positions, ref.Get(ref_positions, N * k)) << "MoePermutePlan positions" << at;
    EXPECT_EQ(got_counts[size_t(skip)], 0) << at;

    const auto x = this->template Random<Act>(N * C);
    auto xs = impl.template Poisoned<Act>(N * k * C);
    impl.ops->MoePermute(xs, impl.template Put<Act>(x), positions, N, k, C, *impl.stream);
    auto ref_xs = ref.template Poisoned<double>(N * k * C);
    ref.ops->MoePermute(ref_xs, ref.template Put<double>(x), ref_positions, N, k, C, *ref.stream);
    EXPECT_EQ(impl.Get(xs, N * k * C), ref.Get(ref_xs, N * k * C)) << "MoePermute moves rows unchanged" << at;

    const auto dx0 = this->template Random<Act>(N * C), dxs = this->template Random<Act>(N * k * C);
    auto dx = impl.template Put<Act>(dx0);
    impl.ops->MoePermuteBackward(dx, impl.template Put<Act>(dxs), positions, N, k, C, *impl.stream);
    auto ref_dx = ref.template Put<double>(dx0);
    ref.ops->MoePermuteBackward(ref_dx, ref.template Put<double>(dxs), ref_positions, N, k, C, *ref.stream);
    this->ExpectClose(impl.Get(dx, N * C), ref.Get(ref_dx, N * C), "MoePermuteBackward dx (+=)" + at);
    impl.keep.clear();
    ref.keep.clear();
  }
}

TYPED_TEST_P(MoeConformance, Combine) {
  using Act = typename TestFixture::A;
  using Acc = typename TestFixture::G;
  auto& impl = this->impl_;
  auto& ref = this->ref_;
  for (const auto& [N, k, C] : {std::tuple<int64_t, int, int>{37, 2, 96}, {37, 1, 333}, {23, 8, 40}}) {
    const std::string at = " (N " + std::to_string(N) + ", k " + std::to_string(k) + ", C " + std::to_string(C) + ")";
    const auto positions = this->Shuffled(N * k);
    const auto ys = this->template Random<Act>(N * k * C), weights = this->template Weights<Acc>(N * k),
               residual = this->template Random<Act>(N * C);
    auto impl_positions = impl.template Put<int32_t>(positions);
    auto impl_ys = impl.template Put<Act>(ys);
    auto impl_weights = impl.template Put<Acc>(weights);
    auto ref_positions = ref.template Put<int32_t>(positions);
    auto ref_ys = ref.template Put<double>(ys);
    auto ref_weights = ref.template Put<double>(weights);
    for (const int mode : {0, 1, 2}) {  // no residual, a residual, the residual in place
      const std::string how = std::string(mode == 0 ? "" : mode == 1 ? ", residual" : ", residual in place") + at;
      auto out = mode == 2 ? impl.template Put<Act>(residual) : impl.template Poisoned<Act>(N * C);
      impl.ops->MoeCombineForward(out, impl_ys, impl_weights, impl_positions,
                                  mode == 0 ? nullptr : mode == 1 ? impl.template Put<Act>(residual) : out, N, k, C,
                                  *impl.stream);
      auto ref_out = ref.template Poisoned<double>(N * C);
      ref.ops->MoeCombineForward(ref_out, ref_ys, ref_weights, ref_positions,
                                 mode == 0 ? nullptr : ref.template Put<double>(residual), N, k, C, *ref.stream);
      this->ExpectClose(impl.Get(out, N * C), ref.Get(ref_out, N * C), "MoeCombineForward" + how);
    }
    const auto dout = this->template Random<Act>(N * C);
    auto dys = impl.template Poisoned<Act>(N * k * C);
    auto dweights = impl.template Poisoned<Acc>(N * k);
    impl.ops->MoeCombineBackward(dys, dweights, impl.template Put<Act>(dout), impl_ys, impl_weights, impl_positions, N,
                                 k, C, *impl.stream);
    auto ref_dys = ref.template Poisoned<double>(N * k * C);
    auto ref_dweights = ref.template Poisoned<double>(N * k);
    ref.ops->MoeCombineBackward(ref_dys, ref_dweights, ref.template Put<double>(dout), ref_ys, ref_weights,
                                ref_positions, N, k, C, *ref.stream);
    this->ExpectClose(impl.Get(dys, N * k * C), ref.Get(ref_dys, N * k * C), "MoeCombineBackward dys" + at);
    this->ExpectClose(impl.Get(dweights, N * k), ref.Get(ref_dweights, N * k), "MoeCombineBackward dweights" + at);
    impl.keep.clear();
    ref.keep.clear();
  }
}

TYPED_TEST_P(MoeConformance, GroupedMatmul) {
  using Act = typename TestFixture::A;
  using Acc = typename TestFixture::G;
  auto& impl = this->impl_;
  auto& ref = this->ref_;
  for (const auto& [counts, K, OC] : {std::tuple<std::vector<int32_t>, int, int>{{7, 0, 20, 1, 9}, 96, 40},
                                      {{0, 33, 0, 4}, 37, 64}, {{64}, 128, 256}, {{0, 0}, 16, 16}}) {
    const int E = int(counts.size());
    const int64_t rows = std::accumulate(counts.begin(), counts.end(), int64_t{0});
    std::string at = " (K " + std::to_string(K) + ", OC " + std::to_string(OC) + ", rows";
    for (const int32_t m : counts) at += " " + std::to_string(m);
    at += ")";
    const int64_t W = int64_t(E) * OC * K;
    const auto x = this->template Random<Act>(rows * K), w = this->template Random<Act>(W, 0.05),
               dout = this->template Random<Act>(rows * OC), dw0 = this->template Random<Acc>(W);
    auto out = impl.template Poisoned<Act>(rows * OC);
    auto impl_x = impl.template Put<Act>(x), impl_w = impl.template Put<Act>(w);
    impl.ops->GroupedMatmulForward(out, impl_x, impl_w, counts.data(), E, K, OC, *impl.stream);
    auto ref_out = ref.template Poisoned<double>(rows * OC);
    auto ref_x = ref.template Put<double>(x), ref_w = ref.template Put<double>(w);
    ref.ops->GroupedMatmulForward(ref_out, ref_x, ref_w, counts.data(), E, K, OC, *ref.stream);
    auto dinp = impl.template Poisoned<Act>(rows * K);
    auto dw = impl.template Put<Acc>(dw0);
    impl.ops->GroupedMatmulBackward(dinp, dw, impl.template Put<Act>(dout), impl_x, impl_w, counts.data(), E, K, OC,
                                    *impl.stream);
    auto ref_dinp = ref.template Poisoned<double>(rows * K);
    auto ref_dw = ref.template Put<double>(dw0);
    ref.ops->GroupedMatmulBackward(ref_dinp, ref_dw, ref.template Put<double>(dout), ref_x, ref_w, counts.data(), E,
                                   K, OC, *ref.stream);
    const auto got_dw = impl.Get(dw, W);
    if (rows > 0) {
      this->ExpectClose(impl.Get(out, rows * OC), ref.Get(ref_out, rows * OC), "GroupedMatmulForward" + at);
      this->ExpectClose(impl.Get(dinp, rows * K), ref.Get(ref_dinp, rows * K), "GroupedMatmulBackward dinp" + at);
      this->ExpectClose(got_dw, ref.Get(ref_dw, W), "GroupedMatmulBackward dweight (+=)" + at);
    }
    for (int e = 0; e < E; ++e) {  // an expert with no rows adds nothing
      if (counts[size_t(e)] != 0) continue;
      for (int64_t i = int64_t(e) * OC * K; i < int64_t(e + 1) * OC * K; ++i) {
        ASSERT_EQ(got_dw[size_t(i)], dw0[size_t(i)]) << "GroupedMatmulBackward changed expert " << e << at;
      }
    }
    impl.keep.clear();
    ref.keep.clear();
  }
}

// A whole layer from the router's logits: top k, dispatch, gate_up, SwiGLU, down, combine
// onto a residual, and back to the logits, x and the experts' weights; each side from the
// same inputs, the counts downloaded to the host between the plan and the products.
TYPED_TEST_P(MoeConformance, Layer) {
  using Act = typename TestFixture::A;
  using Acc = typename TestFixture::G;
  auto& impl = this->impl_;
  auto& ref = this->ref_;
  const int64_t N = 37;
  const int E = 8, k = 2, C = 64, H = 48;
  const auto logits = this->GridLogits(N * E), x = this->template Random<Act>(N * C),
             residual = this->template Random<Act>(N * C), dout = this->template Random<Act>(N * C),
             w_gate_up = this->template Random<Act>(int64_t(E) * 2 * H * C, 0.1),
             w_down = this->template Random<Act>(int64_t(E) * C * H, 0.1),
             dx0 = this->template Random<Act>(N * C);
  struct Result {
    std::vector<double> out, dlogits, dx, dw_gate_up, dw_down;
  };
  auto run = [&](auto& side, auto act, auto acc) {
    using SA = decltype(act);
    using SG = decltype(acc);
    auto& ops = *side.ops;
    auto& s = *side.stream;
    auto probs = side.template Poisoned<SG>(N * E), weights = side.template Poisoned<SG>(N * k);
    auto experts = side.template Poisoned<int32_t>(N * k), counts = side.template Poisoned<int32_t>(E),
         positions = side.template Poisoned<int32_t>(N * k);
    auto in_x = side.template Put<SA>(x), wgu = side.template Put<SA>(w_gate_up), wd = side.template Put<SA>(w_down);
    ops.RouterTopKForward(probs, experts, weights, side.template Put<SA>(logits), N, E, k, true, s);
    ops.MoePermutePlan(counts, positions, experts, N, k, E, s);
    const std::vector<int32_t> host_counts = this->Ints(side.Get(counts, E));
    auto xs = side.template Poisoned<SA>(N * k * C), gate_up = side.template Poisoned<SA>(N * k * 2 * H),
         h = side.template Poisoned<SA>(N * k * H), ys = side.template Poisoned<SA>(N * k * C),
         out = side.template Poisoned<SA>(N * C);
    ops.MoePermute(xs, in_x, positions, N, k, C, s);
    ops.GroupedMatmulForward(gate_up, xs, wgu, host_counts.data(), E, C, 2 * H, s);
    ops.SwiGluForward(h, gate_up, N * k, H, s);
    ops.GroupedMatmulForward(ys, h, wd, host_counts.data(), E, H, C, s);
    ops.MoeCombineForward(out, ys, weights, positions, side.template Put<SA>(residual), N, k, C, s);
    auto dys = side.template Poisoned<SA>(N * k * C), dh = side.template Poisoned<SA>(N * k * H),
         dgate_up = side.template Poisoned<SA>(N * k * 2 * H), dxs = side.template Poisoned<SA>(N * k * C),
         dlogits = side.template Poisoned<SA>(N * E), dx = side.template Put<SA>(dx0);
    auto dweights = side.template Poisoned<SG>(N * k);
    auto dwgu = side.template Put<SG>(std::vector<double>(size_t(E) * 2 * H * C, 0.0)),
         dwd = side.template Put<SG>(std::vector<double>(size_t(E) * C * H, 0.0));
    ops.MoeCombineBackward(dys, dweights, side.template Put<SA>(dout), ys, weights, positions, N, k, C, s);
    ops.GroupedMatmulBackward(dh, dwd, dys, h, wd, host_counts.data(), E, H, C, s);
    ops.SwiGluBackward(dgate_up, dh, gate_up, N * k, H, s);
    ops.GroupedMatmulBackward(dxs, dwgu, dgate_up, xs, wgu, host_counts.data(), E, C, 2 * H, s);
    ops.MoePermuteBackward(dx, dxs, positions, N, k, C, s);
    ops.RouterTopKBackward(dlogits, dweights, nullptr, probs, experts, N, E, k, true, s);
    return Result{side.Get(out, N * C), side.Get(dlogits, N * E), side.Get(dx, N * C),
                  side.Get(dwgu, int64_t(E) * 2 * H * C), side.Get(dwd, int64_t(E) * C * H)};
  };
  const Result got = run(impl, Act{}, Acc{}), want = run(ref, double{}, double{});
  this->ExpectClose(got.out, want.out, "MoE layer out");
  this->ExpectClose(got.dlogits, want.dlogits, "MoE layer dlogits");
  this->ExpectClose(got.dx, want.dx, "MoE layer dx (+=)");
  this->ExpectClose(got.dw_gate_up, want.dw_gate_up, "MoE layer dweight of gate_up");
  this->ExpectClose(got.dw_down, want.dw_down, "MoE layer dweight of down");
}

REGISTER_TYPED_TEST_SUITE_P(MoeConformance, RouterTopK, Dispatch, Combine, GroupedMatmul, Layer);

}  // namespace meshtrain::testing
