#include "worker/kernels/cpu/kernels.h"

#include <cblas.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "worker/kernels/cpu/float8_matmul.h"
#include "worker/kernels/dropout.h"
#include "worker/runtime/bf16.h"

namespace meshtrain::kernels::cpu {
namespace {

using runtime::bf16;

template <class G, class A>
G Load(A x) {
  return static_cast<G>(x);
}

// Row-major C (M,N) = alpha * op(A) @ op(B) + beta * C.
void Gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
          const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans, int(M), int(N),
              int(K), alpha, A, int(lda), B, int(ldb), beta, C, int(ldc));
}
void Gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, double alpha, const double* A, int64_t lda,
          const double* B, int64_t ldb, double beta, double* C, int64_t ldc) {
  cblas_dgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans, int(M), int(N),
              int(K), alpha, A, int(lda), B, int(ldb), beta, C, int(ldc));
}

// Per-thread scratch in the compute type, reused from call to call (the emulation's
// products run on widened copies of their bf16 operands).
template <class G>
G* Scratch(int slot, int64_t n) {
  thread_local std::vector<G> slots[4];
  std::vector<G>& s = slots[slot];
  if (int64_t(s.size()) < n) s.resize(size_t(n));
  return s.data();
}

// x as an array of G: itself when A is G, else a widened copy in scratch `slot`.
template <class G, class A>
const G* Widen(const A* x, int64_t n, int slot) {
  if constexpr (std::is_same_v<A, G>) {
    return x;
  } else {
    G* wide = Scratch<G>(slot, n);
#pragma omp parallel for
    for (int64_t i = 0; i < n; ++i) wide[i] = Load<G>(x[i]);
    return wide;
  }
}

template <class G>
constexpr G kGeluScale = G(0.7978845608028654);  // sqrt(2/pi)

// exp(x) for x <= 0 in float, without a library call, so that loops over it vectorize:
// x = n ln2 + r with |r| <= ln2/2 (Cody-Waite), exp(r) by Cephes expf's polynomial, 2^n
// from the exponent bits. Within 1 ulp of exp (0.98 ulp measured over [-90, 0]); 0 below
// -87.3, where expf turns subnormal.
[[gnu::always_inline]] inline float ExpNonPositive(float x) {
  const bool underflows = x < -87.3f;
  x = underflows ? -87.3f : x;
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  // n is an integer in [-126, 0]; a NaN x takes n = 0 and stays NaN through r.
  const float rounded = (x * 1.44269504088896341f + kRound) - kRound;
  const float n = x == x ? rounded : 0.0f;
  const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float e = (p * (r * r) + r) + 1.0f;
  const float scale = std::bit_cast<float>(uint32_t(int32_t(n) + 127) << 23);
  return underflows ? 0.0f : e * scale;
}

// tanh for GELU. In float, (1 - e^-2|z|) / (1 + e^-2|z|) with the sign of z, e from
// ExpNonPositive: GELU adds it to 1 or subtracts its square from 1, so its absolute error
// is what counts, and that stays under 1e-7 (9e-8 measured) as with tanhf, a library call the
// GELU loops could not vectorize. In double (the reference) it is std::tanh.
template <class G>
[[gnu::always_inline]] inline G GeluTanh(G z) {
  if constexpr (std::is_same_v<G, float>) {
    const float e = ExpNonPositive(-2.0f * std::fabs(z));
    return std::copysign((1.0f - e) / (1.0f + e), z);
  } else {
    return std::tanh(z);
  }
}

template <class G>
[[gnu::always_inline]] inline G Gelu(G x) {
  return G(0.5) * x * (G(1) + GeluTanh(kGeluScale<G> * (x + G(0.044715) * x * x * x)));
}

template <class G>
[[gnu::always_inline]] inline G GeluDerivative(G x) {
  const G tanh_out = GeluTanh(kGeluScale<G> * (x + G(0.044715) * x * x * x));
  const G sech2 = G(1) - tanh_out * tanh_out;
  return G(0.5) * (G(1) + tanh_out) + x * G(0.5) * sech2 * kGeluScale<G> * (G(1) + G(3) * G(0.044715) * x * x);
}

// MatmulForward's epilogue over one fp32 row stored as computed, where the product's sum
// is already in gelu_pre (with GELU) or in out: the bias, then the residual or GELU, in
// the order of the general loop, as loops the compiler vectorizes (out is not gelu_pre,
// and a residual never comes with GELU: kernels/ops.h).
#if defined(__x86_64__) && defined(__GNUC__)
[[gnu::target_clones("avx512f", "avx2", "default")]]
#endif
void EpilogueRowFp32(float* out, float* gelu_pre, const float* bias, const float* residual, int OC) {
  if (gelu_pre != nullptr) {
#pragma GCC ivdep
    for (int j = 0; j < OC; ++j) {
      const float s = gelu_pre[j] + (bias ? bias[j] : 0.0f);
      gelu_pre[j] = s;
      out[j] = Gelu(s);
    }
  } else {
#pragma GCC ivdep
    for (int j = 0; j < OC; ++j) {
      float s = out[j] + (bias ? bias[j] : 0.0f);
      if (residual) s += residual[j];
      out[j] = s;
    }
  }
}

// d[i] *= GELU'(pre[i]) over n fp32 elements: MatmulBackward's GELU, vectorized.
#if defined(__x86_64__) && defined(__GNUC__)
[[gnu::target_clones("avx512f", "avx2", "default")]]
#endif
void GeluBackwardFp32(float* d, const float* pre, int64_t n) {
#pragma GCC ivdep
  for (int64_t i = 0; i < n; ++i) d[i] = d[i] * GeluDerivative(pre[i]);
}

bool InSlice(int32_t token, int64_t v_begin, int64_t v_rows) { return token >= v_begin && token < v_begin + v_rows; }

// x . y over n elements in G: element i added into lane i % 8, the lanes then added in
// order. Eight chains instead of one dependent chain, in a fixed order any vector width
// computes alike.
template <class G, class A>
G Dot(const A* x, const A* y, int n) {
  constexpr int kLanes = 8;
  G lanes[kLanes] = {};
  int i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) lanes[l] += Load<G>(x[i + l]) * Load<G>(y[i + l]);
  }
  for (int l = 0; i < n; ++i, ++l) lanes[l] += Load<G>(x[i]) * Load<G>(y[i]);
  G sum = 0;
  for (G lane : lanes) sum += lane;
  return sum;
}

}  // namespace

