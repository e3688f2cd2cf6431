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

#include <cstdint>

namespace meshtrain::kernels {

enum class Float8 { kE4M3, kE5M2 };

// The largest finite value of each format: 448 and 57344.
float Float8Max(Float8 format);

// `x` in `format`, rounded to nearest even and saturated.
uint8_t EncodeFloat8(float x, Float8 format);

// The value of `bits` in `format` (NaN for its NaN encodings, +-infinity for E5M2's).
float DecodeFloat8(uint8_t bits, Float8 format);

}  // namespace meshtrain::kernels
