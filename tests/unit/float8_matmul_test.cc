// The float8 matmul emulation (worker/kernels/cpu/float8_matmul.h) against an fp64
// reference written here from torchao's recipes: which format and which scale axis each
// operand of the linear layer's three products takes, amax and scale as torchao's
// tensor_to_amax and amax_to_scale compute them, quantisation as x * scale in fp32 then a
// saturating round to nearest even, found here by searching the format's values. The
// quantised codes must agree bit for bit; the products within fp32's rounding of the same
// dequantised values; and the products' error against the unquantised fp32 products must
// be what the recipe's formats give, neither more nor less.

#include "worker/kernels/cpu/float8_matmul.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <iostream>
#include <limits>
#include <random>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "worker/kernels/float8.h"

namespace meshtrain::kernels::cpu::float8_matmul_test {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr double kFp32Unit = 0x1p-24;  // fp32's unit roundoff

int MantissaBits(Float8 format) { return format == Float8::kE4M3 ? 3 : 2; }
int Bias(Float8 format) { return format == Float8::kE4M3 ? 7 : 15; }

// --- The reference, from torchao (torchao/float8/config.py, float8_linear.py,
// float8_utils.py, float8_training_tensor.py) ---

// The operands of the products, and how each recipe casts them.
struct Expected {
  Float8 format;
  Float8Scaling scaling;
  bool power_of_2;
};
Expected ExpectedCast(Float8Recipe recipe, Float8Operand operand) {
  const bool dout = operand == Float8Operand::kDoutForGradInput || operand == Float8Operand::kDoutForGradWeight;
  if (recipe == Float8Recipe::kTensorwise) {
    // Float8LinearConfig's defaults: e4m3 for input and weight, e5m2 for grad_output, per tensor.
    return {dout ? Float8::kE5M2 : Float8::kE4M3, Float8Scaling::kTensor, false};
  }
  // ROWWISE: e4m3 for all three, axiswise; round_scales_to_power_of_2=True. The axiswise_dim
  // of matmul_with_hp_or_float8_args: forward input dim -1 and weight_t dim 0 (rows of x and
  // W), grad_input grad_output dim -1 and weight_t dim -1 (rows of dy, columns of W),
  // grad_weight grad_output dim 0 and input dim 0 (columns of dy and x).
  switch (operand) {
    case Float8Operand::kInpForward:
    case Float8Operand::kWeightForward:
    case Float8Operand::kDoutForGradInput:
      return {Float8::kE4M3, Float8Scaling::kRow, true};
    default:
      return {Float8::kE4M3, Float8Scaling::kColumn, true};
  }
}

// The amax of each scale's slice, in fp64 (exact: a max of floats), NaN-propagating.
std::vector<float> ReferenceAmax(const std::vector<float>& x, int64_t rows, int64_t cols, Float8Scaling scaling) {
  std::vector<double> amax(size_t(Float8ScaleCount(scaling, rows, cols)), 0.0);
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) {
      double& m = amax[size_t(scaling == Float8Scaling::kTensor ? 0 : scaling == Float8Scaling::kRow ? i : j)];
      const double a = std::fabs(double(x[size_t(i * cols + j)]));
      m = (std::isnan(a) || std::isnan(m)) ? std::nan("") : std::max(m, a);
    }
  }
  return std::vector<float>(amax.begin(), amax.end());
}

// amax_to_scale: fp64 max / clamp(amax, EPS = 1e-12), to fp32; then exp2(floor(log2(s))),
// found here by doubling and halving.
float ReferenceScale(float amax, Float8 format, bool power_of_2) {
  const double max = format == Float8::kE4M3 ? 448.0 : 57344.0;
  const float s = float(max / std::max(double(amax), 1e-12));
  if (!power_of_2 || !(s > 0) || std::isinf(s)) return s;
  double p = 1;
  while (p * 2 <= s) p *= 2;
  while (p > s) p /= 2;
  return float(p);
}

// The code nearest v among the format's finite values, ties to the even code, magnitudes
// past the largest finite value saturated; NaN as 0x7F with v's sign.
uint8_t ReferenceEncode(float v, Float8 format) {
  const uint8_t sign = std::signbit(v) ? 0x80 : 0;
  if (std::isnan(v)) return 0x7F | sign;
  const int largest = format == Float8::kE4M3 ? 0x7E : 0x7B;
  const double a = std::fabs(double(v));
  if (a >= double(Float8Max(format))) return uint8_t(largest) | sign;
  int best = 0;
  double best_distance = kInf;
  for (int bits = 0; bits <= largest; ++bits) {
    const double d = std::fabs(double(DecodeFloat8(uint8_t(bits), format)) - a);
    if (d < best_distance || (d == best_distance && bits % 2 == 0)) best = bits, best_distance = d;
  }
  return uint8_t(best) | sign;
}