template <class A, class G>
void EncoderForward(A* out, const int32_t* tokens, const A* wte, const A* wpe, int B, int T, int C, int64_t v_begin,
                    int64_t v_rows) {
#pragma omp parallel for
  for (int64_t row = 0; row < int64_t(B) * T; ++row) {
    A* o = out + row * C;
    const int32_t token = tokens[row];
    const A* e = InSlice(token, v_begin, v_rows) ? wte + (token - v_begin) * C : nullptr;
    const A* p = wpe ? wpe + (row % T) * C : nullptr;
    for (int i = 0; i < C; ++i) o[i] = A((e ? Load<G>(e[i]) : G(0)) + (p ? Load<G>(p[i]) : G(0)));
  }
}

template <class A, class G>
void EncoderBackward(G* dwte, G* dwpe, const A* dout, const int32_t* tokens, int B, int T, int C, int64_t v_begin,
                     int64_t v_rows) {
  // Serial: positions share token rows and position rows, and the order is fixed.
  for (int64_t row = 0; row < int64_t(B) * T; ++row) {
    const A* d = dout + row * C;
    const int32_t token = tokens[row];
    if (InSlice(token, v_begin, v_rows)) {
      G* e = dwte + (token - v_begin) * C;
      for (int i = 0; i < C; ++i) e[i] += Load<G>(d[i]);
    }
    if (dwpe) {
      G* p = dwpe + (row % T) * C;
      for (int i = 0; i < C; ++i) p[i] += Load<G>(d[i]);
    }
  }
}

namespace {

// One row's LayerNorm over x as stored.
template <class A, class G>
void NormalizeRow(A* out, G* mean, G* rstd, const A* x, const A* weight, const A* bias, int C) {
  G m = 0;
  for (int i = 0; i < C; ++i) m += Load<G>(x[i]);
  m /= C;
  G var = 0;
  for (int i = 0; i < C; ++i) var += (Load<G>(x[i]) - m) * (Load<G>(x[i]) - m);
  var /= C;
  const G s = G(1) / std::sqrt(var + G(1e-5));
  for (int i = 0; i < C; ++i) out[i] = A((s * (Load<G>(x[i]) - m)) * Load<G>(weight[i]) + Load<G>(bias[i]));
  *mean = m;
  *rstd = s;
}

}  // namespace

template <class A, class G>
void LayerNormForward(A* out, G* mean, G* rstd, const A* inp, const A* weight, const A* bias, int64_t N, int C) {
#pragma omp parallel for
  for (int64_t r = 0; r < N; ++r) NormalizeRow(out + r * C, mean + r, rstd + r, inp + r * C, weight, bias, C);
}

template <class A, class G>
void ResidualLayerNormForward(A* residual, A* out, G* mean, G* rstd, const A* a, const A* b, const A* weight,
                              const A* bias, int64_t N, int C) {
#pragma omp parallel for
  for (int64_t r = 0; r < N; ++r) {
    A* res = residual + r * C;
    for (int i = 0; i < C; ++i) res[i] = A(Load<G>(a[r * C + i]) + Load<G>(b[r * C + i]));
    NormalizeRow(out + r * C, mean + r, rstd + r, static_cast<const A*>(res), weight, bias, C);
  }
}

template <class A, class G>
void LayerNormBackward(A* dinp, G* dweight, G* dbias, const A* dout, const A* inp, const A* weight, const G* mean,
                       const G* rstd, int64_t N, int C) {
  // Serial over rows: every row adds into dweight and dbias, in a fixed order.
  for (int64_t r = 0; r < N; ++r) {
    const A* d = dout + r * C;
    const A* x = inp + r * C;
    A* dx = dinp + r * C;
    const G m = mean[r], s = rstd[r];
    G dnorm_mean = 0, dnorm_norm_mean = 0;
    for (int i = 0; i < C; ++i) {
      const G norm = (Load<G>(x[i]) - m) * s;
      const G dnorm = Load<G>(weight[i]) * Load<G>(d[i]);
      dnorm_mean += dnorm;
      dnorm_norm_mean += dnorm * norm;
    }
    dnorm_mean /= C;
    dnorm_norm_mean /= C;
    for (int i = 0; i < C; ++i) {
      const G norm = (Load<G>(x[i]) - m) * s;
      const G dnorm = Load<G>(weight[i]) * Load<G>(d[i]);
      dbias[i] += Load<G>(d[i]);
      dweight[i] += norm * Load<G>(d[i]);
      dx[i] = A(Load<G>(dx[i]) + (dnorm - dnorm_mean - norm * dnorm_norm_mean) * s);
    }
  }
}

// MatmulForward's epilogue over the product's sum (N,OC): the bias, then the residual or
// GELU. In fp32 the sum lies in place (in gelu_pre with GELU, else in out); otherwise it
// is sum, in G.
template <class A, class G>
void MatmulEpilogue(A* out, A* gelu_pre, const G* sum, const A* bias, const A* residual, int64_t N, int OC) {
  constexpr bool kStoredAsComputed = std::is_same_v<A, G>;
#pragma omp parallel for
  for (int64_t r = 0; r < N; ++r) {
    if constexpr (kStoredAsComputed && std::is_same_v<G, float>) {
      EpilogueRowFp32(out + r * OC, gelu_pre ? gelu_pre + r * OC : nullptr, bias, residual ? residual + r * OC : nullptr,
                      OC);
      continue;
    }
    for (int j = 0; j < OC; ++j) {
      G s = sum[r * OC + j] + (bias ? Load<G>(bias[j]) : G(0));
      // Last: in fp32 and fp64 bit for bit an Add of the stored sum; the bf16 emulation
      // rounds once, as the GPU's epilogue does.
      if (residual) s += Load<G>(residual[r * OC + j]);
      if (gelu_pre) {
        gelu_pre[r * OC + j] = A(s);
        out[r * OC + j] = A(Gelu(s));
      } else {
        out[r * OC + j] = A(s);
      }
    }
  }
}

