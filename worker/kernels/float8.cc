#include "worker/kernels/float8.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace meshtrain::kernels {
namespace {

// torchao's float8_utils.EPS: amax_to_scale clamps the amax to it, "to avoid division by zero".
constexpr double kAmaxFloor = 1e-12;

struct Layout {
  int mantissa_bits;
  int bias;
  uint8_t max_finite;  // the magnitude's code of the largest finite value
};

Layout LayoutOf(Float8 format) {
  return format == Float8::kE4M3 ? Layout{3, 7, 0x7E} : Layout{2, 15, 0x7B};
}

}  // namespace

float Float8Max(Float8 format) { return DecodeFloat8(LayoutOf(format).max_finite, format); }

uint8_t EncodeFloat8(float x, Float8 format) {
  const Layout f = LayoutOf(format);
  if (std::isnan(x)) return 0x7F | (std::signbit(x) ? 0x80 : 0);
  const uint8_t sign = std::signbit(x) ? 0x80 : 0;
  if (std::isinf(x)) return uint8_t(f.max_finite | sign);
  const double a = std::fabs(double(x));
  const int M = f.mantissa_bits;
  const int min_exponent = 1 - f.bias;  // of the smallest normal value
  int exponent = 0;
  std::frexp(a, &exponent);  // a = fraction x 2^exponent, fraction in [0.5, 1)
  --exponent;                // a = 1.m x 2^exponent
  // The quantum at a's binade (or the subnormals'), and a in quanta, rounded half to even:
  // exact in double, since a is a float.
  const int quantum = (a == 0 || exponent < min_exponent ? min_exponent : exponent) - M;
  const double quanta = std::nearbyint(std::ldexp(a, -quantum));
  uint32_t code = 0;
  if (quantum == min_exponent - M) {
    code = uint32_t(quanta);  // subnormal; 2^M quanta is the smallest normal's code
  } else {
    // 2^(M+1) quanta carry into the next binade: the code's exponent field counts on.
    code = (uint32_t(exponent + f.bias) << M) + uint32_t(quanta) - (1u << M);
  }
  if (code > f.max_finite) code = f.max_finite;  // saturate, infinity included
  return uint8_t(code) | sign;
}

float DecodeFloat8(uint8_t bits, Float8 format) {
  const Layout f = LayoutOf(format);
  const int M = f.mantissa_bits;
  const float sign = (bits & 0x80) ? -1.0f : 1.0f;
  const uint32_t magnitude = bits & 0x7F;
  const uint32_t exponent_field = magnitude >> M, mantissa = magnitude & ((1u << M) - 1);
  const uint32_t all_ones = (1u << (7 - M)) - 1;
  if (format == Float8::kE4M3 && magnitude == 0x7F) return std::numeric_limits<float>::quiet_NaN();
  if (format == Float8::kE5M2 && exponent_field == all_ones) {
    return mantissa == 0 ? sign * std::numeric_limits<float>::infinity() : std::numeric_limits<float>::quiet_NaN();
  }
  if (exponent_field == 0) return sign * std::ldexp(float(mantissa), 1 - f.bias - M);
  return sign * std::ldexp(float((1u << M) + mantissa), int(exponent_field) - f.bias - M);
}

float Float8Scale(float amax, Float8 format, bool power_of_2) {
  if (std::isnan(amax)) return std::numeric_limits<float>::quiet_NaN();
  // torchao: amax.to(float64); finfo(dtype).max / clamp(amax, min=EPS); .to(float32). (A
  // quotient of two floats rounded to fp64, then to fp32, is the fp32 quotient: the double
  // rounding is harmless, so an fp32 division agrees wherever amax >= 1e-12.)
  const float scale = float(double(Float8Max(format)) / std::max(double(amax), kAmaxFloor));
  if (!power_of_2 || !(scale > 0) || std::isinf(scale)) return scale;
  // The largest power of 2 not above scale: scale = f x 2^e with f in [0.5, 1).
  int e = 0;
  std::frexp(scale, &e);
  return std::ldexp(1.0f, e - 1);
}

}  // namespace meshtrain::kernels