double ScaleOf(const std::vector<float>& scale, Float8Scaling scaling, int64_t i, int64_t j) {
  return scale[size_t(scaling == Float8Scaling::kTensor ? 0 : scaling == Float8Scaling::kRow ? i : j)];
}

// The codes of x (rows,cols): x * scale rounded to fp32 (the fp64 product of two floats is
// exact), then encoded.
std::vector<uint8_t> ReferenceQuantize(const std::vector<float>& x, const std::vector<float>& scale, int64_t rows,
                                       int64_t cols, Float8 format, Float8Scaling scaling) {
  std::vector<uint8_t> q(x.size());
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) {
      const float scaled = float(double(x[size_t(i * cols + j)]) * ScaleOf(scale, scaling, i, j));
      q[size_t(i * cols + j)] = ReferenceEncode(scaled, format);
    }
  }
  return q;
}

// An operand as its product reads it: amax, scale, codes, and the dequantised values in fp64.
struct ReferenceOperand {
  std::vector<float> amax, scale;
  std::vector<uint8_t> q;
  std::vector<double> value;  // (rows,cols): code / scale
};
ReferenceOperand Reference(const std::vector<float>& x, int64_t rows, int64_t cols, Float8Recipe recipe,
                           Float8Operand operand) {
  const Expected cast = ExpectedCast(recipe, operand);
  ReferenceOperand r;
  r.amax = ReferenceAmax(x, rows, cols, cast.scaling);
  for (float a : r.amax) r.scale.push_back(ReferenceScale(a, cast.format, cast.power_of_2));
  r.q = ReferenceQuantize(x, r.scale, rows, cols, cast.format, cast.scaling);
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) {
      r.value.push_back(double(DecodeFloat8(r.q[size_t(i * cols + j)], cast.format)) /
                        ScaleOf(r.scale, cast.scaling, i, j));
    }
  }
  return r;
}

// The scales of an operand as a caller computes them with the functions under test.
std::vector<float> ScalesUnderTest(const std::vector<float>& x, int64_t rows, int64_t cols, Float8Recipe recipe,
                                   Float8Operand operand) {
  const Float8Cast cast = Float8CastOf(recipe, operand);
  std::vector<float> amax(size_t(Float8ScaleCount(cast.scaling, rows, cols)));
  Float8Amax(amax.data(), x.data(), rows, cols, cast.scaling);
  std::vector<float> scale(amax.size());
  Float8Scales(scale.data(), amax.data(), int64_t(amax.size()), cast.format, cast.power_of_2_scales);
  return scale;
}

// Values of both signs over several binades, rows and columns of different magnitudes (so
// that per-row and per-column scales differ), some zeros.
std::vector<float> RandomMatrix(int64_t rows, int64_t cols, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(size_t(rows * cols));
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) {
      const float magnitude = std::ldexp(1.0f + 0.1f * float(i % 7), int(i % 5) - 2) * (1.0f + 0.05f * float(j % 11));
      x[size_t(i * cols + j)] = (i * 31 + j * 17) % 23 == 0 ? 0.0f : normal(rng) * magnitude;
    }
  }
  return x;
}

bool IsPowerOf2(float s) {
  int e = 0;
  return s > 0 && std::frexp(s, &e) == 0.5f;
}

// --- Recipes, amax and scales ---

TEST(Float8Matmul, CastsFollowTorchaosRecipes) {
  for (Float8Recipe recipe : {Float8Recipe::kTensorwise, Float8Recipe::kRowwise}) {
    for (Float8Operand operand :
         {Float8Operand::kInpForward, Float8Operand::kWeightForward, Float8Operand::kDoutForGradInput,
          Float8Operand::kWeightForGradInput, Float8Operand::kDoutForGradWeight, Float8Operand::kInpForGradWeight}) {
      const Float8Cast got = Float8CastOf(recipe, operand);
      const Expected want = ExpectedCast(recipe, operand);
      EXPECT_EQ(got.format, want.format) << int(recipe) << " " << int(operand);
      EXPECT_EQ(got.scaling, want.scaling) << int(recipe) << " " << int(operand);
      EXPECT_EQ(got.power_of_2_scales, want.power_of_2) << int(recipe) << " " << int(operand);
    }
  }
  EXPECT_EQ(Float8ScaleCount(Float8Scaling::kTensor, 5, 3), 1);
  EXPECT_EQ(Float8ScaleCount(Float8Scaling::kRow, 5, 3), 5);
  EXPECT_EQ(Float8ScaleCount(Float8Scaling::kColumn, 5, 3), 3);
}

