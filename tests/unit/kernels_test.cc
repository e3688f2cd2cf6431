// Every CPU layer's backward against central finite differences of its forward, in fp64
// (GPT-2's and the Llama class's: RMSNorm, RoPE, SwiGLU, grouped-query attention):
// the reference the kernel tables are checked against (tests/support/ops_conformance.h)
// is itself checked here. And AdamW against its formula.

#include "worker/kernels/cpu/kernels.h"

#include <cmath>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

namespace meshtrain::kernels::cpu {
namespace {

using Vec = std::vector<double>;

Vec Random(size_t n, uint64_t seed, double scale = 1.0) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> dist(0.0, scale);
  Vec v(n);
  for (double& x : v) x = dist(rng);
  return v;
}

double Dot(const Vec& a, const Vec& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// Compares `analytic`, the gradient of loss() with respect to *x, with central
// differences, on every element (or `samples` random ones).
void ExpectGradient(const std::string& what, Vec* x, const Vec& analytic, const std::function<double()>& loss,
                    size_t samples = 64) {
  ASSERT_EQ(x->size(), analytic.size()) << what;
  std::mt19937_64 rng(99);
  const double h = 1e-5;
  for (size_t k = 0; k < std::min(samples, x->size()); ++k) {
    const size_t i = x->size() <= samples ? k : rng() % x->size();
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

constexpr int B = 2, Tn = 5, C = 8, NH = 2, V = 11;
using D = double;

TEST(KernelGradients, Encoder) {
  const std::vector<int32_t> inp = {1, 4, 4, 0, 10, 3, 1, 7, 2, 9};
  Vec wte = Random(V * C, 1), wpe = Random(Tn * C, 2), r = Random(B * Tn * C, 3);
  auto loss = [&] {
    Vec out(B * Tn * C);
    EncoderForward<D, D>(out.data(), inp.data(), wte.data(), wpe.data(), B, Tn, C, 0, V);
    return Dot(out, r);
  };
  Vec dwte(wte.size()), dwpe(wpe.size());
  EncoderBackward<D, D>(dwte.data(), dwpe.data(), r.data(), inp.data(), B, Tn, C, 0, V);
  ExpectGradient("dwte", &wte, dwte, loss, 1000);
  ExpectGradient("dwpe", &wpe, dwpe, loss, 1000);
}

TEST(KernelGradients, LayerNorm) {
  Vec inp = Random(B * Tn * C, 1), w = Random(C, 2), b = Random(C, 3), r = Random(B * Tn * C, 4);
  auto loss = [&] {
    Vec out(inp.size()), mean(B * Tn), rstd(B * Tn);
    LayerNormForward<D, D>(out.data(), mean.data(), rstd.data(), inp.data(), w.data(), b.data(), B * Tn, C);
    return Dot(out, r);
  };
  Vec out(inp.size()), mean(B * Tn), rstd(B * Tn), dinp(inp.size()), dw(C), db(C);
  LayerNormForward<D, D>(out.data(), mean.data(), rstd.data(), inp.data(), w.data(), b.data(), B * Tn, C);
  LayerNormBackward<D, D>(dinp.data(), dw.data(), db.data(), r.data(), inp.data(), w.data(), mean.data(), rstd.data(),
                          B * Tn, C);
  ExpectGradient("dinp", &inp, dinp, loss);
  ExpectGradient("dweight", &w, dw, loss);
  ExpectGradient("dbias", &b, db, loss);
}

// The residual's gradient passes through unchanged and LayerNormBackward adds the
// normalisation's to it (+=): the two together are the gradient of r1.residual + r2.ln.
TEST(KernelGradients, ResidualLayerNorm) {
  Vec a = Random(B * Tn * C, 1), b = Random(B * Tn * C, 2), w = Random(C, 3), bias = Random(C, 4);
  const Vec r1 = Random(B * Tn * C, 5), r2 = Random(B * Tn * C, 6);
  auto loss = [&] {
    Vec residual(a.size()), out(a.size()), mean(B * Tn), rstd(B * Tn);
    ResidualLayerNormForward<D, D>(residual.data(), out.data(), mean.data(), rstd.data(), a.data(), b.data(), w.data(),
                                   bias.data(), B * Tn, C);
    return Dot(residual, r1) + Dot(out, r2);
  };
  Vec residual(a.size()), out(a.size()), mean(B * Tn), rstd(B * Tn), dw(C), db(C);
  ResidualLayerNormForward<D, D>(residual.data(), out.data(), mean.data(), rstd.data(), a.data(), b.data(), w.data(),
                                 bias.data(), B * Tn, C);
  Vec dresidual = r1;
  LayerNormBackward<D, D>(dresidual.data(), dw.data(), db.data(), r2.data(), residual.data(), w.data(), mean.data(),
                          rstd.data(), B * Tn, C);
  ExpectGradient("da", &a, dresidual, loss);
  ExpectGradient("db", &b, dresidual, loss);
}

TEST(KernelGradients, Matmul) {
  const int OC = 6;
  Vec inp = Random(B * Tn * C, 1), w = Random(OC * C, 2), b = Random(OC, 3), r = Random(B * Tn * OC, 4);
  auto loss = [&] {
    Vec out(B * Tn * OC);
    MatmulForward<D, D>(out.data(), nullptr, inp.data(), w.data(), b.data(), nullptr, B * Tn, C, OC);
    return Dot(out, r);
  };
  Vec dinp(inp.size(), 123.0), dw(w.size()), db(b.size());  // dinp is written, whatever it held
  MatmulBackward<D, D>(dinp.data(), dw.data(), db.data(), r.data(), inp.data(), w.data(), nullptr, B * Tn, C, OC);
  ExpectGradient("dinp", &inp, dinp, loss);
  ExpectGradient("dweight", &w, dw, loss);
  ExpectGradient("dbias", &b, db, loss);
}

// A GELU MLP as the fused epilogues run it: h = gelu(x W1^T + b1) (forward keeps the
// pre-activation), y = h W2^T; the second product's backward gives d(pre) directly.
TEST(KernelGradients, MatmulWithGelu) {
  const int H = 12, OC = 5;
  Vec x = Random(B * Tn * C, 1), w1 = Random(H * C, 2), b1 = Random(H, 3), w2 = Random(OC * H, 4),
      r = Random(B * Tn * OC, 5);
  auto loss = [&] {
    Vec h(B * Tn * H), pre(B * Tn * H), y(B * Tn * OC);
    MatmulForward<D, D>(h.data(), pre.data(), x.data(), w1.data(), b1.data(), nullptr, B * Tn, C, H);
    MatmulForward<D, D>(y.data(), nullptr, h.data(), w2.data(), nullptr, nullptr, B * Tn, H, OC);
    return Dot(y, r);
  };
  Vec h(B * Tn * H), pre(B * Tn * H), dpre(B * Tn * H), dw2(w2.size()), dx(x.size()), dw1(w1.size()), db1(H);
  MatmulForward<D, D>(h.data(), pre.data(), x.data(), w1.data(), b1.data(), nullptr, B * Tn, C, H);
  MatmulBackward<D, D>(dpre.data(), dw2.data(), nullptr, r.data(), h.data(), w2.data(), pre.data(), B * Tn, H, OC);
  MatmulBackward<D, D>(dx.data(), dw1.data(), db1.data(), dpre.data(), x.data(), w1.data(), nullptr, B * Tn, C, H);
  ExpectGradient("dx", &x, dx, loss);
  ExpectGradient("dw1", &w1, dw1, loss);
  ExpectGradient("db1", &b1, db1, loss);
  ExpectGradient("dw2", &w2, dw2, loss);
}

TEST(KernelGradients, CausalAttention) {
  const int HS = C / NH;
  Vec inp = Random(B * Tn * 3 * C, 1), r = Random(B * Tn * C, 2);
  const size_t att_size = size_t(B) * NH * Tn * Tn;
  auto loss = [&] {
    Vec out(B * Tn * C), att(att_size);
    AttentionForward<D, D>(out.data(), att.data(), inp.data(), B, Tn, NH, NH, HS);
    return Dot(out, r);
  };
  Vec out(B * Tn * C), att(att_size), dinp(inp.size(), 123.0);
  AttentionForward<D, D>(out.data(), att.data(), inp.data(), B, Tn, NH, NH, HS);
  // Causality: the output at t does not depend on inputs after t.
  for (int t2 = 1; t2 < Tn; ++t2) EXPECT_EQ(att[t2], 0.0);
  AttentionBackward<D, D>(dinp.data(), r.data(), inp.data(), att.data(), B, Tn, NH, NH, HS);
  ExpectGradient("dqkv", &inp, dinp, loss, 1000);
}

// Four query heads over two key/value heads, and over one (multi-query): a key/value
// head's gradient sums its group's.
TEST(KernelGradients, GroupedQueryAttention) {
  const int heads = 4, HS = 4;
  for (const int kv_heads : {2, 1}) {
    const int width = (heads + 2 * kv_heads) * HS;
    Vec inp = Random(size_t(B) * Tn * width, 1), r = Random(size_t(B) * Tn * heads * HS, 2);
    const size_t att_size = size_t(B) * heads * Tn * Tn;
    auto loss = [&] {
      Vec out(r.size()), att(att_size);
      AttentionForward<D, D>(out.data(), att.data(), inp.data(), B, Tn, heads, kv_heads, HS);
      return Dot(out, r);
    };
    Vec out(r.size()), att(att_size), dinp(inp.size(), 123.0);
    AttentionForward<D, D>(out.data(), att.data(), inp.data(), B, Tn, heads, kv_heads, HS);
    AttentionBackward<D, D>(dinp.data(), r.data(), inp.data(), att.data(), B, Tn, heads, kv_heads, HS);
    ExpectGradient("dqkv with " + std::to_string(kv_heads) + " key/value heads", &inp, dinp, loss, 1000);
  }
}

// The finite differences above hold for any consistent choice of which key/value head a
// query head reads; this pins the contract's: query head h reads key/value head
// h / (NH / KVH). Grouped attention is multi-head attention on keys and values repeated
// so, and the grouped dK and dV are the repeated heads' gradients summed over each group.
TEST(KernelGradients, GroupedQueryAttentionIsMultiHeadOnRepeatedKeysAndValues) {
  const int heads = 6, kv_heads = 2, group = heads / kv_heads, HS = 4, rows = B * Tn;
  const int width = (heads + 2 * kv_heads) * HS, wide = 3 * heads * HS, Q = heads * HS;
  const Vec qkv = Random(size_t(rows) * width, 1), dout = Random(size_t(rows) * Q, 2);
  Vec repeated(size_t(rows) * wide);
  for (int r = 0; r < rows; ++r) {
    for (int h = 0; h < heads; ++h) {
      for (int i = 0; i < HS; ++i) {
        const size_t from = size_t(r) * width, to = size_t(r) * wide;
        repeated[to + h * HS + i] = qkv[from + h * HS + i];
        repeated[to + Q + h * HS + i] = qkv[from + Q + (h / group) * HS + i];
        repeated[to + 2 * Q + h * HS + i] = qkv[from + Q + (kv_heads + h / group) * HS + i];
      }
    }
  }
  Vec out(dout.size()), att(size_t(B) * heads * Tn * Tn), dqkv(qkv.size());
  Vec mha_out(dout.size()), mha_att(att.size()), mha_dqkv(repeated.size());
  AttentionForward<D, D>(out.data(), att.data(), qkv.data(), B, Tn, heads, kv_heads, HS);
  AttentionForward<D, D>(mha_out.data(), mha_att.data(), repeated.data(), B, Tn, heads, heads, HS);
  for (size_t i = 0; i < out.size(); ++i) ASSERT_NEAR(out[i], mha_out[i], 1e-12) << "out[" << i << "]";
  AttentionBackward<D, D>(dqkv.data(), dout.data(), qkv.data(), att.data(), B, Tn, heads, kv_heads, HS);
  AttentionBackward<D, D>(mha_dqkv.data(), dout.data(), repeated.data(), mha_att.data(), B, Tn, heads, heads, HS);
  for (int r = 0; r < rows; ++r) {
    const size_t from = size_t(r) * wide, to = size_t(r) * width;
    for (int h = 0; h < heads * HS; ++h) ASSERT_NEAR(dqkv[to + h], mha_dqkv[from + h], 1e-12) << "dq, row " << r;
    for (int g = 0; g < kv_heads; ++g) {
      for (int i = 0; i < HS; ++i) {
        double dk = 0, dv = 0;
        for (int h = g * group; h < (g + 1) * group; ++h) {
          dk += mha_dqkv[from + Q + h * HS + i];
          dv += mha_dqkv[from + 2 * Q + h * HS + i];
        }
        EXPECT_NEAR(dqkv[to + Q + g * HS + i], dk, 1e-12) << "dk, row " << r << ", head " << g;
        EXPECT_NEAR(dqkv[to + Q + (kv_heads + g) * HS + i], dv, 1e-12) << "dv, row " << r << ", head " << g;
      }
    }
  }
}

TEST(KernelGradients, RmsNorm) {
  const float eps = 1e-5f;
  Vec inp = Random(B * Tn * C, 1), w = Random(C, 2), r = Random(B * Tn * C, 3);
  auto loss = [&] {
    Vec out(inp.size()), rstd(B * Tn);
    RmsNormForward<D, D>(out.data(), rstd.data(), inp.data(), w.data(), B * Tn, C, eps);
    return Dot(out, r);
  };
  Vec out(inp.size()), rstd(B * Tn), dinp(inp.size()), dw(C);
  RmsNormForward<D, D>(out.data(), rstd.data(), inp.data(), w.data(), B * Tn, C, eps);
  for (int row = 0; row < B * Tn; ++row) {  // rstd is 1 / sqrt(mean(x^2) + eps)
    double squares = 0;
    for (int i = 0; i < C; ++i) squares += inp[size_t(row * C + i)] * inp[size_t(row * C + i)];
    const double s = 1 / std::sqrt(squares / C + double(eps));
    EXPECT_NEAR(rstd[size_t(row)], s, 1e-12) << "row " << row;
    for (int i = 0; i < C; ++i) {
      const size_t at = size_t(row * C + i);
      EXPECT_NEAR(out[at], inp[at] * s * w[size_t(i)], 1e-12) << "out, row " << row << ", channel " << i;
    }
  }
  RmsNormBackward<D, D>(dinp.data(), dw.data(), r.data(), inp.data(), w.data(), rstd.data(), B * Tn, C);
  ExpectGradient("dinp", &inp, dinp, loss);
  ExpectGradient("dweight", &w, dw, loss);
}

// As ResidualLayerNorm: the residual's gradient passes through, RmsNormBackward adds the
// normalisation's (+=).
TEST(KernelGradients, ResidualRmsNorm) {
  const float eps = 1e-6f;
  Vec a = Random(B * Tn * C, 1), b = Random(B * Tn * C, 2), w = Random(C, 3);
  const Vec r1 = Random(B * Tn * C, 5), r2 = Random(B * Tn * C, 6);
  auto loss = [&] {
    Vec residual(a.size()), out(a.size()), rstd(B * Tn);
    ResidualRmsNormForward<D, D>(residual.data(), out.data(), rstd.data(), a.data(), b.data(), w.data(), B * Tn, C,
                                 eps);
    return Dot(residual, r1) + Dot(out, r2);
  };
  Vec residual(a.size()), out(a.size()), rstd(B * Tn), dw(C);
  ResidualRmsNormForward<D, D>(residual.data(), out.data(), rstd.data(), a.data(), b.data(), w.data(), B * Tn, C, eps);
  Vec dresidual = r1;
  RmsNormBackward<D, D>(dresidual.data(), dw.data(), r2.data(), residual.data(), w.data(), rstd.data(), B * Tn, C);
  ExpectGradient("da", &a, dresidual, loss);
  ExpectGradient("db", &b, dresidual, loss);
  ExpectGradient("dweight", &w, dw, loss);
}

// RoPE on two query heads and one key/value head: its backward is the gradient of its
// forward (v's passes through), and the forward keeps each pair's length.
TEST(KernelGradients, Rope) {
  const int heads = 2, kv_heads = 1, HS = 8, half = HS / 2, width = (heads + 2 * kv_heads) * HS;
  Vec cos(Tn * half), sin(Tn * half);
  for (int t = 0; t < Tn; ++t) {
    for (int i = 0; i < half; ++i) {
      const double angle = t * std::pow(10000.0, -2.0 * i / HS);
      cos[size_t(t * half + i)] = std::cos(angle);
      sin[size_t(t * half + i)] = std::sin(angle);
    }
  }
  Vec qkv = Random(size_t(B) * Tn * width, 1);
  const Vec r = Random(qkv.size(), 2);
  auto loss = [&] {
    Vec x = qkv;
    Rope<D, D>(x.data(), cos.data(), sin.data(), B, Tn, heads, kv_heads, HS, /*backward=*/false);
    return Dot(x, r);
  };
  Vec rotated = qkv;
  Rope<D, D>(rotated.data(), cos.data(), sin.data(), B, Tn, heads, kv_heads, HS, /*backward=*/false);
  // The contract's rotation of (x[i], x[i + HS/2]) by angle t * frequency i, on the q and
  // k heads only.
  for (size_t row = 0; row < size_t(B) * Tn; ++row) {
    const size_t t = row % Tn;
    for (int h = 0; h < heads + kv_heads; ++h) {
      for (int i = 0; i < half; ++i) {
        const size_t at = row * width + size_t(h) * HS + i;
        const double c = cos[t * half + i], s = sin[t * half + i];
        EXPECT_NEAR(rotated[at], qkv[at] * c - qkv[at + half] * s, 1e-12) << "row " << row << ", head " << h;
        EXPECT_NEAR(rotated[at + half], qkv[at + half] * c + qkv[at] * s, 1e-12) << "row " << row << ", head " << h;
      }
    }
    for (int i = (heads + kv_heads) * HS; i < width; ++i) EXPECT_EQ(rotated[row * width + i], qkv[row * width + i]);
  }
  Vec dqkv = r;
  Rope<D, D>(dqkv.data(), cos.data(), sin.data(), B, Tn, heads, kv_heads, HS, /*backward=*/true);
  ExpectGradient("dqkv", &qkv, dqkv, loss, 1000);
}

TEST(KernelGradients, SwiGlu) {
  const int H = 6;
  Vec gate_up = Random(size_t(B) * Tn * 2 * H, 1, 2.0), r = Random(size_t(B) * Tn * H, 2);
  auto loss = [&] {
    Vec out(r.size());
    SwiGluForward<D, D>(out.data(), gate_up.data(), B * Tn, H);
    return Dot(out, r);
  };
  Vec out(r.size());
  SwiGluForward<D, D>(out.data(), gate_up.data(), B * Tn, H);
  for (int row = 0; row < B * Tn; ++row) {  // silu(gate) * up
    for (int j = 0; j < H; ++j) {
      const double g = gate_up[size_t(row * 2 * H + j)], u = gate_up[size_t(row * 2 * H + H + j)];
      EXPECT_NEAR(out[size_t(row * H + j)], g / (1 + std::exp(-g)) * u, 1e-12) << "row " << row << ", unit " << j;
    }
  }
  Vec dgate_up(gate_up.size(), 123.0);  // written, whatever it held
  SwiGluBackward<D, D>(dgate_up.data(), r.data(), gate_up.data(), B * Tn, H);
  ExpectGradient("dgate_up", &gate_up, dgate_up, loss, 1000);
}

// The loss over the real columns of a padded row: the padding neither counts nor trains.
TEST(KernelGradients, CrossEntropyOverAPaddedVocabulary) {
  const int rows = B * Tn, Vp = 16;
  Vec logits = Random(rows * Vp, 1, 3.0);
  const std::vector<int32_t> targets = {0, 3, 10, 5, 5, 1, 2, 9, 8, 7};
  auto loss = [&] {  // the mean loss
    Vec losses(rows);
    CrossEntropy<D, D>(losses.data(), nullptr, logits.data(), targets.data(), rows, V, Vp, 0.0f);
    double s = 0;
    for (double l : losses) s += l;
    return s / rows;
  };
  Vec losses(rows), dlogits(logits.size(), 123.0);
  CrossEntropy<D, D>(losses.data(), dlogits.data(), logits.data(), targets.data(), rows, V, Vp, float(1.0 / rows));
  for (int r = 0; r < rows; ++r) {
    double sum = 0;
    for (int v = 0; v < V; ++v) sum += std::exp(logits[size_t(r * Vp + v)]);
    EXPECT_NEAR(losses[size_t(r)], std::log(sum) - logits[size_t(r * Vp + targets[size_t(r)])], 1e-12);
    for (int v = V; v < Vp; ++v) EXPECT_EQ(dlogits[size_t(r * Vp + v)], 0.0) << "padding column " << v;
  }
  // dloss went through a float: compare with the loss's own scale.
  Vec scaled = dlogits;
  for (double& d : scaled) d *= 1.0 / double(float(1.0 / rows)) / rows;
  ExpectGradient("dlogits", &logits, scaled, loss, 1000);
}

TEST(KernelAdamW, MatchesTheFormula) {
  std::vector<float> p = {0.5f, -1.0f, 2.0f, 7.0f}, g = {0.1f, -0.2f, 0.0f, 1.0f}, m(4, 0.0f), v(4, 0.0f);
  const std::vector<float> untouched = p;
  const float lr = 0.01f, b1 = 0.9f, b2 = 0.95f, eps = 1e-8f, wd = 0.1f, clip = 0.5f;
  const ShardSegment segments[2] = {{0, 2, 1, 1}, {2, 1, 0, 1}};  // element 3 is in none
  for (int64_t t = 1; t <= 3; ++t) {
    std::vector<double> expected(3);
    for (int i = 0; i < 3; ++i) {
      const double gi = double(g[i]) * clip, decay = i < 2 ? wd : 0.0;
      const double mi = b1 * m[i] + (1 - b1) * gi, vi = b2 * v[i] + (1 - b2) * gi * gi;
      const double mhat = mi / (1 - std::pow(b1, t)), vhat = vi / (1 - std::pow(b2, t));
      expected[i] = p[i] - lr * (mhat / (std::sqrt(vhat) + eps) + decay * p[i]);
    }
    AdamWStep step{lr, b1, b2, eps, wd, t};
    AdamW<float, float>(p.data(), nullptr, g.data(), m.data(), v.data(), segments, 2, step, &clip);
    for (int i = 0; i < 3; ++i) EXPECT_NEAR(p[i], expected[i], 1e-6) << "step " << t << " [" << i << "]";
  }
  EXPECT_EQ(p[2], untouched[2]) << "a zero gradient without decay moves nothing";
  EXPECT_EQ(p[3], untouched[3]) << "an element outside every segment never trains";
}

}  // namespace
}  // namespace meshtrain::kernels::cpu
