// The mixture-of-experts kernels on the CPU (kernels.h; contracts in kernels/ops.h): the
// router's softmax and top k, the dispatch order and the row moves it drives, and the
// grouped expert products (one OpenBLAS product per expert with rows, through
// MatmulForward and MatmulBackward). As kernels.cc's: computed in G from the stored
// values, each stored value rounded once to A; rows in parallel, every sum in a fixed
// order. Helpers carry a Moe prefix: this file shares a unity unit with kernels.cc.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "worker/kernels/cpu/kernels.h"
#include "worker/runtime/bf16.h"

namespace meshtrain::kernels::cpu {
namespace {

using runtime::bf16;

template <class G, class A>
G MoeLoad(A x) {
  return static_cast<G>(x);
}

// Per-thread rows of G, reused from call to call.
template <class G>
G* MoeRow(int64_t n) {
  thread_local std::vector<G> row;
  if (int64_t(row.size()) < n) row.resize(size_t(n));
  return row.data();
}

// Whether expert e of probability p comes after (prev_p, prev_e) in the router's order:
// by probability, descending, then by index, ascending.
template <class G>
bool MoeAfter(G p, int e, G prev_p, int prev_e) {
  return p < prev_p || (p == prev_p && e > prev_e);
}

}  // namespace

template <class A, class G>
void RouterTopKForward(G* probs, int32_t* experts, G* weights, const A* logits, int64_t N, int E, int k,
                       bool renormalize) {
  if (k < 1 || k > E) {
    throw std::invalid_argument("RouterTopKForward: k = " + std::to_string(k) + " of " + std::to_string(E) +
                                " experts");
  }
#pragma omp parallel for
  for (int64_t n = 0; n < N; ++n) {
    const A* l = logits + n * E;
    G* p = probs + n * E;
    G max = -std::numeric_limits<G>::infinity();
    for (int e = 0; e < E; ++e) max = std::max(max, MoeLoad<G>(l[e]));
    G sum = 0;
    for (int e = 0; e < E; ++e) {
      p[e] = std::exp(MoeLoad<G>(l[e]) - max);
      sum += p[e];
    }
    for (int e = 0; e < E; ++e) p[e] = p[e] / sum;
    // k passes, each taking the first expert after the previous one in the router's order.
    G prev_p = std::numeric_limits<G>::infinity(), total = 0;
    int prev_e = -1;
    for (int j = 0; j < k; ++j) {
      G best_p = -1;
      int best_e = -1;
      for (int e = 0; e < E; ++e) {
        if (!MoeAfter(p[e], e, prev_p, prev_e)) continue;
        if (best_e < 0 || p[e] > best_p) best_p = p[e], best_e = e;  // ties keep the lower index
      }
      experts[n * k + j] = best_e;
      weights[n * k + j] = best_p;
      total += best_p;
      prev_p = best_p, prev_e = best_e;
    }
    if (renormalize) {
      for (int j = 0; j < k; ++j) weights[n * k + j] = weights[n * k + j] / total;
    }
  }
}

// w_j = p_j / s with s the sum of the k: dp_j = (dw_j - sum_i dw_i w_i) / s; without
// renormalising, dp_j = dw_j. Then through the softmax: dl = p (dp - p . dp).
template <class A, class G>
void RouterTopKBackward(A* dlogits, const G* dweights, const G* dprobs, const G* probs, const int32_t* experts,
                        int64_t N, int E, int k, bool renormalize) {
#pragma omp parallel for
  for (int64_t n = 0; n < N; ++n) {
    const G* p = probs + n * E;
    const int32_t* chosen = experts + n * k;
    const G* dw = dweights + n * k;
    G s = 0, c = 0;
    if (renormalize) {
      for (int j = 0; j < k; ++j) s += p[chosen[j]];
      for (int j = 0; j < k; ++j) c += dw[j] * (p[chosen[j]] / s);
    }
    G* dp = MoeRow<G>(E);
    for (int e = 0; e < E; ++e) dp[e] = dprobs ? dprobs[n * E + e] : G(0);
    for (int j = 0; j < k; ++j) dp[chosen[j]] += renormalize ? (dw[j] - c) / s : dw[j];
    G inner = 0;
    for (int e = 0; e < E; ++e) inner += p[e] * dp[e];
    for (int e = 0; e < E; ++e) dlogits[n * E + e] = A(p[e] * (dp[e] - inner));
  }
}

void MoePermutePlan(int32_t* counts, int32_t* positions, const int32_t* experts, int64_t N, int k, int E) {
  const int64_t copies = N * k;
  if (copies > std::numeric_limits<int32_t>::max()) {
    throw std::invalid_argument("MoePermutePlan: " + std::to_string(copies) + " copies of tokens overflow int32");
  }
  std::fill(counts, counts + E, 0);
  for (int64_t i = 0; i < copies; ++i) {
    if (experts[i] < 0 || experts[i] >= E) {
      throw std::invalid_argument("MoePermutePlan: copy " + std::to_string(i) + " goes to expert " +
                                  std::to_string(experts[i]) + " of " + std::to_string(E));
    }
    ++counts[experts[i]];
  }
  std::vector<int32_t> next(size_t(E), 0);
  for (int e = 1; e < E; ++e) next[size_t(e)] = next[size_t(e - 1)] + counts[e - 1];
  for (int64_t i = 0; i < copies; ++i) positions[i] = next[size_t(experts[i])]++;
}

template <class A, class G>
void MoePermute(A* xs, const A* x, const int32_t* positions, int64_t N, int k, int C) {
#pragma omp parallel for
  for (int64_t n = 0; n < N; ++n) {
    for (int j = 0; j < k; ++j) std::memcpy(xs + int64_t(positions[n * k + j]) * C, x + n * C, sizeof(A) * size_t(C));
  }
}

template <class A, class G>
void MoePermuteBackward(A* dx, const A* dxs, const int32_t* positions, int64_t N, int k, int C) {
#pragma omp parallel for
  for (int64_t n = 0; n < N; ++n) {
    G* sum = MoeRow<G>(C);
    std::fill(sum, sum + C, G(0));
    for (int j = 0; j < k; ++j) {
      const A* d = dxs + int64_t(positions[n * k + j]) * C;
      for (int c = 0; c < C; ++c) sum[c] += MoeLoad<G>(d[c]);
    }
    A* o = dx + n * C;
    for (int c = 0; c < C; ++c) o[c] = A(MoeLoad<G>(o[c]) + sum[c]);
  }
}

template <class A, class G>
void MoeCombineForward(A* out, const A* ys, const G* weights, const int32_t* positions, const A* residual, int64_t N,
                       int k, int C) {
#pragma omp parallel for
  for (int64_t n = 0; n < N; ++n) {
    G* sum = MoeRow<G>(C);
    std::fill(sum, sum + C, G(0));
    for (int j = 0; j < k; ++j) {
      const G w = weights[n * k + j];
      const A* y = ys + int64_t(positions[n * k + j]) * C;
      for (int c = 0; c < C; ++c) sum[c] += w * MoeLoad<G>(y[c]);
    }
    if (residual) {
      for (int c = 0; c < C; ++c) sum[c] += MoeLoad<G>(residual[n * C + c]);
    }
    for (int c = 0; c < C; ++c) out[n * C + c] = A(sum[c]);
  }
}

template <class A, class G>
void MoeCombineBackward(A* dys, G* dweights, const A* dout, const A* ys, const G* weights, const int32_t* positions,
                        int64_t N, int k, int C) {
#pragma omp parallel for
  for (int64_t n = 0; n < N; ++n) {
    const A* d = dout + n * C;
    for (int j = 0; j < k; ++j) {
      const int64_t row = int64_t(positions[n * k + j]) * C;
      const G w = weights[n * k + j];
      G dot = 0;
      for (int c = 0; c < C; ++c) {
        const G g = MoeLoad<G>(d[c]);
        dot += g * MoeLoad<G>(ys[row + c]);
        dys[row + c] = A(w * g);
      }
      dweights[n * k + j] = dot;
    }
  }
}

namespace {

void MoeCheckCounts(const char* what, const int32_t* counts, int E) {
  for (int e = 0; e < E; ++e) {
    if (counts[e] < 0) {
      throw std::invalid_argument(std::string(what) + ": expert " + std::to_string(e) + " has " +
                                  std::to_string(counts[e]) + " rows");
    }
  }
}

}  // namespace

template <class A, class G>
void GroupedMatmulForward(A* out, const A* inp, const A* weight, const int32_t* counts, int E, int K, int OC) {
  MoeCheckCounts("GroupedMatmulForward", counts, E);
  int64_t row = 0;
  for (int e = 0; e < E; ++e) {
    if (counts[e] == 0) continue;
    MatmulForward<A, G>(out + row * OC, nullptr, inp + row * K, weight + int64_t(e) * OC * K, nullptr, nullptr,
                        counts[e], K, OC);
    row += counts[e];
  }
}

template <class A, class G>
void GroupedMatmulBackward(A* dinp, G* dweight, const A* dout, const A* inp, const A* weight, const int32_t* counts,
                           int E, int K, int OC) {
  MoeCheckCounts("GroupedMatmulBackward", counts, E);
  int64_t row = 0;
  for (int e = 0; e < E; ++e) {
    if (counts[e] == 0) continue;
    MatmulBackward<A, G>(dinp + row * K, dweight + int64_t(e) * OC * K, nullptr, dout + row * OC, inp + row * K,
                         weight + int64_t(e) * OC * K, nullptr, counts[e], K, OC);
    row += counts[e];
  }
}

#define MESHTRAIN_CPU_MOE_KERNELS(A, G)                                                                          \
  template void RouterTopKForward<A, G>(G*, int32_t*, G*, const A*, int64_t, int, int, bool);                   \
  template void RouterTopKBackward<A, G>(A*, const G*, const G*, const G*, const int32_t*, int64_t, int, int, bool); \
  template void MoePermute<A, G>(A*, const A*, const int32_t*, int64_t, int, int);                              \
  template void MoePermuteBackward<A, G>(A*, const A*, const int32_t*, int64_t, int, int);                      \
  template void MoeCombineForward<A, G>(A*, const A*, const G*, const int32_t*, const A*, int64_t, int, int);    \
  template void MoeCombineBackward<A, G>(A*, G*, const A*, const A*, const G*, const int32_t*, int64_t, int, int); \
  template void GroupedMatmulForward<A, G>(A*, const A*, const A*, const int32_t*, int, int, int);              \
  template void GroupedMatmulBackward<A, G>(A*, G*, const A*, const A*, const A*, const int32_t*, int, int, int);

MESHTRAIN_CPU_MOE_KERNELS(float, float)
MESHTRAIN_CPU_MOE_KERNELS(bf16, float)
MESHTRAIN_CPU_MOE_KERNELS(double, double)
#undef MESHTRAIN_CPU_MOE_KERNELS

}  // namespace meshtrain::kernels::cpu
