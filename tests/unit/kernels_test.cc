// Every CPU layer's backward against central finite differences of its forward,
// in fp64; and the fp32 kernels against the fp64 reference on random inputs.

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

std::vector<float> ToFloat(const Vec& v) { return std::vector<float>(v.begin(), v.end()); }

void ExpectClose(const std::string& what, const std::vector<float>& f, const Vec& d, double tolerance) {
  double scale = 1e-3;
  for (double x : d) scale = std::max(scale, std::abs(x));
  for (size_t i = 0; i < f.size(); ++i) ASSERT_NEAR(f[i], d[i], tolerance * scale) << what << "[" << i << "]";
}

constexpr int B = 2, Tn = 5, C = 8, NH = 2, V = 11;

TEST(KernelGradients, Encoder) {
  const std::vector<int32_t> inp = {1, 4, 4, 0, 10, 3, 1, 7, 2, 9};
  Vec wte = Random(V * C, 1), wpe = Random(Tn * C, 2), r = Random(B * Tn * C, 3);
  auto loss = [&] {
    Vec out(B * Tn * C);
    EncoderForward(out.data(), inp.data(), wte.data(), wpe.data(), B, Tn, C);
    return Dot(out, r);
  };
  Vec dwte(wte.size()), dwpe(wpe.size());
  EncoderBackward(dwte.data(), dwpe.data(), r.data(), inp.data(), B, Tn, C);
  ExpectGradient("dwte", &wte, dwte, loss, 1000);
  ExpectGradient("dwpe", &wpe, dwpe, loss, 1000);
}

TEST(KernelGradients, LayerNorm) {
  Vec inp = Random(B * Tn * C, 1), w = Random(C, 2), b = Random(C, 3), r = Random(B * Tn * C, 4);
  auto loss = [&] {
    Vec out(inp.size()), mean(B * Tn), rstd(B * Tn);
    LayerNormForward(out.data(), mean.data(), rstd.data(), inp.data(), w.data(), b.data(), B, Tn, C);
    return Dot(out, r);
  };
  Vec out(inp.size()), mean(B * Tn), rstd(B * Tn), dinp(inp.size()), dw(C), db(C);
  LayerNormForward(out.data(), mean.data(), rstd.data(), inp.data(), w.data(), b.data(), B, Tn, C);
  LayerNormBackward(dinp.data(), dw.data(), db.data(), r.data(), inp.data(), w.data(), mean.data(), rstd.data(), B, Tn, C);
  ExpectGradient("dinp", &inp, dinp, loss);
  ExpectGradient("dweight", &w, dw, loss);
  ExpectGradient("dbias", &b, db, loss);
}

TEST(KernelGradients, Matmul) {
  const int OC = 6;
  Vec inp = Random(B * Tn * C, 1), w = Random(OC * C, 2), b = Random(OC, 3), r = Random(B * Tn * OC, 4);
  auto loss = [&] {
    Vec out(B * Tn * OC);
    MatmulForward(out.data(), inp.data(), w.data(), b.data(), B, Tn, C, OC);
    return Dot(out, r);
  };
  Vec dinp(inp.size()), dw(w.size()), db(b.size());
  MatmulBackward(dinp.data(), dw.data(), db.data(), r.data(), inp.data(), w.data(), B, Tn, C, OC);
  ExpectGradient("dinp", &inp, dinp, loss);
  ExpectGradient("dweight", &w, dw, loss);
  ExpectGradient("dbias", &b, db, loss);
}

TEST(KernelGradients, CausalAttention) {
  Vec inp = Random(B * Tn * 3 * C, 1), r = Random(B * Tn * C, 2);
  const size_t att_size = size_t(B) * NH * Tn * Tn;
  auto loss = [&] {
    Vec out(B * Tn * C), preatt(att_size), att(att_size);
    AttentionForward(out.data(), preatt.data(), att.data(), inp.data(), B, Tn, C, NH);
    return Dot(out, r);
  };
  Vec out(B * Tn * C), preatt(att_size), att(att_size), dinp(inp.size()), dpreatt(att_size), datt(att_size);
  AttentionForward(out.data(), preatt.data(), att.data(), inp.data(), B, Tn, C, NH);
  // Causality: the output at t does not depend on inputs after t.
  for (int t2 = 1; t2 < Tn; ++t2) EXPECT_EQ(att[t2], 0.0);
  AttentionBackward(dinp.data(), dpreatt.data(), datt.data(), r.data(), inp.data(), att.data(), B, Tn, C, NH);
  ExpectGradient("dqkv", &inp, dinp, loss, 1000);
}

