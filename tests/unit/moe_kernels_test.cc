// The mixture-of-experts kernels of the CPU's fp64 reference (kernels/cpu/moe.cc), which
// every table is checked against (tests/support/moe_conformance.h), checked themselves:
// a whole sparse MLP layer composed of them (router, top k, dispatch, grouped gate_up,
// SwiGLU, grouped down, combine) against a dense computation of the same layer that runs
// every token through its experts one by one, as transformers' Mixtral and Qwen3-MoE do;
// its backward against central differences of that dense layer; and the dispatch order
// against std::stable_sort.

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "worker/kernels/cpu/kernels.h"

namespace meshtrain::kernels::cpu::moe_test {
namespace {

using Vec = std::vector<double>;

Vec Normal(size_t n, uint64_t seed, double scale = 1.0) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> dist(0.0, scale);
  Vec v(n);
  for (double& x : v) x = dist(rng);
  return v;
}

double Inner(const Vec& a, const Vec& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// The layer: x (N,C) routed by router (E,C) to k of E experts, expert e's gate_up (2H,C)
// (gate rows, then up rows) and down (C,H); out = residual + the weighted experts.
struct Layer {
  int N, C, H, E, k;
  bool renormalize;
  Vec x, router, gate_up, down, residual;
};

struct Outputs {
  Vec out, probs;
  std::vector<int32_t> experts;
  std::vector<int32_t> counts;
};

// As transformers computes it: softmax, top k (ties to the lower index), optional
// renormalisation, and each token through each of its experts in full.
Outputs Dense(const Layer& l) {
  Outputs o;
  o.out = l.residual;
  o.probs.assign(size_t(l.N) * l.E, 0);
  o.counts.assign(size_t(l.E), 0);
  for (int n = 0; n < l.N; ++n) {
    const double* x = &l.x[size_t(n) * l.C];
    Vec logits(size_t(l.E));
    for (int e = 0; e < l.E; ++e) {
      for (int c = 0; c < l.C; ++c) logits[size_t(e)] += l.router[size_t(e) * l.C + c] * x[c];
    }
    const double max = *std::max_element(logits.begin(), logits.end());
    double sum = 0;
    for (double& v : logits) sum += (v = std::exp(v - max));
    double* p = &o.probs[size_t(n) * l.E];
    for (int e = 0; e < l.E; ++e) p[e] = logits[size_t(e)] / sum;
    std::vector<int> order(size_t(l.E));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return p[a] > p[b]; });
    double chosen = 0;
    for (int j = 0; j < l.k; ++j) chosen += p[order[size_t(j)]];
    for (int j = 0; j < l.k; ++j) {
      const int e = order[size_t(j)];
      o.experts.push_back(e);
      ++o.counts[size_t(e)];
      const double w = l.renormalize ? p[e] / chosen : p[e];
      Vec h(size_t(l.H));
      for (int i = 0; i < l.H; ++i) {
        double g = 0, u = 0;
        for (int c = 0; c < l.C; ++c) {
          g += l.gate_up[(size_t(e) * 2 * l.H + i) * l.C + c] * x[c];
          u += l.gate_up[(size_t(e) * 2 * l.H + l.H + i) * l.C + c] * x[c];
        }
        h[size_t(i)] = g / (1 + std::exp(-g)) * u;
      }
      for (int c = 0; c < l.C; ++c) {
        double y = 0;
        for (int i = 0; i < l.H; ++i) y += l.down[(size_t(e) * l.C + c) * l.H + i] * h[size_t(i)];
        o.out[size_t(n) * l.C + c] += w * y;
      }
    }
  }
  return o;
}

// The same layer through the kernels, forward and, given dout and dprobs, backward.
struct Sparse {
  Outputs o;
  Vec logits, weights, xs, gate_up_rows, h, ys;
  std::vector<int32_t> positions;
  Vec dx, drouter, dgate_up, ddown;
};

