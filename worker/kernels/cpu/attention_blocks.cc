#include "worker/kernels/cpu/attention_blocks.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "worker/runtime/bf16.h"

namespace meshtrain::kernels::cpu {
namespace {

template <class G, class A>
G BlockLoad(A x) {
  return static_cast<G>(x);
}

// x . y over n channels, in G, in order.
template <class G, class A>
G BlockDot(const A* x, const A* y, int n) {
  G sum = 0;
  for (int i = 0; i < n; ++i) sum += BlockLoad<G>(x[i]) * BlockLoad<G>(y[i]);
  return sum;
}

// The keys query row i of a block sees: [0, Visible).
int BlockVisible(const AttentionBlock& s, int i) { return s.mask == AttentionMask::kCausal ? i + 1 : s.Tk; }

// Row t of sequence b of an operand, head `head`'s channels.
template <class T>
T* BlockRow(T* base, const AttentionRows& rows, int b, int t, int head, int HS) {
  return base + int64_t(b) * rows.batch + int64_t(t) * rows.row + int64_t(head) * HS;
}

int64_t BlockStat(const AttentionStats& stats, int b, int h, int t) {
  return int64_t(b) * stats.batch + int64_t(h) * stats.head + t;
}

}  // namespace

template <class A, class G>
void AttentionBlockForward(G* out, G* lse, const A* q, const A* k, const A* v, const AttentionBlock& s) {
  const int group = s.NH / s.KVH, HS = s.HS;
  const G scale = G(1) / std::sqrt(G(HS));
#pragma omp parallel for collapse(3)
  for (int b = 0; b < s.B; ++b) {
    for (int h = 0; h < s.NH; ++h) {
      for (int i = 0; i < s.Tq; ++i) {
        const int g = h / group, n = BlockVisible(s, i);
        const A* query = BlockRow(q, s.q, b, i, h, HS);
        G* o = BlockRow(out, s.out, b, i, h, HS);
        thread_local std::vector<G> scores, sum;
        scores.resize(size_t(std::max(n, 1)));
        sum.assign(size_t(HS), G(0));
        G largest = -std::numeric_limits<G>::infinity();
        for (int j = 0; j < n; ++j) {
          scores[size_t(j)] = BlockDot<G>(query, BlockRow(k, s.k, b, j, g, HS), HS) * scale;
          largest = std::max(largest, scores[size_t(j)]);
        }
        G denominator = 0;
        for (int j = 0; j < n; ++j) {
          const G p = std::exp(scores[size_t(j)] - largest);
          denominator += p;
          const A* value = BlockRow(v, s.v, b, j, g, HS);
          for (int c = 0; c < HS; ++c) sum[size_t(c)] += p * BlockLoad<G>(value[c]);
        }
        if (n == 0) {  // no key: an empty result
          for (int c = 0; c < HS; ++c) o[c] = G(0);
          lse[BlockStat(s.stats, b, h, i)] = -std::numeric_limits<G>::infinity();
          continue;
        }
        for (int c = 0; c < HS; ++c) o[c] = sum[size_t(c)] / denominator;
        lse[BlockStat(s.stats, b, h, i)] = largest + std::log(denominator);
      }
    }
  }
}

template <class G>
void AttentionMerge(G* out, G* lse, const G* block_out, const G* block_lse, const AttentionBlock& s) {
  const int HS = s.HS;
  constexpr G kEmpty = -std::numeric_limits<G>::infinity();
#pragma omp parallel for collapse(3)
  for (int b = 0; b < s.B; ++b) {
    for (int h = 0; h < s.NH; ++h) {
      for (int t = 0; t < s.Tq; ++t) {
        const int64_t at = BlockStat(s.stats, b, h, t);
        const G mine = lse[at], theirs = block_lse[at];
        G* o = BlockRow(out, s.out, b, t, h, HS);
        const G* bo = BlockRow(block_out, s.out, b, t, h, HS);
        if (theirs == kEmpty) continue;
        if (mine == kEmpty) {
          for (int c = 0; c < HS; ++c) o[c] = bo[c];
          lse[at] = theirs;
          continue;
        }
        const G m = std::max(mine, theirs);
        const G a = std::exp(mine - m), w = std::exp(theirs - m), total = a + w;
        for (int c = 0; c < HS; ++c) o[c] = (a * o[c] + w * bo[c]) / total;
        lse[at] = m + std::log(total);
      }
    }
  }
}

template <class A, class G>
void AttentionRowDot(G* D, const A* dout, const A* out, const AttentionBlock& s) {
#pragma omp parallel for collapse(3)
  for (int b = 0; b < s.B; ++b) {
    for (int h = 0; h < s.NH; ++h) {
      for (int t = 0; t < s.Tq; ++t) {
        D[BlockStat(s.stats, b, h, t)] =
            BlockDot<G>(BlockRow(dout, s.dout, b, t, h, s.HS), BlockRow(out, s.dout, b, t, h, s.HS), s.HS);
      }
    }
  }
}

template <class A, class G>
void AttentionBlockBackward(G* dq, G* dk, G* dv, const A* dout, const A* q, const A* k, const A* v, const G* lse,
                            const G* D, const AttentionBlock& s) {
  const int group = s.NH / s.KVH, HS = s.HS;
  const G scale = G(1) / std::sqrt(G(HS));
  // Parallel over (sequence, key/value head): each sums its keys' dk and dv over its
  // query heads in order, and each query row's dq over the keys, in G, then adds them.
#pragma omp parallel for collapse(2)
  for (int b = 0; b < s.B; ++b) {
    for (int g = 0; g < s.KVH; ++g) {
      thread_local std::vector<G> key_sum, value_sum, query_sum;
      key_sum.assign(size_t(s.Tk) * HS, G(0));
      value_sum.assign(size_t(s.Tk) * HS, G(0));
      query_sum.resize(size_t(HS));
      for (int h = g * group; h < (g + 1) * group; ++h) {
        for (int i = 0; i < s.Tq; ++i) {
          const int n = BlockVisible(s, i);
          const A* query = BlockRow(q, s.q, b, i, h, HS);
          const A* d = BlockRow(dout, s.dout, b, i, h, HS);
          const G row_lse = lse[BlockStat(s.stats, b, h, i)], row_d = D[BlockStat(s.stats, b, h, i)];
          std::fill(query_sum.begin(), query_sum.end(), G(0));
          for (int j = 0; j < n; ++j) {
            const A* key = BlockRow(k, s.k, b, j, g, HS);
            const A* value = BlockRow(v, s.v, b, j, g, HS);
            const G p = std::exp(BlockDot<G>(query, key, HS) * scale - row_lse);
            const G ds = p * (BlockDot<G>(d, value, HS) - row_d);
            G* key_row = key_sum.data() + size_t(j) * HS;
            G* value_row = value_sum.data() + size_t(j) * HS;
            for (int c = 0; c < HS; ++c) {
              query_sum[size_t(c)] += ds * BlockLoad<G>(key[c]);
              key_row[c] += ds * BlockLoad<G>(query[c]);
              value_row[c] += p * BlockLoad<G>(d[c]);
            }
          }
          G* r = BlockRow(dq, s.dq, b, i, h, HS);
          for (int c = 0; c < HS; ++c) r[c] += scale * query_sum[size_t(c)];
        }
      }
      for (int j = 0; j < s.Tk; ++j) {
        G* key_row = BlockRow(dk, s.dk, b, j, g, HS);
        G* value_row = BlockRow(dv, s.dv, b, j, g, HS);
        for (int c = 0; c < HS; ++c) {
          key_row[c] += scale * key_sum[size_t(j) * HS + c];
          value_row[c] += value_sum[size_t(j) * HS + c];
        }
      }
    }
  }
}

#define MESHTRAIN_ATTENTION_BLOCKS(A, G)                                                                           \
  template void AttentionBlockForward<A, G>(G*, G*, const A*, const A*, const A*, const AttentionBlock&);         \
  template void AttentionRowDot<A, G>(G*, const A*, const A*, const AttentionBlock&);                             \
  template void AttentionBlockBackward<A, G>(G*, G*, G*, const A*, const A*, const A*, const A*, const G*,        \
                                             const G*, const AttentionBlock&);

MESHTRAIN_ATTENTION_BLOCKS(float, float)
MESHTRAIN_ATTENTION_BLOCKS(runtime::bf16, float)
MESHTRAIN_ATTENTION_BLOCKS(double, double)
#undef MESHTRAIN_ATTENTION_BLOCKS

template void AttentionMerge<float>(float*, float*, const float*, const float*, const AttentionBlock&);
template void AttentionMerge<double>(double*, double*, const double*, const double*, const AttentionBlock&);

}  // namespace meshtrain::kernels::cpu