// Where a product of (N,OC) lands before MatmulEpilogue: in place in fp32, else scratch 2.
template <class A, class G>
G* SumOf(A* out, A* gelu_pre, int64_t N, int OC) {
  if constexpr (std::is_same_v<A, G>) {
    return gelu_pre ? gelu_pre : out;
  } else {
    return Scratch<G>(2, N * OC);
  }
}

// dinp (n) = dx times GELU'(gelu_pre) (nullable), as stored; dx is dinp itself in fp32.
template <class A, class G>
void GradInputEpilogue(A* dinp, const G* dx, const A* gelu_pre, int64_t n) {
  constexpr bool kStoredAsComputed = std::is_same_v<A, G>;
  if constexpr (kStoredAsComputed && std::is_same_v<G, float>) {
    if (gelu_pre) {  // in place: dx is dinp
      constexpr int64_t kChunk = 1 << 14;
#pragma omp parallel for
      for (int64_t i = 0; i < n; i += kChunk) GeluBackwardFp32(dinp + i, gelu_pre + i, std::min(kChunk, n - i));
    }
  } else if (gelu_pre || !kStoredAsComputed) {
#pragma omp parallel for
    for (int64_t i = 0; i < n; ++i) dinp[i] = A(gelu_pre ? dx[i] * GeluDerivative(Load<G>(gelu_pre[i])) : dx[i]);
  }
}

// dbias (OC) += the column sums of d (N,OC): rows in order for every column (as a loop
// over the column would add them), a block of columns a thread, rows outermost so that
// the reads are contiguous.
template <class G>
void AddColumnSums(G* dbias, const G* d, int64_t N, int OC) {
  constexpr int kColumns = 256;
#pragma omp parallel for
  for (int j0 = 0; j0 < OC; j0 += kColumns) {
    const int width = std::min(kColumns, OC - j0);
    G sums[kColumns] = {};
    for (int64_t r = 0; r < N; ++r) {
      const G* row = d + r * OC + j0;
      for (int j = 0; j < width; ++j) sums[j] += row[j];
    }
    for (int j = 0; j < width; ++j) dbias[j0 + j] += sums[j];
  }
}

template <class A, class G>
void MatmulForward(A* out, A* gelu_pre, const A* inp, const A* weight, const A* bias, const A* residual, int64_t N,
                   int K, int OC) {
  const G* x = Widen<G>(inp, N * K, 0);
  const G* w = Widen<G>(weight, int64_t(OC) * K, 1);
  G* sum = SumOf<A, G>(out, gelu_pre, N, OC);
  Gemm(false, true, N, OC, K, G(1), x, K, w, K, G(0), sum, OC);
  MatmulEpilogue<A, G>(out, gelu_pre, sum, bias, residual, N, OC);
}

template <class A, class G>
void MatmulBackward(A* dinp, G* dweight, G* dbias, const A* dout, const A* inp, const A* weight, const A* gelu_pre,
                    int64_t N, int K, int OC) {
  const G* d = Widen<G>(dout, N * OC, 0);
  const G* x = Widen<G>(inp, N * K, 1);
  const G* w = Widen<G>(weight, int64_t(OC) * K, 2);
  G* dx;
  if constexpr (std::is_same_v<A, G>) {
    dx = dinp;
  } else {
    dx = Scratch<G>(3, N * K);
  }
  Gemm(false, false, N, K, OC, G(1), d, OC, w, K, G(0), dx, K);  // dinp = dout @ weight
  GradInputEpilogue<A, G>(dinp, dx, gelu_pre, N * K);
  Gemm(true, false, OC, K, N, G(1), d, OC, x, K, G(1), dweight, K);  // dweight += dout^T @ inp
  if (dbias != nullptr) AddColumnSums(dbias, d, N, OC);
}

// The float8 products (ops.h): the operands as fp32 (cpu/float8_matmul.h casts from fp32),
// the product in fp32, then MatmulForward's and MatmulBackward's epilogues.
template <class A, class G>
void Float8MatmulForward(A* out, A* gelu_pre, const A* inp, const float* inp_scale, const A* weight,
                         const float* weight_scale, const A* bias, const A* residual, int64_t N, int K, int OC,
                         Float8Recipe recipe) {
  const float* x = Widen<float>(inp, N * K, 0);
  const float* w = Widen<float>(weight, int64_t(OC) * K, 1);
  G* sum = SumOf<A, G>(out, gelu_pre, N, OC);
  if constexpr (std::is_same_v<G, float>) {
    Float8MatmulForward(sum, x, inp_scale, w, weight_scale, N, K, OC, recipe);
  } else {
    float* product = Scratch<float>(3, N * OC);
    Float8MatmulForward(product, x, inp_scale, w, weight_scale, N, K, OC, recipe);
    for (int64_t i = 0; i < N * OC; ++i) sum[i] = G(product[i]);
  }
  MatmulEpilogue<A, G>(out, gelu_pre, sum, bias, residual, N, OC);
}

template <class A, class G>
void Float8MatmulGradInput(A* dinp, const A* dout, const float* dout_scale, const A* weight, const float* weight_scale,
                           const A* gelu_pre, int64_t N, int K, int OC, Float8Recipe recipe) {
  const float* d = Widen<float>(dout, N * OC, 0);
  const float* w = Widen<float>(weight, int64_t(OC) * K, 1);
  if constexpr (std::is_same_v<A, float> && std::is_same_v<G, float>) {
    Float8MatmulGradInput(dinp, d, dout_scale, w, weight_scale, N, K, OC, recipe);
    GradInputEpilogue<A, G>(dinp, dinp, gelu_pre, N * K);
  } else {
    float* product = Scratch<float>(3, N * K);
    Float8MatmulGradInput(product, d, dout_scale, w, weight_scale, N, K, OC, recipe);
    G* dx = Scratch<G>(2, N * K);
    for (int64_t i = 0; i < N * K; ++i) dx[i] = G(product[i]);
    GradInputEpilogue<A, G>(dinp, dx, gelu_pre, N * K);
  }
}