TEST(Float8Matmul, AmaxOverTheTensorRowsColumnsAndShards) {
  const int64_t rows = 37, cols = 300;  // more columns than one block of the column sweep
  std::vector<float> x = RandomMatrix(rows, cols, 1);
  x[size_t(5 * cols + 7)] = -1000.0f;  // the largest magnitude is negative
  for (Float8Scaling scaling : {Float8Scaling::kTensor, Float8Scaling::kRow, Float8Scaling::kColumn}) {
    std::vector<float> amax(size_t(Float8ScaleCount(scaling, rows, cols)));
    Float8Amax(amax.data(), x.data(), rows, cols, scaling);
    EXPECT_EQ(amax, ReferenceAmax(x, rows, cols, scaling)) << int(scaling);
  }
  float whole = 0;
  Float8Amax(&whole, x.data(), rows, cols, Float8Scaling::kTensor);
  EXPECT_EQ(whole, 1000.0f);

  // Shards by rows (FSDP, sequence parallel): the tensor's and the columns' amaxes are the
  // max of the shards'. Shards by columns (a row-parallel layer's input): the rows' are.
  const int64_t r1 = 16, c1 = 120;
  float top = 0, bottom = 0;
  Float8Amax(&top, x.data(), r1, cols, Float8Scaling::kTensor);
  Float8Amax(&bottom, x.data() + r1 * cols, rows - r1, cols, Float8Scaling::kTensor);
  EXPECT_EQ(std::max(top, bottom), whole);
  std::vector<float> columns(static_cast<size_t>(cols)), top_columns(columns), bottom_columns(columns);
  Float8Amax(columns.data(), x.data(), rows, cols, Float8Scaling::kColumn);
  Float8Amax(top_columns.data(), x.data(), r1, cols, Float8Scaling::kColumn);
  Float8Amax(bottom_columns.data(), x.data() + r1 * cols, rows - r1, cols, Float8Scaling::kColumn);
  for (int64_t j = 0; j < cols; ++j) {
    EXPECT_EQ(std::max(top_columns[size_t(j)], bottom_columns[size_t(j)]), columns[size_t(j)]);
  }
  std::vector<float> left(size_t(rows * c1)), right(size_t(rows * (cols - c1)));
  for (int64_t i = 0; i < rows; ++i) {
    std::copy_n(x.begin() + i * cols, c1, left.begin() + i * c1);
    std::copy_n(x.begin() + i * cols + c1, cols - c1, right.begin() + i * (cols - c1));
  }
  std::vector<float> row_amax(static_cast<size_t>(rows)), left_rows(row_amax), right_rows(row_amax);
  Float8Amax(row_amax.data(), x.data(), rows, cols, Float8Scaling::kRow);
  Float8Amax(left_rows.data(), left.data(), rows, c1, Float8Scaling::kRow);
  Float8Amax(right_rows.data(), right.data(), rows, cols - c1, Float8Scaling::kRow);
  for (int64_t i = 0; i < rows; ++i) {
    EXPECT_EQ(std::max(left_rows[size_t(i)], right_rows[size_t(i)]), row_amax[size_t(i)]);
  }

  // A NaN makes its tensor's, row's and column's amax NaN, and no other; nothing is 0.
  x[size_t(9 * cols + 250)] = kNaN;
  Float8Amax(&whole, x.data(), rows, cols, Float8Scaling::kTensor);
  EXPECT_TRUE(std::isnan(whole));
  Float8Amax(row_amax.data(), x.data(), rows, cols, Float8Scaling::kRow);
  Float8Amax(columns.data(), x.data(), rows, cols, Float8Scaling::kColumn);
  for (int64_t i = 0; i < rows; ++i) EXPECT_EQ(std::isnan(row_amax[size_t(i)]), i == 9) << i;
  for (int64_t j = 0; j < cols; ++j) EXPECT_EQ(std::isnan(columns[size_t(j)]), j == 250) << j;
  // An infinity of either sign is its row's and column's amax, +infinity, and not NaN.
  x[size_t(2 * cols + 3)] = -kInf;
  Float8Amax(row_amax.data(), x.data(), rows, cols, Float8Scaling::kRow);
  Float8Amax(columns.data(), x.data(), rows, cols, Float8Scaling::kColumn);
  EXPECT_EQ(row_amax[2], kInf);
  EXPECT_EQ(columns[3], kInf);
  EXPECT_TRUE(std::isnan(row_amax[9]));
  const float empty = -1;
  whole = empty;
  Float8Amax(&whole, x.data(), 0, cols, Float8Scaling::kTensor);
  EXPECT_EQ(whole, 0.0f);
}