Sparse RunKernels(const Layer& l, const Vec* dout, const Vec* dprobs) {
  const int N = l.N, C = l.C, H = l.H, E = l.E, k = l.k;
  const int64_t copies = int64_t(N) * k;
  Sparse s;
  s.logits.resize(size_t(N) * E);
  MatmulForward<double, double>(s.logits.data(), nullptr, l.x.data(), l.router.data(), nullptr, nullptr, N, C, E);
  s.o.probs.resize(size_t(N) * E);
  s.o.experts.resize(size_t(copies));
  s.weights.resize(size_t(copies));
  RouterTopKForward<double, double>(s.o.probs.data(), s.o.experts.data(), s.weights.data(), s.logits.data(), N, E, k,
                                    l.renormalize);
  s.o.counts.resize(size_t(E));
  s.positions.resize(size_t(copies));
  MoePermutePlan(s.o.counts.data(), s.positions.data(), s.o.experts.data(), N, k, E);
  s.xs.resize(size_t(copies) * C);
  MoePermute<double, double>(s.xs.data(), l.x.data(), s.positions.data(), N, k, C);
  s.gate_up_rows.resize(size_t(copies) * 2 * H);
  GroupedMatmulForward<double, double>(s.gate_up_rows.data(), s.xs.data(), l.gate_up.data(), s.o.counts.data(), E, C,
                                       2 * H);
  s.h.resize(size_t(copies) * H);
  SwiGluForward<double, double>(s.h.data(), s.gate_up_rows.data(), copies, H);
  s.ys.resize(size_t(copies) * C);
  GroupedMatmulForward<double, double>(s.ys.data(), s.h.data(), l.down.data(), s.o.counts.data(), E, H, C);
  s.o.out.resize(size_t(N) * C);
  MoeCombineForward<double, double>(s.o.out.data(), s.ys.data(), s.weights.data(), s.positions.data(),
                                    l.residual.data(), N, k, C);
  if (dout == nullptr) return s;

  Vec dys(size_t(copies) * C), dweights(static_cast<size_t>(copies)), dh(size_t(copies) * H), dgu(size_t(copies) * 2 * H),
      dxs(size_t(copies) * C), dlogits(size_t(N) * E);
  s.ddown.assign(l.down.size(), 0);
  s.dgate_up.assign(l.gate_up.size(), 0);
  s.drouter.assign(l.router.size(), 0);
  s.dx.assign(l.x.size(), 123.0);  // written by the router's backward, then added to
  MoeCombineBackward<double, double>(dys.data(), dweights.data(), dout->data(), s.ys.data(), s.weights.data(),
                                     s.positions.data(), N, k, C);
  GroupedMatmulBackward<double, double>(dh.data(), s.ddown.data(), dys.data(), s.h.data(), l.down.data(),
                                        s.o.counts.data(), E, H, C);
  SwiGluBackward<double, double>(dgu.data(), dh.data(), s.gate_up_rows.data(), copies, H);
  GroupedMatmulBackward<double, double>(dxs.data(), s.dgate_up.data(), dgu.data(), s.xs.data(), l.gate_up.data(),
                                        s.o.counts.data(), E, C, 2 * H);
  RouterTopKBackward<double, double>(dlogits.data(), dweights.data(), dprobs->data(), s.o.probs.data(),
                                     s.o.experts.data(), N, E, k, l.renormalize);
  MatmulBackward<double, double>(s.dx.data(), s.drouter.data(), nullptr, dlogits.data(), l.x.data(), l.router.data(),
                                 nullptr, N, C, E);
  MoePermuteBackward<double, double>(s.dx.data(), dxs.data(), s.positions.data(), N, k, C);
  return s;
}

// A layer whose last expert no token chooses: every x has a large first channel that the
// last router row weighs strongly against.
Layer MakeLayer(int k, bool renormalize, uint64_t seed) {
  Layer l{5, 6, 4, 6, k, renormalize, {}, {}, {}, {}, {}};
  l.x = Normal(size_t(l.N) * l.C, seed);
  for (int n = 0; n < l.N; ++n) l.x[size_t(n) * l.C] = 3 + std::abs(l.x[size_t(n) * l.C]);
  l.router = Normal(size_t(l.E) * l.C, seed + 1);
  l.router[size_t(l.E - 1) * l.C] = -5;
  l.gate_up = Normal(size_t(l.E) * 2 * l.H * l.C, seed + 2, 0.5);
  l.down = Normal(size_t(l.E) * l.C * l.H, seed + 3, 0.5);
  l.residual = Normal(size_t(l.N) * l.C, seed + 4);
  return l;
}

void ExpectNear(const Vec& got, const Vec& want, double tolerance, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_NEAR(got[i], want[i], tolerance * std::max(1.0, std::abs(want[i]))) << what << "[" << i << "]";
  }
}

// analytic against central differences of `loss` in every element of *x.
void ExpectDifferences(const std::string& what, Vec* x, const Vec& analytic, const std::function<double()>& loss) {
  ASSERT_EQ(x->size(), analytic.size()) << what;
  const double h = 1e-5;
  for (size_t i = 0; i < x->size(); ++i) {
    const double saved = (*x)[i];
    (*x)[i] = saved + h;
    const double plus = loss();
    (*x)[i] = saved - h;
    const double minus = loss();
    (*x)[i] = saved;
    const double numeric = (plus - minus) / (2 * h);
    EXPECT_NEAR(analytic[i], numeric, 1e-6 * std::max(1.0, std::abs(numeric))) << what << "[" << i << "]";
  }
}

struct LayerCase {
  int k;
  bool renormalize;
};

class MoeLayer : public ::testing::TestWithParam<LayerCase> {};