template <class A, class G>
void Float8MatmulGradWeight(G* dweight, G* dbias, const A* dout, const float* dout_scale, const A* inp,
                            const float* inp_scale, int64_t N, int K, int OC, Float8Recipe recipe) {
  const float* d = Widen<float>(dout, N * OC, 0);
  const float* x = Widen<float>(inp, N * K, 1);
  if constexpr (std::is_same_v<G, float>) {
    Float8MatmulGradWeight(dweight, d, dout_scale, x, inp_scale, N, K, OC, recipe);
  } else {
    float* product = Scratch<float>(3, int64_t(OC) * K);
    std::fill(product, product + int64_t(OC) * K, 0.0f);
    Float8MatmulGradWeight(product, d, dout_scale, x, inp_scale, N, K, OC, recipe);
    for (int64_t i = 0; i < int64_t(OC) * K; ++i) dweight[i] += G(product[i]);
  }
  if (dbias == nullptr) return;
  if constexpr (std::is_same_v<G, float>) {
    AddColumnSums(dbias, d, N, OC);
  } else {
    AddColumnSums(dbias, Widen<G>(dout, N * OC, 2), N, OC);
  }
}

template <class A>
void Float8AmaxOf(float* amax, const A* x, int64_t rows, int64_t cols, Float8Scaling scaling) {
  Float8Amax(amax, Widen<float>(x, rows * cols, 0), rows, cols, scaling);
}

template <class A, class G>
void AttentionForward(A* out, G* state, const A* qkv, int B, int T, int NH, int KVH, int HS) {
  const int64_t row = int64_t(NH + 2 * KVH) * HS, Q = int64_t(NH) * HS, group = NH / KVH;
  const G scale = G(1) / std::sqrt(G(HS));
#pragma omp parallel for collapse(3)
  for (int b = 0; b < B; ++b) {
    for (int t = 0; t < T; ++t) {
      for (int h = 0; h < NH; ++h) {
        const int64_t kv = Q + int64_t(h / group) * HS;  // this head's key, at kv; its value at kv + KVH*HS
        const A* query = qkv + (int64_t(b) * T + t) * row + int64_t(h) * HS;
        G* att = state + ((int64_t(b) * NH + h) * T + t) * T;
        G maxval = std::numeric_limits<G>::lowest();
        for (int t2 = 0; t2 <= t; ++t2) {
          const A* key = qkv + (int64_t(b) * T + t2) * row + kv;
          att[t2] = Dot<G>(query, key, HS) * scale;
          maxval = std::max(maxval, att[t2]);
        }
        G expsum = 0;
        for (int t2 = 0; t2 <= t; ++t2) {
          att[t2] = std::exp(att[t2] - maxval);
          expsum += att[t2];
        }
        for (int t2 = 0; t2 < T; ++t2) att[t2] = t2 <= t ? att[t2] / expsum : G(0);
        // out = att @ value, value rows in order (contiguous reads), summed in G.
        thread_local std::vector<G> sum;
        sum.assign(size_t(HS), G(0));
        for (int t2 = 0; t2 <= t; ++t2) {
          const A* value = qkv + (int64_t(b) * T + t2) * row + kv + int64_t(KVH) * HS;
          for (int i = 0; i < HS; ++i) sum[size_t(i)] += att[t2] * Load<G>(value[i]);
        }
        A* o = out + (int64_t(b) * T + t) * Q + int64_t(h) * HS;
        for (int i = 0; i < HS; ++i) o[i] = A(sum[size_t(i)]);
      }
    }
  }
}

template <class A, class G>
void AttentionBackward(A* dqkv, const A* dout, const A* qkv, const G* state, int B, int T, int NH, int KVH, int HS) {
  const int64_t row = int64_t(NH + 2 * KVH) * HS, Q = int64_t(NH) * HS, group = NH / KVH;
  const G scale = G(1) / std::sqrt(G(HS));
  // Parallel over (batch, key/value head): each accumulates the dq of its query heads and
  // its own dk and dv in G, the query heads in order, then stores.
#pragma omp parallel for collapse(2)
  for (int b = 0; b < B; ++b) {
    for (int g = 0; g < KVH; ++g) {
      thread_local std::vector<G> dq, dk, dv, datt;
      dk.assign(size_t(T) * HS, G(0));
      dv.assign(size_t(T) * HS, G(0));
      datt.assign(size_t(T), G(0));
      const int64_t kv = Q + int64_t(g) * HS;
      auto at = [&](int t, int64_t channel) { return qkv + (int64_t(b) * T + t) * row + channel; };
      for (int h = int(g * group); h < int((g + 1) * group); ++h) {
        dq.assign(size_t(T) * HS, G(0));
        for (int t = 0; t < T; ++t) {
          const G* att = state + ((int64_t(b) * NH + h) * T + t) * T;
          const A* d = dout + (int64_t(b) * T + t) * Q + int64_t(h) * HS;
          for (int t2 = 0; t2 <= t; ++t2) {  // out = att @ value
            const A* value = at(t2, kv + int64_t(KVH) * HS);
            for (int i = 0; i < HS; ++i) dv[size_t(t2) * HS + i] += att[t2] * Load<G>(d[i]);
            datt[size_t(t2)] = Dot<G>(value, d, HS);
          }
          G dot = 0;  // softmax: dpreatt = att * (datt - sum(att * datt))
          for (int t2 = 0; t2 <= t; ++t2) dot += att[t2] * datt[size_t(t2)];
          const A* query = at(t, int64_t(h) * HS);
          for (int t2 = 0; t2 <= t; ++t2) {  // preatt = scale * query . key
            const G grad = att[t2] * (datt[size_t(t2)] - dot) * scale;
            const A* key = at(t2, kv);
            for (int i = 0; i < HS; ++i) {
              dq[size_t(t) * HS + i] += Load<G>(key[i]) * grad;
              dk[size_t(t2) * HS + i] += Load<G>(query[i]) * grad;
            }
          }
        }
        for (int t = 0; t < T; ++t) {
          A* r = dqkv + (int64_t(b) * T + t) * row + int64_t(h) * HS;
          for (int i = 0; i < HS; ++i) r[i] = A(dq[size_t(t) * HS + i]);
        }
      }
      for (int t = 0; t < T; ++t) {
        A* r = dqkv + (int64_t(b) * T + t) * row + kv;
        for (int i = 0; i < HS; ++i) {
          r[i] = A(dk[size_t(t) * HS + i]);
          r[int64_t(KVH) * HS + i] = A(dv[size_t(t) * HS + i]);
        }
      }
    }
  }
}