TEST(KernelGradients, GeluAndResidual) {
  Vec a = Random(40, 1, 2.0), b = Random(40, 2), r = Random(40, 3);
  auto gelu_loss = [&] {
    Vec out(a.size());
    GeluForward(out.data(), a.data(), int64_t(a.size()));
    return Dot(out, r);
  };
  Vec da(a.size());
  GeluBackward(da.data(), a.data(), r.data(), int64_t(a.size()));
  ExpectGradient("gelu", &a, da, gelu_loss);
  auto residual_loss = [&] {
    Vec out(a.size());
    ResidualForward(out.data(), a.data(), b.data(), int64_t(a.size()));
    return Dot(out, r);
  };
  Vec d1(a.size()), d2(a.size());
  ResidualBackward(d1.data(), d2.data(), r.data(), int64_t(a.size()));
  ExpectGradient("residual 1", &a, d1, residual_loss);
  ExpectGradient("residual 2", &b, d2, residual_loss);
}

TEST(KernelGradients, SoftmaxCrossEntropy) {
  Vec logits = Random(B * Tn * V, 1, 3.0);
  const std::vector<int32_t> targets = {0, 3, 10, 5, 5, 1, 2, 9, 8, 7};
  auto loss = [&] {  // the mean loss
    Vec probs(logits.size()), losses(B * Tn);
    SoftmaxCrossEntropyForward(probs.data(), losses.data(), logits.data(), targets.data(), B, Tn, V);
    double s = 0;
    for (double l : losses) s += l;
    return s / (B * Tn);
  };
  Vec probs(logits.size()), losses(B * Tn), dlogits(logits.size());
  SoftmaxCrossEntropyForward(probs.data(), losses.data(), logits.data(), targets.data(), B, Tn, V);
  for (int bt = 0; bt < B * Tn; ++bt) {
    double sum = 0;
    for (int v = 0; v < V; ++v) sum += probs[bt * V + v];
    EXPECT_NEAR(sum, 1.0, 1e-12);
    EXPECT_NEAR(losses[bt], -std::log(probs[bt * V + targets[bt]]), 1e-12);
  }
  SoftmaxCrossEntropyBackward(dlogits.data(), probs.data(), targets.data(), 1.0 / (B * Tn), B, Tn, V);
  ExpectGradient("dlogits", &logits, dlogits, loss, 1000);
}

// The vocabulary split in uneven slices (11 entries over 3 ranks: 3, 4, 4): each slice's
// statistics, gathered, give every slice its part of the whole softmax and the same loss,
// and the backward of a slice is its part of the whole backward; so does the embedding.
TEST(KernelVocabSlices, SlicesGiveTheWholeSoftmaxLossAndEmbedding) {
  const Vec logits = Random(B * Tn * V, 3, 3.0);
  const std::vector<int32_t> targets = {0, 3, 10, 5, 5, 1, 2, 9, 8, 7};
  Vec probs(logits.size()), losses(B * Tn), dlogits(logits.size());
  SoftmaxCrossEntropyForward(probs.data(), losses.data(), logits.data(), targets.data(), B, Tn, V);
  SoftmaxCrossEntropyBackward(dlogits.data(), probs.data(), targets.data(), 0.5, B, Tn, V);
  const int slices = 3, BT = B * Tn;
  auto begin_of = [&](int s) { return V * s / slices; };
  Vec all_stats(size_t(3 * BT * slices));
  std::vector<Vec> parts(slices);
  for (int s = 0; s < slices; ++s) {
    const int vb = begin_of(s), vl = begin_of(s + 1) - vb;
    parts[s].resize(size_t(BT * vl));
    for (int bt = 0; bt < BT; ++bt) {
      for (int v = 0; v < vl; ++v) parts[s][size_t(bt * vl + v)] = logits[size_t(bt * V + vb + v)];
    }
    VocabSliceStats(all_stats.data() + 3 * BT * s, parts[s].data(), targets.data(), B, Tn, vl, vb);
  }
  for (int s = 0; s < slices; ++s) {
    const int vb = begin_of(s), vl = begin_of(s + 1) - vb;
    Vec slice_probs(parts[s].size()), slice_losses(BT), slice_dlogits(parts[s].size());
    VocabSliceSoftmax(slice_probs.data(), slice_losses.data(), parts[s].data(), all_stats.data(), slices, B, Tn, vl);
    SoftmaxCrossEntropyBackward(slice_dlogits.data(), slice_probs.data(), targets.data(), 0.5, B, Tn, vl, vb);
    for (int bt = 0; bt < BT; ++bt) {
      EXPECT_NEAR(slice_losses[bt], losses[bt], 1e-12) << "slice " << s;
      for (int v = 0; v < vl; ++v) {
        EXPECT_NEAR(slice_probs[size_t(bt * vl + v)], probs[size_t(bt * V + vb + v)], 1e-14);
        EXPECT_NEAR(slice_dlogits[size_t(bt * vl + v)], dlogits[size_t(bt * V + vb + v)], 1e-14);
      }
    }
  }
  // The embedding: each slice looks up its tokens, one adds the positions; the sum is exact.
  const Vec wte = Random(V * C, 4), wpe = Random(Tn * C, 5);
  Vec whole(B * Tn * C), sum(B * Tn * C, 0.0);
  EncoderForward(whole.data(), targets.data(), wte.data(), wpe.data(), B, Tn, C);
  for (int s = 0; s < slices; ++s) {
    Vec part(whole.size());
    EncoderForward(part.data(), targets.data(), wte.data() + begin_of(s) * C, s == 0 ? wpe.data() : nullptr, B, Tn,
                   C, begin_of(s), begin_of(s + 1));
    for (size_t i = 0; i < sum.size(); ++i) sum[i] += part[i];
  }
  EXPECT_EQ(sum, whole);
}