TEST(Float8Matmul, ScaleIsTheFormatsMaxOverTheAmaxInFp32AsTorchaoComputesIt) {
  EXPECT_EQ(Float8Scale(448.0f, Float8::kE4M3, false), 1.0f);
  EXPECT_EQ(Float8Scale(1.0f, Float8::kE4M3, false), 448.0f);
  EXPECT_EQ(Float8Scale(1.0f, Float8::kE5M2, false), 57344.0f);
  EXPECT_EQ(Float8Scale(3.0f, Float8::kE4M3, false), 448.0f / 3.0f);
  // torchao clamps the amax to EPS = 1e-12 (an fp64 constant): all-zero tensors and tiny
  // amaxes get that scale, a finite one.
  EXPECT_EQ(Float8Scale(0.0f, Float8::kE4M3, false), float(448.0 / 1e-12));
  EXPECT_EQ(Float8Scale(1e-20f, Float8::kE5M2, false), float(57344.0 / 1e-12));
  EXPECT_EQ(Float8Scale(kInf, Float8::kE4M3, false), 0.0f);
  EXPECT_TRUE(std::isnan(Float8Scale(kNaN, Float8::kE4M3, false)));
  EXPECT_TRUE(std::isnan(Float8Scale(kNaN, Float8::kE4M3, true)));
  // Across the range: the fp64 quotient rounded once to fp32 is the fp32 quotient.
  std::mt19937 rng(2);
  std::uniform_real_distribution<float> exponent(-39.0f, 120.0f);
  for (int t = 0; t < 2000; ++t) {
    const float amax = std::exp2(exponent(rng));
    for (Float8 format : {Float8::kE4M3, Float8::kE5M2}) {
      const float s = Float8Scale(amax, format, false);
      EXPECT_EQ(s, ReferenceScale(amax, format, false)) << amax;
      if (amax >= 1e-12f) {
        EXPECT_EQ(s, Float8Max(format) / amax) << amax;
      }
    }
  }
  std::vector<float> amaxes = {448.0f, 1.0f, 0.0f}, scales(3);
  Float8Scales(scales.data(), amaxes.data(), 3, Float8::kE4M3, false);
  EXPECT_EQ(scales, (std::vector<float>{1.0f, 448.0f, float(448.0 / 1e-12)}));
}

TEST(Float8Matmul, RowwiseScalesArePowersOf2RoundedDown) {
  EXPECT_EQ(Float8Scale(1.0f, Float8::kE4M3, true), 256.0f);  // 448 -> 256
  EXPECT_EQ(Float8Scale(448.0f, Float8::kE4M3, true), 1.0f);
  EXPECT_EQ(Float8Scale(449.0f, Float8::kE4M3, true), 0.5f);
  EXPECT_EQ(Float8Scale(224.0f, Float8::kE4M3, true), 2.0f);
  EXPECT_EQ(Float8Scale(1.0f, Float8::kE5M2, true), 32768.0f);
  EXPECT_EQ(Float8Scale(0.0f, Float8::kE4M3, true), 0x1p48f);  // 4.48e14 -> 2^48
  EXPECT_EQ(Float8Scale(kInf, Float8::kE4M3, true), 0.0f);
  // A scale one float below 256 rounds down to 128. (torchao's exp2(floor(log2(s))) in
  // fp32 gives 256 there: log2 rounds to 8.0. The emulation rounds down exactly.)
  const float amax = std::nextafter(1.75f, 2.0f);
  ASSERT_LT(Float8Scale(amax, Float8::kE4M3, false), 256.0f);
  EXPECT_EQ(Float8Scale(amax, Float8::kE4M3, true), 128.0f);
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> exponent(-39.0f, 120.0f);
  for (int t = 0; t < 2000; ++t) {
    const float a = std::exp2(exponent(rng));
    for (Float8 format : {Float8::kE4M3, Float8::kE5M2}) {
      const float exact = Float8Scale(a, format, false), s = Float8Scale(a, format, true);
      ASSERT_TRUE(IsPowerOf2(s)) << a;
      EXPECT_LE(s, exact) << a;
      EXPECT_GT(2 * s, exact) << a;
      EXPECT_EQ(s, ReferenceScale(a, format, true)) << a;
      if (a >= 1e-12f) {
        EXPECT_LE(double(a) * s, Float8Max(format)) << a;  // nothing saturates
      }
    }
  }
}

// --- Quantisation ---