namespace {

// One row's RMSNorm over x as stored.
template <class A, class G>
void RmsRow(A* out, G* rstd, const A* x, const A* weight, int C, float eps) {
  G squares = 0;
  for (int i = 0; i < C; ++i) squares += Load<G>(x[i]) * Load<G>(x[i]);
  const G s = G(1) / std::sqrt(squares / G(C) + G(eps));
  for (int i = 0; i < C; ++i) out[i] = A((Load<G>(x[i]) * s) * Load<G>(weight[i]));
  *rstd = s;
}

}  // namespace

template <class A, class G>
void RmsNormForward(A* out, G* rstd, const A* inp, const A* weight, int64_t N, int C, float eps) {
#pragma omp parallel for
  for (int64_t r = 0; r < N; ++r) RmsRow(out + r * C, rstd + r, inp + r * C, weight, C, eps);
}

template <class A, class G>
void ResidualRmsNormForward(A* residual, A* out, G* rstd, const A* a, const A* b, const A* weight, int64_t N, int C,
                            float eps) {
#pragma omp parallel for
  for (int64_t r = 0; r < N; ++r) {
    A* res = residual + r * C;
    for (int i = 0; i < C; ++i) res[i] = A(Load<G>(a[r * C + i]) + Load<G>(b[r * C + i]));
    RmsRow(out + r * C, rstd + r, static_cast<const A*>(res), weight, C, eps);
  }
}

template <class A, class G>
void RmsNormBackward(A* dinp, G* dweight, const A* dout, const A* inp, const A* weight, const G* rstd, int64_t N,
                     int C) {
  // Serial over rows: every row adds into dweight, in a fixed order.
  for (int64_t r = 0; r < N; ++r) {
    const A* d = dout + r * C;
    const A* x = inp + r * C;
    A* dx = dinp + r * C;
    const G s = rstd[r];
    G dot = 0;  // sum of dnorm * norm, over the row
    for (int i = 0; i < C; ++i) dot += Load<G>(weight[i]) * Load<G>(d[i]) * (Load<G>(x[i]) * s);
    dot /= G(C);
    for (int i = 0; i < C; ++i) {
      const G norm = Load<G>(x[i]) * s;
      dweight[i] += norm * Load<G>(d[i]);
      dx[i] = A(Load<G>(dx[i]) + (Load<G>(weight[i]) * Load<G>(d[i]) - norm * dot) * s);
    }
  }
}

template <class A, class G>
void HeadRmsNormForward(A* x, A* saved, G* rstd, const A* weight, int64_t N, int heads, int HS, int64_t stride,
                        float eps) {
#pragma omp parallel for
  for (int64_t r = 0; r < N; ++r) {
    for (int h = 0; h < heads; ++h) {
      const int64_t head = r * heads + h;
      A* in_place = x + r * stride + int64_t(h) * HS;
      A* kept = saved + head * HS;
      std::copy(in_place, in_place + HS, kept);
      RmsRow(in_place, rstd + head, static_cast<const A*>(kept), weight, HS, eps);
    }
  }
}

template <class A, class G>
void HeadRmsNormBackward(A* dx, G* dweight, const A* saved, const A* weight, const G* rstd, int64_t N, int heads,
                         int HS, int64_t stride) {
  // Serial over heads: every head adds into dweight, in a fixed order.
  std::fill(dweight, dweight + HS, G(0));
  for (int64_t head = 0; head < N * heads; ++head) {
    A* d = dx + (head / heads) * stride + (head % heads) * HS;  // in, then out
    const A* x = saved + head * HS;
    const G s = rstd[head];
    G dot = 0;  // sum of dnorm * norm, over the head
    for (int i = 0; i < HS; ++i) dot += Load<G>(weight[i]) * Load<G>(d[i]) * (Load<G>(x[i]) * s);
    dot /= G(HS);
    for (int i = 0; i < HS; ++i) {
      const G norm = Load<G>(x[i]) * s, dy = Load<G>(d[i]);
      dweight[i] += norm * dy;
      d[i] = A((Load<G>(weight[i]) * dy - norm * dot) * s);
    }
  }
}

template <class A, class G>
void Rope(A* qkv, const G* cos, const G* sin, int B, int T, int NH, int KVH, int HS, bool backward) {
  const int64_t row = int64_t(NH + 2 * KVH) * HS;
  const int half = HS / 2, heads = NH + KVH;  // q's heads, then k's
  const G direction = backward ? G(-1) : G(1);
#pragma omp parallel for
  for (int64_t r = 0; r < int64_t(B) * T; ++r) {
    const int64_t t = r % T;
    for (int h = 0; h < heads; ++h) {
      A* x = qkv + r * row + int64_t(h) * HS;
      for (int i = 0; i < half; ++i) {
        const G c = cos[t * half + i], s = direction * sin[t * half + i];
        const G x1 = Load<G>(x[i]), x2 = Load<G>(x[i + half]);
        x[i] = A(x1 * c - x2 * s);
        x[i + half] = A(x2 * c + x1 * s);
      }
    }
  }
}

template <class A, class G>
void SwiGluForward(A* out, const A* gate_up, int64_t N, int H) {
#pragma omp parallel for
  for (int64_t r = 0; r < N; ++r) {
    const A* g = gate_up + r * 2 * H;
    const A* u = g + H;
    for (int j = 0; j < H; ++j) {
      const G x = Load<G>(g[j]);
      out[r * H + j] = A(x / (G(1) + std::exp(-x)) * Load<G>(u[j]));
    }
  }
}

template <class A, class G>
void SwiGluBackward(A* dgate_up, const A* dout, const A* gate_up, int64_t N, int H) {
#pragma omp parallel for
  for (int64_t r = 0; r < N; ++r) {
    const A* g = gate_up + r * 2 * H;
    const A* u = g + H;
    A* dg = dgate_up + r * 2 * H;
    A* du = dg + H;
    for (int j = 0; j < H; ++j) {
      const G x = Load<G>(g[j]), d = Load<G>(dout[r * H + j]);
      const G sigmoid = G(1) / (G(1) + std::exp(-x));
      dg[j] = A(d * Load<G>(u[j]) * sigmoid * (G(1) + x * (G(1) - sigmoid)));
      du[j] = A(d * x * sigmoid);
    }
  }
}

