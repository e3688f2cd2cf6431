// bfloat16 on the host: the storage type of bf16 tensors in the CPU emulation of the GPU
// kernels, and the bits the CUDA plugin reads as __nv_bfloat16 (same size and layout).
//
// Conversion from float rounds to nearest, ties to even, as the GPU's __float2bfloat16
// does; a NaN stays a NaN. Thread-safety: a plain value.

#pragma once

#include <bit>
#include <cstdint>

namespace meshtrain::runtime {

struct bf16 {
  uint16_t bits = 0;

  bf16() = default;
  explicit bf16(float x) : bits(FromFloat(x)) {}
  explicit bf16(double x) : bf16(float(x)) {}
  explicit operator float() const { return ToFloat(bits); }
  explicit operator double() const { return double(ToFloat(bits)); }

  static constexpr float ToFloat(uint16_t b) { return std::bit_cast<float>(uint32_t{b} << 16); }
  static constexpr uint16_t FromFloat(float x) {
    uint32_t u = std::bit_cast<uint32_t>(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // NaN: keep it one
    u += 0x7fffu + ((u >> 16) & 1u);
    return uint16_t(u >> 16);
  }
  friend bool operator==(bf16 a, bf16 b) { return a.bits == b.bits; }
};
static_assert(sizeof(bf16) == 2);

// x rounded to the nearest bf16, as float: what storing x in bf16 and reading it back gives.
inline float RoundToBf16(float x) { return bf16::ToFloat(bf16::FromFloat(x)); }

}  // namespace meshtrain::runtime