TEST(Float8Matmul, QuantisesBitForBitAsTheReference) {
  const int64_t rows = 19, cols = 23;
  std::vector<float> x = RandomMatrix(rows, cols, 4);
  x[3] = -0.0f;
  x[4] = 1e-30f;  // far below every subnormal
  x[5] = kInf;
  x[6] = -kInf;
  for (Float8 format : {Float8::kE4M3, Float8::kE5M2}) {
    for (Float8Scaling scaling : {Float8Scaling::kTensor, Float8Scaling::kRow, Float8Scaling::kColumn}) {
      for (bool power_of_2 : {false, true}) {
        // Scales from the finite values' amaxes, and twice those: a quarter of the values
        // or so saturate.
        std::vector<float> finite = x;
        for (float& v : finite) v = std::isinf(v) ? 0.0f : v;
        std::vector<float> amax = ReferenceAmax(finite, rows, cols, scaling);
        for (float boost : {1.0f, 2.0f}) {
          std::vector<float> scale;
          for (float a : amax) scale.push_back(boost * ReferenceScale(a, format, power_of_2));
          std::vector<uint8_t> q(x.size());
          QuantizeFloat8(q.data(), x.data(), scale.data(), rows, cols, format, scaling);
          EXPECT_EQ(q, ReferenceQuantize(x, scale, rows, cols, format, scaling))
              << int(format) << " " << int(scaling) << " " << power_of_2 << " " << boost;
          EXPECT_EQ(q[3], 0x80);
          EXPECT_EQ(q[5], format == Float8::kE4M3 ? 0x7E : 0x7B);
          std::vector<float> back(x.size());
          DequantizeFloat8(back.data(), q.data(), scale.data(), rows, cols, format, scaling);
          for (int64_t i = 0; i < rows; ++i) {
            for (int64_t j = 0; j < cols; ++j) {
              const size_t k = size_t(i * cols + j);
              const float s = float(ScaleOf(scale, scaling, i, j));
              ASSERT_EQ(back[k], DecodeFloat8(q[k], format) / s);
              // Within half a step of the format at x * s, where nothing saturated.
              const double t = std::fabs(double(x[k]) * s);
              if (!std::isfinite(x[k]) || t > Float8Max(format)) continue;
              const int binade = t > 0 ? std::max(std::ilogb(t), 1 - Bias(format)) : 1 - Bias(format);
              const double half_step = std::ldexp(1.0, binade - MantissaBits(format) - 1);
              EXPECT_LE(std::fabs(double(back[k]) - double(x[k])), (half_step + t * 4 * kFp32Unit) / s) << x[k];
            }
          }
        }
      }
    }
  }
}

// Every code dequantises and quantises back to itself: exactly with a power of 2 scale, and
// with any other (the fp32 roundings of / s and * s are far below a float8 step).
TEST(Float8Matmul, EveryCodeRoundTrips) {
  for (Float8 format : {Float8::kE4M3, Float8::kE5M2}) {
    std::vector<uint8_t> codes;
    for (int bits = 0; bits < 256; ++bits) {
      if (std::isfinite(DecodeFloat8(uint8_t(bits), format))) codes.push_back(uint8_t(bits));
    }
    for (float scale : {1.0f, 0x1p-20f, 0x1p40f, 448.0f / 3.0f, 57344.0f / 0.7f, 1e-3f}) {
      std::vector<float> values(codes.size());
      DequantizeFloat8(values.data(), codes.data(), &scale, 1, int64_t(codes.size()), format, Float8Scaling::kTensor);
      std::vector<uint8_t> back(codes.size());
      QuantizeFloat8(back.data(), values.data(), &scale, 1, int64_t(codes.size()), format, Float8Scaling::kTensor);
      EXPECT_EQ(back, codes) << scale;
    }
  }
}

// --- The products ---

struct Shape {
  int64_t N;
  int K, OC;
};

// got (rows,cols) against want (fp64) within fp32's error of summing `terms` products of
// fp32-rounded dequantised values: (terms + 2) u sum |a||b| (plus the accumulated start).
void ExpectWithinFp32(const std::vector<float>& got, const std::vector<double>& want,
                      const std::vector<double>& magnitude, int terms, const char* what) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t k = 0; k < got.size(); ++k) {
    const double bound = (terms + 3) * kFp32Unit * magnitude[k] + 1e-37;
    ASSERT_LE(std::fabs(double(got[k]) - want[k]), bound) << what << " element " << k;
  }
}

