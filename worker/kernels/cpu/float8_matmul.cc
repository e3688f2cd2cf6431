#include "worker/kernels/cpu/float8_matmul.h"

#include <cblas.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <limits>
#include <vector>

namespace meshtrain::kernels::cpu {
namespace {
// A namespace of its own: this file shares unity units with kernels.cc's helpers.
namespace float8_matmul {

// Every code's value in one format, built once.
const float* DecodeTable(Float8 format) {
  static const auto tables = [] {
    std::array<std::array<float, 256>, 2> t{};
    for (int bits = 0; bits < 256; ++bits) {
      t[0][size_t(bits)] = DecodeFloat8(uint8_t(bits), Float8::kE4M3);
      t[1][size_t(bits)] = DecodeFloat8(uint8_t(bits), Float8::kE5M2);
    }
    return t;
  }();
  return tables[format == Float8::kE4M3 ? 0 : 1].data();
}

// The scale of element (i, j) of a (rows,cols) tensor.
inline float ScaleAt(const float* scale, Float8Scaling scaling, int64_t i, int64_t j) {
  return scaling == Float8Scaling::kTensor ? scale[0] : scaling == Float8Scaling::kRow ? scale[i] : scale[j];
}

// Per-thread scratch for the dequantised operands, reused from call to call.
float* OperandScratch(int slot, int64_t n) {
  thread_local std::vector<float> slots[2];
  std::vector<float>& s = slots[slot];
  if (int64_t(s.size()) < n) s.resize(size_t(n));
  return s.data();
}

// out (n) = RoundToFloat8(x * s) / s of x (n), scale s of its own for each element (a row
// of column scales) or one for all (`scales` null): vectorized.
#if defined(__x86_64__) && defined(__GNUC__)
[[gnu::target_clones("avx512f", "avx2", "default")]]
#endif
void RoundRow(float* out, const float* x, const float* scales, float s, int64_t n, Float8 format) {
  if (scales == nullptr) {
#pragma GCC ivdep
    for (int64_t j = 0; j < n; ++j) out[j] = RoundToFloat8(x[j] * s, format) / s;
  } else {
#pragma GCC ivdep
    for (int64_t j = 0; j < n; ++j) out[j] = RoundToFloat8(x[j] * scales[j], format) / scales[j];
  }
}

// out (rows,cols) = DequantizeFloat8(QuantizeFloat8(x)), without storing the codes.
void QuantizeDequantize(float* out, const float* x, const float* scale, int64_t rows, int64_t cols, Float8 format,
                        Float8Scaling scaling) {
#pragma omp parallel for
  for (int64_t i = 0; i < rows; ++i) {
    const float s = scaling == Float8Scaling::kTensor ? scale[0] : scaling == Float8Scaling::kRow ? scale[i] : 0.0f;
    RoundRow(out + i * cols, x + i * cols, scaling == Float8Scaling::kColumn ? scale : nullptr, s, cols, format);
  }
}

// An operand of `recipe`'s product, dequantised into scratch `slot`.
const float* Operand(int slot, const float* x, const float* scale, int64_t rows, int64_t cols, Float8Recipe recipe,
                     Float8Operand operand) {
  const Float8Cast cast = Float8CastOf(recipe, operand);
  float* out = OperandScratch(slot, rows * cols);
  QuantizeDequantize(out, x, scale, rows, cols, cast.format, cast.scaling);
  return out;
}

// Row-major C (M,N) = op(A) @ op(B) + beta * C, with a product over K = 0 adding nothing.
void Sgemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
           int64_t ldb, float beta, float* C, int64_t ldc) {
  if (M == 0 || N == 0) return;
  if (K == 0) {
    if (beta == 0) std::fill(C, C + M * N, 0.0f);
    return;
  }
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans, int(M), int(N),
              int(K), 1.0f, A, int(lda), B, int(ldb), beta, C, int(ldc));
}

// The amax as the bits of |v|: for floats that are not NaN, |a| < |b| exactly where
// (bits(a) & 0x7FFFFFFF) < (bits(b) & 0x7FFFFFFF), and every NaN's magnitude bits exceed
// infinity's (0x7F800000). So an unsigned max over the magnitude bits is the amax, and
// NaN where a NaN is among the values, in a loop that vectorizes.
#if defined(__x86_64__) && defined(__GNUC__)
[[gnu::target_clones("avx512f", "avx2", "default")]]
#endif
uint32_t AmaxBits(const float* x, int64_t n) {
  uint32_t m = 0;
  for (int64_t j = 0; j < n; ++j) m = std::max(m, std::bit_cast<uint32_t>(x[j]) & 0x7FFFFFFFu);
  return m;
}

// m (n) = max(m, magnitude bits) over each column of the (rows, n) block of x with row stride `stride`.
#if defined(__x86_64__) && defined(__GNUC__)
[[gnu::target_clones("avx512f", "avx2", "default")]]
#endif
void ColumnAmaxBits(uint32_t* m, const float* x, int64_t rows, int64_t stride, int64_t n) {
  for (int64_t i = 0; i < rows; ++i) {
    const float* row = x + i * stride;
#pragma GCC ivdep
    for (int64_t j = 0; j < n; ++j) m[j] = std::max(m[j], std::bit_cast<uint32_t>(row[j]) & 0x7FFFFFFFu);
  }
}

// The amax of AmaxBits' bits: NaN for a NaN's.
inline float AmaxOfBits(uint32_t bits) {
  return bits > 0x7F800000u ? std::numeric_limits<float>::quiet_NaN() : std::bit_cast<float>(bits);
}

}  // namespace float8_matmul
}  // namespace