template <class A, class G>
void Add(A* out, const A* a, const A* b, int64_t n) {
#pragma omp parallel for
  for (int64_t i = 0; i < n; ++i) out[i] = A(Load<G>(a[i]) + Load<G>(b[i]));
}

template <class A, class G>
void Dropout(A* out, const A* in, int64_t rows, int width, float p, uint64_t key, int64_t first_row,
             int64_t row_stride, int64_t first_column) {
  const G scale = G(1) / (G(1) - G(p));
#pragma omp parallel for
  for (int64_t i = 0; i < rows; ++i) {
    const A* x = in + i * width;
    A* y = out + i * width;
    const uint64_t base = uint64_t((first_row + i) * row_stride + first_column);
    for (int j = 0; j < width; ++j) y[j] = DropoutKeeps(key, base + uint64_t(j), p) ? A(Load<G>(x[j]) * scale) : A(G(0));
  }
}

namespace {

// The max of a row's real logits and the sum of exp(logit - max).
template <class A, class G>
void RowStats(const A* l, int64_t v_rows, G* maxval, G* sum) {
  G m = std::numeric_limits<G>::lowest();
  for (int64_t c = 0; c < v_rows; ++c) m = std::max(m, Load<G>(l[c]));
  G s = 0;
  for (int64_t c = 0; c < v_rows; ++c) s += std::exp(Load<G>(l[c]) - m);
  *maxval = m;
  *sum = s;
}

// RowStats, with exp(l[c] - max) kept in e[c] (e may be l): the same values, computed once.
template <class G>
void RowStatsKeepingExps(G* e, const G* l, int64_t v_rows, G* maxval, G* sum) {
  G m = std::numeric_limits<G>::lowest();
  for (int64_t c = 0; c < v_rows; ++c) m = std::max(m, l[c]);
  G s = 0;
  for (int64_t c = 0; c < v_rows; ++c) {
    e[c] = std::exp(l[c] - m);
    s += e[c];
  }
  *maxval = m;
  *sum = s;
}

// RowGradient from the exponentials RowStatsKeepingExps kept in d: the same bits.
template <class G>
void GradientFromExps(G* d, G sum, int64_t target, int64_t v_rows, int64_t Vp, G dloss) {
  for (int64_t c = 0; c < v_rows; ++c) d[c] = (d[c] / sum - (c == target ? G(1) : G(0))) * dloss;
  for (int64_t c = v_rows; c < Vp; ++c) d[c] = G(0);
}

// dlogits of one row: (softmax - onehot(target)) * dloss on the real columns, 0 on padding.
// Reads each logit before writing its gradient, so dlogits may alias the logits.
template <class A, class G>
void RowGradient(A* d, const A* l, G maxval, G sum, int64_t target, int64_t v_rows, int64_t Vp, G dloss) {
  for (int64_t c = 0; c < v_rows; ++c) {
    const G p = std::exp(Load<G>(l[c]) - maxval) / sum;
    d[c] = A((p - (c == target ? G(1) : G(0))) * dloss);
  }
  for (int64_t c = v_rows; c < Vp; ++c) d[c] = A(G(0));
}

}  // namespace

template <class A, class G>
void CrossEntropy(G* losses, A* dlogits, const A* logits, const int32_t* targets, int64_t R, int64_t v_rows,
                  int64_t Vp, float dloss) {
#pragma omp parallel for
  for (int64_t r = 0; r < R; ++r) {
    const A* l = logits + r * Vp;
    if (targets[r] < 0) {  // masked: no loss, no gradient
      losses[r] = G(0);
      if (dlogits) std::fill(dlogits + r * Vp, dlogits + (r + 1) * Vp, A(G(0)));
      continue;
    }
    G maxval, sum;
    if constexpr (std::is_same_v<A, G>) {
      if (dlogits) {  // the exponentials once, kept in dlogits (which may be the logits)
        const G target_logit = l[targets[r]];
        G* d = dlogits + r * Vp;
        RowStatsKeepingExps(d, l, v_rows, &maxval, &sum);
        losses[r] = std::log(sum) - (target_logit - maxval);
        GradientFromExps(d, sum, targets[r], v_rows, Vp, G(dloss));
        continue;
      }
    }
    RowStats(l, v_rows, &maxval, &sum);
    // -log p[target], from the logit, so that tiny probabilities keep their precision
    losses[r] = std::log(sum) - (Load<G>(l[targets[r]]) - maxval);
    if (dlogits) RowGradient(dlogits + r * Vp, l, maxval, sum, targets[r], v_rows, Vp, G(dloss));
  }
}

template <class A, class G>
void VocabSliceStats(G* stats, const A* logits, const int32_t* targets, int64_t R, int64_t v_rows, int64_t Vp,
                     int64_t v_begin) {
#pragma omp parallel for
  for (int64_t r = 0; r < R; ++r) {
    const A* l = logits + r * Vp;
    RowStats(l, v_rows, &stats[3 * r], &stats[3 * r + 1]);
    stats[3 * r + 2] = InSlice(targets[r], v_begin, v_rows) ? Load<G>(l[targets[r] - v_begin]) : G(0);
  }
}

template <class A, class G>
void VocabSliceCrossEntropy(G* losses, A* dlogits, const A* logits, const G* all_stats, int slices,
                            const int32_t* targets, int64_t R, int64_t v_rows, int64_t Vp, int64_t v_begin,
                            float dloss) {
#pragma omp parallel for
  for (int64_t r = 0; r < R; ++r) {
    if (targets[r] < 0) {  // masked: no loss, no gradient
      losses[r] = G(0);
      if (dlogits) std::fill(dlogits + r * Vp, dlogits + (r + 1) * Vp, A(G(0)));
      continue;
    }
    G maxval = all_stats[3 * r];
    for (int s = 1; s < slices; ++s) maxval = std::max(maxval, all_stats[3 * (s * R + r)]);
    G sum = 0, target_logit = 0;
    for (int s = 0; s < slices; ++s) {
      const G* st = all_stats + 3 * (s * R + r);
      sum += st[1] * std::exp(st[0] - maxval);
      target_logit += st[2];
    }
    losses[r] = std::log(sum) - (target_logit - maxval);
    if (dlogits) {
      RowGradient(dlogits + r * Vp, logits + r * Vp, maxval, sum, int64_t(targets[r]) - v_begin, v_rows, Vp, G(dloss));
    }
  }
}