TEST(Float8Matmul, ProductsMatchTheFp64ReferenceQuantisedTheSameWay) {
  for (Float8Recipe recipe : {Float8Recipe::kTensorwise, Float8Recipe::kRowwise}) {
    for (Shape shape : {Shape{7, 13, 5}, Shape{48, 64, 40}}) {
      const int64_t N = shape.N;
      const int K = shape.K, OC = shape.OC;
      const std::vector<float> inp = RandomMatrix(N, K, 10), weight = RandomMatrix(OC, K, 11),
                               dout = RandomMatrix(N, OC, 12);
      // Each operand's scales as a caller computes them, equal to the reference's, and its
      // codes bit for bit.
      auto check_operand = [&](const std::vector<float>& x, int64_t rows, int64_t cols, Float8Operand operand) {
        const ReferenceOperand r = Reference(x, rows, cols, recipe, operand);
        const std::vector<float> scale = ScalesUnderTest(x, rows, cols, recipe, operand);
        EXPECT_EQ(scale, r.scale) << int(operand);
        const Float8Cast cast = Float8CastOf(recipe, operand);
        std::vector<uint8_t> q(x.size());
        QuantizeFloat8(q.data(), x.data(), scale.data(), rows, cols, cast.format, cast.scaling);
        EXPECT_EQ(q, r.q) << int(operand);
        return std::make_pair(scale, r);
      };
      const auto [inp_scale, inp_ref] = check_operand(inp, N, K, Float8Operand::kInpForward);
      const auto [w_scale, w_ref] = check_operand(weight, OC, K, Float8Operand::kWeightForward);
      const auto [dout_gi_scale, dout_gi_ref] = check_operand(dout, N, OC, Float8Operand::kDoutForGradInput);
      const auto [w_gi_scale, w_gi_ref] = check_operand(weight, OC, K, Float8Operand::kWeightForGradInput);
      const auto [dout_gw_scale, dout_gw_ref] = check_operand(dout, N, OC, Float8Operand::kDoutForGradWeight);
      const auto [inp_gw_scale, inp_gw_ref] = check_operand(inp, N, K, Float8Operand::kInpForGradWeight);

      // out = q(inp) q(weight)^T
      std::vector<float> out(size_t(N * OC));
      Float8MatmulForward(out.data(), inp.data(), inp_scale.data(), weight.data(), w_scale.data(), N, K, OC, recipe);
      std::vector<double> want(out.size()), magnitude(out.size());
      for (int64_t n = 0; n < N; ++n) {
        for (int o = 0; o < OC; ++o) {
          for (int k = 0; k < K; ++k) {
            const double p = inp_ref.value[size_t(n * K + k)] * w_ref.value[size_t(o * K + k)];
            want[size_t(n * OC + o)] += p;
            magnitude[size_t(n * OC + o)] += std::fabs(p);
          }
        }
      }
      ExpectWithinFp32(out, want, magnitude, K, "out");

      // dinp = q(dout) q(weight)
      std::vector<float> dinp(size_t(N * K), kNaN);  // written, whatever was there
      Float8MatmulGradInput(dinp.data(), dout.data(), dout_gi_scale.data(), weight.data(), w_gi_scale.data(), N, K, OC,
                            recipe);
      want.assign(dinp.size(), 0.0);
      magnitude.assign(dinp.size(), 0.0);
      for (int64_t n = 0; n < N; ++n) {
        for (int k = 0; k < K; ++k) {
          for (int o = 0; o < OC; ++o) {
            const double p = dout_gi_ref.value[size_t(n * OC + o)] * w_gi_ref.value[size_t(o * K + k)];
            want[size_t(n * K + k)] += p;
            magnitude[size_t(n * K + k)] += std::fabs(p);
          }
        }
      }
      ExpectWithinFp32(dinp, want, magnitude, OC, "dinp");

      // dweight += q(dout)^T q(inp), onto what was there
      std::vector<float> dweight = RandomMatrix(OC, K, 13);
      want.assign(dweight.begin(), dweight.end());
      magnitude.assign(dweight.size(), 0.0);
      for (size_t k = 0; k < want.size(); ++k) magnitude[k] = std::fabs(want[k]);
      Float8MatmulGradWeight(dweight.data(), dout.data(), dout_gw_scale.data(), inp.data(), inp_gw_scale.data(), N, K,
                             OC, recipe);
      for (int o = 0; o < OC; ++o) {
        for (int k = 0; k < K; ++k) {
          for (int64_t n = 0; n < N; ++n) {
            const double p = dout_gw_ref.value[size_t(n * OC + o)] * inp_gw_ref.value[size_t(n * K + k)];
            want[size_t(o * K + k)] += p;
            magnitude[size_t(o * K + k)] += std::fabs(p);
          }
        }
      }
      ExpectWithinFp32(dweight, want, magnitude, int(N), "dweight");
    }
  }
}