// The fp32 instantiation against the fp64 reference, forward and backward.
TEST(KernelPrecision, FloatMatchesDoubleReference) {
  const int OC = 3 * C;
  const Vec inp = Random(B * Tn * C, 1), w = Random(OC * C, 2), b = Random(OC, 3), r = Random(B * Tn * OC, 4);
  Vec out(B * Tn * OC), dinp(inp.size()), dw(w.size()), db(b.size());
  MatmulForward(out.data(), inp.data(), w.data(), b.data(), B, Tn, C, OC);
  MatmulBackward(dinp.data(), dw.data(), db.data(), r.data(), inp.data(), w.data(), B, Tn, C, OC);
  std::vector<float> fout(out.size()), fdinp(inp.size()), fdw(w.size()), fdb(b.size());
  const auto finp = ToFloat(inp), fw = ToFloat(w), fb = ToFloat(b), fr = ToFloat(r);
  MatmulForward(fout.data(), finp.data(), fw.data(), fb.data(), B, Tn, C, OC);
  MatmulBackward(fdinp.data(), fdw.data(), fdb.data(), fr.data(), finp.data(), fw.data(), B, Tn, C, OC);
  ExpectClose("matmul out", fout, out, 1e-5);
  ExpectClose("matmul dinp", fdinp, dinp, 1e-5);
  ExpectClose("matmul dweight", fdw, dw, 1e-5);

  // Attention on the same q, k, v.
  const Vec qkv = Random(B * Tn * 3 * C, 5), ra = Random(B * Tn * C, 6);
  const size_t att_size = size_t(B) * NH * Tn * Tn;
  Vec aout(B * Tn * C), preatt(att_size), att(att_size), dqkv(qkv.size()), dpreatt(att_size), datt(att_size);
  AttentionForward(aout.data(), preatt.data(), att.data(), qkv.data(), B, Tn, C, NH);
  AttentionBackward(dqkv.data(), dpreatt.data(), datt.data(), ra.data(), qkv.data(), att.data(), B, Tn, C, NH);
  std::vector<float> faout(aout.size()), fpreatt(att_size), fatt(att_size), fdqkv(qkv.size()), fdpreatt(att_size),
      fdatt(att_size);
  const auto fqkv = ToFloat(qkv), fra = ToFloat(ra);
  AttentionForward(faout.data(), fpreatt.data(), fatt.data(), fqkv.data(), B, Tn, C, NH);
  AttentionBackward(fdqkv.data(), fdpreatt.data(), fdatt.data(), fra.data(), fqkv.data(), fatt.data(), B, Tn, C, NH);
  ExpectClose("attention out", faout, aout, 1e-5);
  ExpectClose("attention dqkv", fdqkv, dqkv, 1e-5);
}

TEST(KernelAdamW, MatchesTheFormula) {
  std::vector<float> p = {0.5f, -1.0f, 2.0f}, g = {0.1f, -0.2f, 0.0f}, m(3, 0.0f), v(3, 0.0f);
  const float lr = 0.01f, b1 = 0.9f, b2 = 0.95f, eps = 1e-8f, wd = 0.1f;
  for (int64_t t = 1; t <= 3; ++t) {
    std::vector<double> expected(3);
    for (int i = 0; i < 3; ++i) {
      const double mi = b1 * m[i] + (1 - b1) * g[i], vi = b2 * v[i] + (1 - b2) * double(g[i]) * g[i];
      const double mhat = mi / (1 - std::pow(b1, t)), vhat = vi / (1 - std::pow(b2, t));
      expected[i] = p[i] - lr * (mhat / (std::sqrt(vhat) + eps) + wd * p[i]);
    }
    AdamWUpdate(p.data(), g.data(), m.data(), v.data(), 3, lr, b1, b2, eps, wd, t);
    for (int i = 0; i < 3; ++i) EXPECT_NEAR(p[i], expected[i], 1e-6) << "step " << t << " [" << i << "]";
  }
  EXPECT_LT(p[2], 2.0f);  // zero gradient: only the decoupled decay moves it
}

}  // namespace
}  // namespace meshtrain::kernels::cpu