template <class G>
void AddLoss(double* sum, const G* losses, int64_t R, double scale) {
  double s = 0;
  for (int64_t r = 0; r < R; ++r) s += double(losses[r]);
  *sum += scale * s;
}

// The shard operations run on the comm stream's thread beside the compute stream's OpenMP
// team: below this size a second team costs more in contention than it saves.
constexpr int64_t kParallelFrom = int64_t(1) << 20;

template <class G>
void Accumulate(G* into, const G* from, int64_t n, float scale) {
  if (scale == 1.0f) {
#pragma omp parallel for if (n >= kParallelFrom)
    for (int64_t i = 0; i < n; ++i) into[i] += from[i];
    return;
  }
  const G s = G(scale);
#pragma omp parallel for if (n >= kParallelFrom)
  for (int64_t i = 0; i < n; ++i) into[i] += s * from[i];
}

template <class A, class G>
void Cast(A* to, const G* from, int64_t n) {
  if constexpr (std::is_same_v<A, G>) {
    // A copy, by memcpy (streaming stores for large blocks) on this thread alone: it runs on
    // the comm stream beside the compute stream's OpenMP team (a unit's gather), and a
    // second team there descheduled the compute's sgemm threads, which wait on each other
    // (gpt2-124m's step: 1,340 ms against 1,460 with two threads copying).
    constexpr int64_t kBlock = int64_t(1) << 20;
    const int64_t blocks = (n + kBlock - 1) / kBlock;
    for (int64_t b = 0; b < blocks; ++b) {
      std::memcpy(to + b * kBlock, from + b * kBlock, size_t(std::min(kBlock, n - b * kBlock)) * sizeof(G));
    }
  } else {
#pragma omp parallel for if (n >= kParallelFrom)
    for (int64_t i = 0; i < n; ++i) to[i] = A(from[i]);
  }
}

namespace {

// The sum of squares of x[0, n) in double over 16 lanes (element i in lane i % 16), the
// lanes then added in order: a fixed order that any vector width computes alike.
template <class G>
[[gnu::always_inline]] inline double LaneSquares(const G* __restrict x, int64_t n) {
  constexpr int kLanes = 16;
  double lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) lanes[l] += double(x[i + l]) * double(x[i + l]);
  }
  for (int l = 0; i < n; ++i, ++l) lanes[l] += double(x[i]) * double(x[i]);
  double sum = 0;
  for (double lane : lanes) sum += lane;
  return sum;
}

#if defined(__x86_64__) && defined(__GNUC__)
[[gnu::target_clones("avx512f", "avx2", "default")]]
#endif
double LaneSquaresFp32(const float* x, int64_t n) {
  return LaneSquares(x, n);
}

}  // namespace

template <class G>
void SumSquares(double* sum, const G* grads, const ShardSegment* segments, int count) {
  // Fixed chunks, each summed in fixed lanes, the chunks added in order: the same bits
  // whatever the number of threads or the vector width.
  constexpr int64_t kChunk = 65536;
  double total = 0;
  for (int s = 0; s < count; ++s) {
    if (!segments[s].in_norm) continue;
    const G* g = grads + segments[s].offset;
    const int64_t n = segments[s].size, chunks = (n + kChunk - 1) / kChunk;
    std::vector<double> partial(size_t(chunks), 0.0);
#pragma omp parallel for if (chunks > 1)
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t begin = c * kChunk, size = std::min(n, begin + kChunk) - begin;
      if constexpr (std::is_same_v<G, float>) {
        partial[size_t(c)] = LaneSquaresFp32(g + begin, size);
      } else {
        partial[size_t(c)] = LaneSquares(g + begin, size);
      }
    }
    for (double p : partial) total += p;
  }
  *sum += total;
}

void ClipScale(float* scale, const double* sum_of_squares, float max_norm) {
  const double norm = std::sqrt(*sum_of_squares);
  *scale = max_norm > 0 && norm > max_norm ? float(max_norm / norm) : 1.0f;
}

namespace {

// AdamW's per-step constants in the compute type.
template <class G>
struct AdamWScalars {
  G clip, beta1, beta2, lr, eps, decay, correction1, correction2;
};

// AdamW over elements [0, n) of one segment, one IEEE operation at a time in a fixed order
// (the kernels compile with -ffp-contract=off), so that any vector width gives the same
// bits. Inlined into each instruction-set clone below.
template <class A, class G>
[[gnu::always_inline]] inline void AdamWElements(G* __restrict master, A* __restrict params, const G* __restrict grads,
                                                 G* __restrict m, G* __restrict v, int64_t n, const AdamWScalars<G>& k) {
  // Locals, not loads through `k`, which the stores below might alias.
  const G clip = k.clip, beta1 = k.beta1, beta2 = k.beta2, lr = k.lr, eps = k.eps, decay = k.decay;
  const G correction1 = k.correction1, correction2 = k.correction2;
  const G one_minus_beta1 = G(1) - beta1, one_minus_beta2 = G(1) - beta2;
  auto update = [&](int64_t i) {
    const G g = grads[i] * clip;
    const G mi = beta1 * m[i] + one_minus_beta1 * g;
    const G vi = beta2 * v[i] + one_minus_beta2 * g * g;
    m[i] = mi;
    v[i] = vi;
    const G m_hat = mi / correction1;
    const G v_hat = vi / correction2;
    const G w = master[i];
    const G updated = w - lr * (m_hat / (std::sqrt(v_hat) + eps) + decay * w);
    master[i] = updated;
    return updated;
  };
  if (params != nullptr) {
    for (int64_t i = 0; i < n; ++i) params[i] = A(update(i));
  } else {
    for (int64_t i = 0; i < n; ++i) update(i);
  }
}

// The fp32 table's AdamW, memory-bound only once it is vectorized: compiled for AVX-512,
// AVX2 and the baseline, the best the CPU runs chosen at load time.
#if defined(__x86_64__) && defined(__GNUC__)
[[gnu::target_clones("avx512f", "avx2", "default")]]
#endif
void AdamWElementsFp32(float* master, float* params, const float* grads, float* m, float* v, int64_t n,
                       const AdamWScalars<float>& k) {
  AdamWElements<float, float>(master, params, grads, m, v, n, k);
}

}  // namespace

