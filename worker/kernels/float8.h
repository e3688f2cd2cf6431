// The two float8 formats of the OCP 8-bit floating point specification (OFP8, v1.0), as
// CUDA's __nv_fp8_e4m3 and __nv_fp8_e5m2 store them and torch's float8_e4m3fn and
// float8_e5m2:
//   E4M3  sign, 4 exponent bits (bias 7), 3 mantissa bits; no infinities; S.1111.111 is
//         NaN; the largest finite value is 448 (S.1111.110); subnormals m x 2^-9.
//   E5M2  sign, 5 exponent bits (bias 15), 2 mantissa bits; S.11111.00 is infinity,
//         S.11111.{01,10,11} NaN; the largest finite value is 57344; subnormals m x 2^-16.
// Encoding rounds to the nearest value, ties to an even mantissa, and saturates: a value
// past the largest finite one, infinity included, becomes that largest one with its sign
// (CUDA's __NV_SATFINITE, torchao's saturated casts). NaN encodes as 0x7F (0xFF with its
// sign bit). Decoding is exact in float. The CPU's float8 emulation and its tests use
// these; the device kernels convert the same way.
// Thread-safety: pure functions.

#pragma once

#include <bit>
#include <cstdint>

namespace meshtrain::kernels {

enum class Float8 { kE4M3, kE5M2 };

// The largest finite value of each format: 448 and 57344.
float Float8Max(Float8 format);

// `x` in `format`, rounded to nearest even and saturated.
uint8_t EncodeFloat8(float x, Float8 format);

// The value of `bits` in `format` (NaN for its NaN encodings, +-infinity for E5M2's).
float DecodeFloat8(uint8_t bits, Float8 format);

// DecodeFloat8(EncodeFloat8(x, format), format), computed on x's bits without the code and
// without branches, so that loops over it vectorize: what a product multiplies after a
// cast (cpu/float8_matmul.h). NaN stays NaN.
inline float RoundToFloat8(float x, Float8 format) {
  const bool e4m3 = format == Float8::kE4M3;
  const int dropped = e4m3 ? 20 : 21;                  // fp32's 23 mantissa bits less the format's
  const float max = e4m3 ? 448.0f : 57344.0f;          // the largest finite value
  const float min_normal = e4m3 ? 0x1p-6f : 0x1p-14f;  // below it, multiples of the subnormal quantum
  const float quanta = e4m3 ? 0x1p9f : 0x1p16f;        // subnormal quanta in 1
  const uint32_t bits = std::bit_cast<uint32_t>(x) & 0x7FFFFFFFu, sign = std::bit_cast<uint32_t>(x) & 0x80000000u;
  const float a = std::bit_cast<float>(bits);
  // A normal value: the mantissa rounded to the format's bits, half to even (a carry moves
  // into the exponent; infinity stays infinity).
  const uint32_t half = (1u << (dropped - 1)) - 1 + ((bits >> dropped) & 1u);
  const float normal = std::bit_cast<float>((bits + half) & ~((1u << dropped) - 1));
  // A subnormal one: a whole number of quanta (a x quanta < 8), rounded half to even by
  // adding and taking away 1.5 x 2^23; the scalings by powers of 2 are exact.
  const float sub = ((a * quanta + 0x1.8p23f) - 0x1.8p23f) * (1.0f / quanta);
  float r = a < min_normal ? sub : normal;
  r = r < max ? r : max;  // saturated, infinity included
  r = std::bit_cast<float>(std::bit_cast<uint32_t>(r) | sign);
  return bits > 0x7F800000u ? x : r;  // NaN
}

// Float8 training's recipes (torchao's Float8LinearRecipeName; spec.training.float8.recipe):
//   kTensorwise  one scale per tensor: E4M3 for inputs and weights, E5M2 for output
//                gradients; scales as computed.
//   kRowwise     E4M3 throughout, a scale per row of each operand along its product's
//                contraction axis; scales rounded down to a power of 2.
// cpu/float8_matmul.h sets out each product's operands.
enum class Float8Recipe { kTensorwise, kRowwise };
// "tensorwise", "rowwise"
constexpr const char* Float8RecipeName(Float8Recipe recipe) {
  return recipe == Float8Recipe::kTensorwise ? "tensorwise" : "rowwise";
}

// The axis a tensor (rows,cols) is scaled along: one scale for the whole tensor, one per
// row (rows of them: the amax over each row's cols values) or one per column (cols of
// them: the amax over each column's rows values).
enum class Float8Scaling { kTensor, kRow, kColumn };

// An operand of the linear layer's products, in the product it enters.
enum class Float8Operand {
  kInpForward,         // inp (N,K) in out = inp @ weight^T
  kWeightForward,      // weight (OC,K) in out = inp @ weight^T
  kDoutForGradInput,   // dout (N,OC) in dinp = dout @ weight
  kWeightForGradInput, // weight (OC,K) in dinp = dout @ weight
  kDoutForGradWeight,  // dout (N,OC) in dweight += dout^T @ inp
  kInpForGradWeight,   // inp (N,K) in dweight += dout^T @ inp
};

// How an operand is cast under a recipe: its format, the axis of its scales (of the
// operand as stored, (N,K), (OC,K) or (N,OC)), and whether scales are powers of 2.
struct Float8Cast {
  Float8 format;
  Float8Scaling scaling;
  bool power_of_2_scales;
};
// (Inline: the CUDA plugin, which links no CPU kernels, casts by it too.)
constexpr Float8Cast Float8CastOf(Float8Recipe recipe, Float8Operand operand) {
  if (recipe == Float8Recipe::kTensorwise) {
    const bool dout = operand == Float8Operand::kDoutForGradInput || operand == Float8Operand::kDoutForGradWeight;
    return {dout ? Float8::kE5M2 : Float8::kE4M3, Float8Scaling::kTensor, false};
  }
  // Rowwise: each operand scaled along its product's contraction axis: along the rows of
  // the forward's operands and of dout in the grad input, along the columns of the rest.
  const bool along_rows = operand == Float8Operand::kInpForward || operand == Float8Operand::kWeightForward ||
                          operand == Float8Operand::kDoutForGradInput;
  return {Float8::kE4M3, along_rows ? Float8Scaling::kRow : Float8Scaling::kColumn, true};
}

// How many scales (or amaxes) a tensor (rows,cols) has under `scaling`: 1, rows or cols.
constexpr int64_t Float8ScaleCount(Float8Scaling scaling, int64_t rows, int64_t cols) {
  return scaling == Float8Scaling::kTensor ? 1 : scaling == Float8Scaling::kRow ? rows : cols;
}

// The scale of one amax: float(max / max(double(amax), 1e-12)) with max = Float8Max
// (448 or 57344), computed in fp64 and rounded once to fp32, as torchao's amax_to_scale
// (EPS = 1e-12); NaN for a NaN amax, 0 for an infinite one. With power_of_2, the result is
// then rounded down to a power of 2 exactly (the largest 2^e <= scale; 0 and NaN stay).
float Float8Scale(float amax, Float8 format, bool power_of_2);

}  // namespace meshtrain::kernels