void Float8Amax(float* amax, const float* x, int64_t rows, int64_t cols, Float8Scaling scaling) {
  using float8_matmul::AmaxBits;
  using float8_matmul::AmaxOfBits;
  switch (scaling) {
    case Float8Scaling::kRow: {
#pragma omp parallel for
      for (int64_t i = 0; i < rows; ++i) amax[i] = AmaxOfBits(AmaxBits(x + i * cols, cols));
      return;
    }
    case Float8Scaling::kTensor: {
      std::vector<uint32_t> per_row(size_t(std::max<int64_t>(rows, 0)));
#pragma omp parallel for
      for (int64_t i = 0; i < rows; ++i) per_row[size_t(i)] = AmaxBits(x + i * cols, cols);
      uint32_t m = 0;
      for (uint32_t a : per_row) m = std::max(m, a);
      amax[0] = AmaxOfBits(m);
      return;
    }
    case Float8Scaling::kColumn: {
      // Blocks of columns, each swept row by row (contiguous reads).
      constexpr int64_t kBlock = 256;
      const int64_t blocks = (cols + kBlock - 1) / kBlock;
#pragma omp parallel for
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t j0 = b * kBlock, j1 = std::min(cols, j0 + kBlock);
        uint32_t m[kBlock] = {};
        float8_matmul::ColumnAmaxBits(m, x + j0, rows, cols, j1 - j0);
        for (int64_t j = j0; j < j1; ++j) amax[j] = AmaxOfBits(m[j - j0]);
      }
      return;
    }
  }
}

void Float8Scales(float* scale, const float* amax, int64_t n, Float8 format, bool power_of_2) {
  for (int64_t i = 0; i < n; ++i) scale[i] = Float8Scale(amax[i], format, power_of_2);
}

void QuantizeFloat8(uint8_t* q, const float* x, const float* scale, int64_t rows, int64_t cols, Float8 format,
                    Float8Scaling scaling) {
#pragma omp parallel for
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) {
      q[i * cols + j] = EncodeFloat8(x[i * cols + j] * float8_matmul::ScaleAt(scale, scaling, i, j), format);
    }
  }
}

void DequantizeFloat8(float* x, const uint8_t* q, const float* scale, int64_t rows, int64_t cols, Float8 format,
                      Float8Scaling scaling) {
  const float* decode = float8_matmul::DecodeTable(format);
#pragma omp parallel for
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) {
      x[i * cols + j] = decode[q[i * cols + j]] / float8_matmul::ScaleAt(scale, scaling, i, j);
    }
  }
}

void Float8MatmulForward(float* out, const float* inp, const float* inp_scale, const float* weight,
                         const float* weight_scale, int64_t N, int K, int OC, Float8Recipe recipe) {
  using float8_matmul::Operand;
  const float* a = Operand(0, inp, inp_scale, N, K, recipe, Float8Operand::kInpForward);           // (N,K)
  const float* b = Operand(1, weight, weight_scale, OC, K, recipe, Float8Operand::kWeightForward);  // (OC,K)
  float8_matmul::Sgemm(false, true, N, OC, K, a, K, b, K, 0.0f, out, OC);
}

void Float8MatmulGradInput(float* dinp, const float* dout, const float* dout_scale, const float* weight,
                           const float* weight_scale, int64_t N, int K, int OC, Float8Recipe recipe) {
  using float8_matmul::Operand;
  const float* a = Operand(0, dout, dout_scale, N, OC, recipe, Float8Operand::kDoutForGradInput);       // (N,OC)
  const float* b = Operand(1, weight, weight_scale, OC, K, recipe, Float8Operand::kWeightForGradInput);  // (OC,K)
  float8_matmul::Sgemm(false, false, N, K, OC, a, OC, b, K, 0.0f, dinp, K);
}

void Float8MatmulGradWeight(float* dweight, const float* dout, const float* dout_scale, const float* inp,
                            const float* inp_scale, int64_t N, int K, int OC, Float8Recipe recipe) {
  using float8_matmul::Operand;
  const float* a = Operand(0, dout, dout_scale, N, OC, recipe, Float8Operand::kDoutForGradWeight);  // (N,OC)
  const float* b = Operand(1, inp, inp_scale, N, K, recipe, Float8Operand::kInpForGradWeight);      // (N,K)
  float8_matmul::Sgemm(true, false, OC, K, N, a, OC, b, K, 1.0f, dweight, K);
}

}  // namespace meshtrain::kernels::cpu