// The products' error against the exact products of the unquantised operands is the
// error of the recipe's formats. For each operand of each product in turn, the other is
// built from float8 values times 2^-3, the largest in every row and column (so that every
// scale is 2^3 and it quantises exactly), and the squared error summed over the output
// must be within [0.7, 1.4] of its expectation: the sum over the contraction of
// other^2 step^2 / 12, the variance of rounding to nearest with the step of the operand's
// format at its value times its scale. One mantissa bit more or less (E4M3 for E5M2 or the
// reverse) moves the sum 4-fold. No element exceeds the worst case either: the sum of
// |other| step / 2, and fp32's rounding.
TEST(Float8Matmul, ProductsErrAsTheRecipesFormatsDo) {
  const int64_t N = 64;
  const int K = 96, OC = 80;
  auto exact_matrix = [](int64_t rows, int64_t cols, Float8 format, uint32_t seed) {
    std::mt19937 rng(seed);
    const int largest = format == Float8::kE4M3 ? 0x7E : 0x7B;
    std::uniform_int_distribution<int> code(0, 255);
    std::vector<float> x(size_t(rows * cols));
    for (float& v : x) {
      int bits = code(rng);
      if ((bits & 0x7F) > largest) bits &= 0xBF;  // a NaN or infinity code: a finite one
      v = std::ldexp(DecodeFloat8(uint8_t(bits), format), -3);
    }
    for (int64_t i = 0; i < std::max(rows, cols); ++i) {
      x[size_t((i % rows) * cols + i % cols)] = std::ldexp(Float8Max(format), -3) * (i % 2 ? -1.0f : 1.0f);
    }
    return x;
  };
  enum class Product { kForward, kGradInput, kGradWeight };
  struct Case {
    const char* name;
    Product product;
    Float8Operand first, second;  // the product's operands, in its arguments' order
    bool first_is_noisy;
  };
  const Case cases[] = {
      {"out, inp's error", Product::kForward, Float8Operand::kInpForward, Float8Operand::kWeightForward, true},
      {"out, weight's error", Product::kForward, Float8Operand::kInpForward, Float8Operand::kWeightForward, false},
      {"dinp, dout's error", Product::kGradInput, Float8Operand::kDoutForGradInput, Float8Operand::kWeightForGradInput,
       true},
      {"dinp, weight's error", Product::kGradInput, Float8Operand::kDoutForGradInput,
       Float8Operand::kWeightForGradInput, false},
      {"dweight, dout's error", Product::kGradWeight, Float8Operand::kDoutForGradWeight,
       Float8Operand::kInpForGradWeight, true},
      {"dweight, inp's error", Product::kGradWeight, Float8Operand::kDoutForGradWeight,
       Float8Operand::kInpForGradWeight, false},
  };
  // The stored shape of an operand: inp (N,K), weight (OC,K), dout (N,OC).
  auto shape_of = [&](Float8Operand operand) -> std::pair<int64_t, int64_t> {
    switch (operand) {
      case Float8Operand::kInpForward:
      case Float8Operand::kInpForGradWeight:
        return {N, K};
      case Float8Operand::kWeightForward:
      case Float8Operand::kWeightForGradInput:
        return {int64_t(OC), K};
      default:
        return {N, OC};
    }
  };
  uint32_t seed = 100;
  for (Float8Recipe recipe : {Float8Recipe::kTensorwise, Float8Recipe::kRowwise}) {
    const char* recipe_name = recipe == Float8Recipe::kTensorwise ? " (tensorwise)" : " (rowwise)";
    for (const Case& c : cases) {
      const Float8Operand noisy_operand = c.first_is_noisy ? c.first : c.second;
      const Float8Operand exact_operand = c.first_is_noisy ? c.second : c.first;
      const auto [noisy_rows, noisy_cols] = shape_of(noisy_operand);
      const auto [exact_rows, exact_cols] = shape_of(exact_operand);
      const std::vector<float> noisy = RandomMatrix(noisy_rows, noisy_cols, seed++);
      const std::vector<float> exact =
          exact_matrix(exact_rows, exact_cols, ExpectedCast(recipe, exact_operand).format, seed++);
      const ReferenceOperand noisy_ref = Reference(noisy, noisy_rows, noisy_cols, recipe, noisy_operand);
      const ReferenceOperand exact_ref = Reference(exact, exact_rows, exact_cols, recipe, exact_operand);
      for (size_t k = 0; k < exact.size(); ++k) ASSERT_EQ(exact_ref.value[k], double(exact[k])) << c.name;

      // Each noisy element's rounding variance and worst error, by the recipe's format.
      const Expected cast = ExpectedCast(recipe, noisy_operand);
      std::vector<double> variance(noisy.size()), worst(noisy.size());
      for (int64_t i = 0; i < noisy_rows; ++i) {
        for (int64_t j = 0; j < noisy_cols; ++j) {
          const size_t k = size_t(i * noisy_cols + j);
          const double s = ScaleOf(noisy_ref.scale, cast.scaling, i, j);
          const double t = std::fabs(double(noisy[k]) * s);
          const int binade = t > 0 ? std::max(std::ilogb(t), 1 - Bias(cast.format)) : 1 - Bias(cast.format);
          const double step = t > 0 ? std::ldexp(1.0, binade - MantissaBits(cast.format)) / s : 0.0;
          variance[k] = step * step / 12;
          worst[k] = step / 2 + 4 * kFp32Unit * std::fabs(double(noisy[k]));
        }
      }

      const std::vector<float>& first = c.first_is_noisy ? noisy : exact;
      const std::vector<float>& second = c.first_is_noisy ? exact : noisy;
      const std::vector<float>& first_scale = c.first_is_noisy ? noisy_ref.scale : exact_ref.scale;
      const std::vector<float>& second_scale = c.first_is_noisy ? exact_ref.scale : noisy_ref.scale;
      // The output (M,P) = sum over `terms` of left(m, t) right(t, p); index_first(m, t)
      // and index_second(t, p) find the factors in the stored operands.
      int64_t M = 0, P = 0, terms = 0;
      std::function<size_t(int64_t, int64_t)> index_first, index_second;
      std::vector<float> got;
      switch (c.product) {
        case Product::kForward:  // out (N,OC) = inp (N,K) weight (OC,K)^T
          M = N, P = OC, terms = K;
          index_first = [&](int64_t m, int64_t t) { return size_t(m * K + t); };
          index_second = [&](int64_t t, int64_t p) { return size_t(p * K + t); };
          got.resize(size_t(M * P));
          Float8MatmulForward(got.data(), first.data(), first_scale.data(), second.data(), second_scale.data(), N, K,
                              OC, recipe);
          break;
        case Product::kGradInput:  // dinp (N,K) = dout (N,OC) weight (OC,K)
          M = N, P = K, terms = OC;
          index_first = [&](int64_t m, int64_t t) { return size_t(m * OC + t); };
          index_second = [&](int64_t t, int64_t p) { return size_t(t * K + p); };
          got.resize(size_t(M * P));
          Float8MatmulGradInput(got.data(), first.data(), first_scale.data(), second.data(), second_scale.data(), N, K,
                                OC, recipe);
          break;
        case Product::kGradWeight:  // dweight (OC,K) = dout (N,OC)^T inp (N,K)
          M = OC, P = K, terms = N;
          index_first = [&](int64_t m, int64_t t) { return size_t(t * OC + m); };
          index_second = [&](int64_t t, int64_t p) { return size_t(t * K + p); };
          got.assign(size_t(M * P), 0.0f);
          Float8MatmulGradWeight(got.data(), first.data(), first_scale.data(), second.data(), second_scale.data(), N,
                                 K, OC, recipe);
          break;
      }
      double error2 = 0, expected2 = 0;
      for (int64_t m = 0; m < M; ++m) {
        for (int64_t p = 0; p < P; ++p) {
          double exact_sum = 0, magnitude = 0, var = 0, bound = 0;
          for (int64_t t = 0; t < terms; ++t) {
            const size_t i1 = index_first(m, t), i2 = index_second(t, p);
            const double a = first[i1], b = second[i2];
            exact_sum += a * b;
            magnitude += std::fabs(a * b);
            const size_t noisy_index = c.first_is_noisy ? i1 : i2;
            const double other = c.first_is_noisy ? b : a;
            var += other * other * variance[noisy_index];
            bound += std::fabs(other) * worst[noisy_index];
          }
          const double e = double(got[size_t(m * P + p)]) - exact_sum;
          error2 += e * e;
          expected2 += var;
          ASSERT_LE(std::fabs(e), bound + (terms + 3) * kFp32Unit * (magnitude + bound))
              << c.name << recipe_name << " at " << m << "," << p;
        }
      }
      const double ratio = error2 / expected2;
      EXPECT_GE(ratio, 0.7) << c.name << recipe_name;
      EXPECT_LE(ratio, 1.4) << c.name << recipe_name;
      std::cout << c.name << recipe_name << ": squared error " << ratio << " of the expected\n";
    }
  }
}

}  // namespace
}  // namespace meshtrain::kernels::cpu::float8_matmul_test