template <class A, class G>
void AdamW(G* master, A* params, const G* grads, G* m, G* v, const ShardSegment* segments, int count,
           const AdamWStep& step, const float* clip_scale) {
  AdamWScalars<G> k;
  k.clip = clip_scale ? G(*clip_scale) : G(1);
  k.beta1 = step.beta1;
  k.beta2 = step.beta2;
  k.lr = step.learning_rate;
  k.eps = step.epsilon;
  k.correction1 = G(1) - std::pow(k.beta1, G(step.t));
  k.correction2 = G(1) - std::pow(k.beta2, G(step.t));
  // Chunks of a segment in parallel, each a plain loop the compiler vectorizes.
  constexpr int64_t kChunk = 1 << 14;
  for (int s = 0; s < count; ++s) {
    const int64_t begin = segments[s].offset, size = segments[s].size, chunks = (size + kChunk - 1) / kChunk;
    AdamWScalars<G> ks = k;
    ks.decay = segments[s].decay ? G(step.weight_decay) : G(0);
#pragma omp parallel for if (chunks > 1)
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t i = begin + c * kChunk, n = std::min(kChunk, size - c * kChunk);
      A* const out = params ? params + i : nullptr;
      if constexpr (std::is_same_v<A, float> && std::is_same_v<G, float>) {
        AdamWElementsFp32(master + i, out, grads + i, m + i, v + i, n, ks);
      } else {
        AdamWElements<A, G>(master + i, out, grads + i, m + i, v + i, n, ks);
      }
    }
  }
}

#define MESHTRAIN_CPU_KERNELS(A, G)                                                                                  \
  template void EncoderForward<A, G>(A*, const int32_t*, const A*, const A*, int, int, int, int64_t, int64_t);      \
  template void EncoderBackward<A, G>(G*, G*, const A*, const int32_t*, int, int, int, int64_t, int64_t);           \
  template void LayerNormForward<A, G>(A*, G*, G*, const A*, const A*, const A*, int64_t, int);                     \
  template void ResidualLayerNormForward<A, G>(A*, A*, G*, G*, const A*, const A*, const A*, const A*, int64_t, int); \
  template void LayerNormBackward<A, G>(A*, G*, G*, const A*, const A*, const A*, const G*, const G*, int64_t, int); \
  template void MatmulForward<A, G>(A*, A*, const A*, const A*, const A*, const A*, int64_t, int, int);                       \
  template void MatmulBackward<A, G>(A*, G*, G*, const A*, const A*, const A*, const A*, int64_t, int, int);         \
  template void Float8MatmulForward<A, G>(A*, A*, const A*, const float*, const A*, const float*, const A*, const A*, \
                                          int64_t, int, int, Float8Recipe);                                          \
  template void Float8MatmulGradInput<A, G>(A*, const A*, const float*, const A*, const float*, const A*, int64_t,  \
                                            int, int, Float8Recipe);                                                 \
  template void Float8MatmulGradWeight<A, G>(G*, G*, const A*, const float*, const A*, const float*, int64_t, int,  \
                                             int, Float8Recipe);                                                     \
  template void Float8AmaxOf<A>(float*, const A*, int64_t, int64_t, Float8Scaling);                                \
  template void AttentionForward<A, G>(A*, G*, const A*, int, int, int, int, int);                                  \
  template void AttentionBackward<A, G>(A*, const A*, const A*, const G*, int, int, int, int, int);                 \
  template void HeadRmsNormForward<A, G>(A*, A*, G*, const A*, int64_t, int, int, int64_t, float);                 \
  template void HeadRmsNormBackward<A, G>(A*, G*, const A*, const A*, const G*, int64_t, int, int, int64_t);         \
  template void RmsNormForward<A, G>(A*, G*, const A*, const A*, int64_t, int, float);                              \
  template void ResidualRmsNormForward<A, G>(A*, A*, G*, const A*, const A*, const A*, int64_t, int, float);        \
  template void RmsNormBackward<A, G>(A*, G*, const A*, const A*, const A*, const G*, int64_t, int);                \
  template void Rope<A, G>(A*, const G*, const G*, int, int, int, int, int, bool);                                  \
  template void SwiGluForward<A, G>(A*, const A*, int64_t, int);                                                    \
  template void SwiGluBackward<A, G>(A*, const A*, const A*, int64_t, int);                                         \
  template void Add<A, G>(A*, const A*, const A*, int64_t);                                                        \
  template void Dropout<A, G>(A*, const A*, int64_t, int, float, uint64_t, int64_t, int64_t, int64_t);                       \
  template void CrossEntropy<A, G>(G*, A*, const A*, const int32_t*, int64_t, int64_t, int64_t, float);             \
  template void VocabSliceStats<A, G>(G*, const A*, const int32_t*, int64_t, int64_t, int64_t, int64_t);            \
  template void VocabSliceCrossEntropy<A, G>(G*, A*, const A*, const G*, int, const int32_t*, int64_t, int64_t,     \
                                             int64_t, int64_t, float);                                              \
  template void Cast<A, G>(A*, const G*, int64_t);                                                                  \
  template void AdamW<A, G>(G*, A*, const G*, G*, G*, const ShardSegment*, int, const AdamWStep&, const float*);

MESHTRAIN_CPU_KERNELS(float, float)
MESHTRAIN_CPU_KERNELS(bf16, float)
MESHTRAIN_CPU_KERNELS(double, double)
#undef MESHTRAIN_CPU_KERNELS

template void AddLoss<float>(double*, const float*, int64_t, double);
template void AddLoss<double>(double*, const double*, int64_t, double);
template void Accumulate<float>(float*, const float*, int64_t, float);
template void Accumulate<double>(double*, const double*, int64_t, float);
template void SumSquares<float>(double*, const float*, const ShardSegment*, int);
template void SumSquares<double>(double*, const double*, const ShardSegment*, int);

}  // namespace meshtrain::kernels::cpu