TEST_P(MoeLayer, KernelsMatchTheDenseLayerAndTheirGradientsItsDifferences) {
  const LayerCase c = GetParam();
  Layer l = MakeLayer(c.k, c.renormalize, 100 + uint64_t(c.k) * 10 + c.renormalize);
  const Outputs dense = Dense(l);
  const Vec dout = Normal(size_t(l.N) * l.C, 7), dprobs = Normal(size_t(l.N) * l.E, 8);
  const Sparse sparse = RunKernels(l, &dout, &dprobs);
  EXPECT_EQ(sparse.o.experts, dense.experts);
  EXPECT_EQ(sparse.o.counts, dense.counts);
  EXPECT_EQ(sparse.o.counts[size_t(l.E - 1)], 0) << "the last expert has no tokens";
  ExpectNear(sparse.o.probs, dense.probs, 1e-13, "probs");
  ExpectNear(sparse.o.out, dense.out, 1e-12, "out");

  // The gradient of dout . out + dprobs . probs (dprobs standing for a load-balancing
  // loss's), with the experts each token chose held fixed: the differences must not
  // change them.
  auto loss = [&] {
    const Outputs o = Dense(l);
    EXPECT_EQ(o.experts, dense.experts) << "a difference changed the experts chosen";
    return Inner(o.out, dout) + Inner(o.probs, dprobs);
  };
  ExpectDifferences("dx", &l.x, sparse.dx, loss);
  ExpectDifferences("drouter", &l.router, sparse.drouter, loss);
  ExpectDifferences("dgate_up", &l.gate_up, sparse.dgate_up, loss);
  ExpectDifferences("ddown", &l.down, sparse.ddown, loss);
}

INSTANTIATE_TEST_SUITE_P(TopK, MoeLayer,
                         ::testing::Values(LayerCase{1, false}, LayerCase{1, true}, LayerCase{2, false},
                                           LayerCase{2, true}, LayerCase{3, true}),
                         [](const ::testing::TestParamInfo<LayerCase>& param) {
                           return "Top" + std::to_string(param.param.k) +
                                  (param.param.renormalize ? "Renormalised" : "");
                         });

TEST(MoeKernels, DispatchOrderIsAStableSortByExpert) {
  const int64_t N = 301;
  const int k = 3, E = 17;
  std::mt19937_64 rng(5);
  std::vector<int32_t> experts;
  for (int64_t n = 0; n < N; ++n) {
    std::vector<int32_t> pool(static_cast<size_t>(E));
    std::iota(pool.begin(), pool.end(), 0);
    std::shuffle(pool.begin(), pool.end(), rng);
    for (int j = 0; j < k; ++j) experts.push_back(pool[size_t(j)] == 11 ? 12 % E : pool[size_t(j)]);
  }
  // Expert 11 never chosen; 12 may then be chosen twice by one token: still a stable order.
  std::vector<int32_t> counts(size_t(E), -1), positions(size_t(N * k), -1);
  MoePermutePlan(counts.data(), positions.data(), experts.data(), N, k, E);
  std::vector<int64_t> order(size_t(N * k));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return experts[size_t(a)] < experts[size_t(b)]; });
  for (size_t row = 0; row < order.size(); ++row) {
    ASSERT_EQ(positions[size_t(order[row])], int32_t(row)) << "copy " << order[row];
  }
  EXPECT_EQ(counts[11], 0);
  for (int e = 0; e < E; ++e) {
    EXPECT_EQ(counts[size_t(e)], std::count(experts.begin(), experts.end(), e)) << "expert " << e;
  }
  experts[7] = E;  // out of range
  EXPECT_THROW(MoePermutePlan(counts.data(), positions.data(), experts.data(), N, k, E), std::invalid_argument);
}

TEST(MoeKernels, EqualProbabilitiesChooseTheLowerIndex) {
  const int E = 6, k = 3;
  // Row 0: all equal. Row 1: experts 4 and 2 share the largest logit, 5 and 0 the next.
  const Vec logits = {0.25, 0.25, 0.25, 0.25, 0.25, 0.25, 1.0, -2.0, 3.0, -2.0, 3.0, 1.0};
  for (const bool renormalize : {false, true}) {
    Vec probs(logits.size()), weights(2 * k);
    std::vector<int32_t> experts(2 * k);
    RouterTopKForward<double, double>(probs.data(), experts.data(), weights.data(), logits.data(), 2, E, k, renormalize);
    EXPECT_EQ(experts, (std::vector<int32_t>{0, 1, 2, 2, 4, 0}));
    for (int j = 0; j < k; ++j) EXPECT_DOUBLE_EQ(weights[size_t(j)], renormalize ? 1.0 / k : 1.0 / E);
    EXPECT_DOUBLE_EQ(weights[3], weights[4]);
    if (renormalize) {
      EXPECT_NEAR(weights[3] + weights[4] + weights[5], 1.0, 1e-15);
    }
  }
}

}  // namespace
}  // namespace meshtrain::kernels::cpu::moe_test
