#include "worker/comm/types.h"

#include <bit>
#include <cmath>
#include <cstring>

namespace meshtrain::comm {

size_t ElementSize(DataType type) {
  switch (type) {
    case DataType::kFloat32: return 4;
    case DataType::kBFloat16: return 2;
    case DataType::kFloat16: return 2;
    case DataType::kInt32: return 4;
    case DataType::kInt64: return 8;
    case DataType::kFloat64: return 8;
  }
  return 0;
}

const char* DataTypeName(DataType type) {
  switch (type) {
    case DataType::kFloat32: return "fp32";
    case DataType::kBFloat16: return "bf16";
    case DataType::kFloat16: return "fp16";
    case DataType::kInt32: return "int32";
    case DataType::kInt64: return "int64";
    case DataType::kFloat64: return "fp64";
  }
  return "?";
}

const char* ReduceOpName(ReduceOp op) { return op == ReduceOp::kSum ? "sum" : "avg"; }

float Bf16ToFloat(uint16_t value) { return std::bit_cast<float>(uint32_t{value} << 16); }

uint16_t FloatToBf16(float value) {
  uint32_t bits = std::bit_cast<uint32_t>(value);
  if (std::isnan(value)) return static_cast<uint16_t>((bits >> 16) | 0x40);  // stay a NaN
  bits += 0x7fff + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

float Fp16ToFloat(uint16_t value) {
  uint32_t sign = uint32_t{value & 0x8000u} << 16;
  uint32_t exponent = (value >> 10) & 0x1f;
  uint32_t mantissa = value & 0x3ff;
  if (exponent == 0x1f) return std::bit_cast<float>(sign | 0x7f800000u | (mantissa << 13));
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24
    float magnitude = std::ldexp(static_cast<float>(mantissa), -24);
    return sign ? -magnitude : magnitude;
  }
  return std::bit_cast<float>(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

uint16_t FloatToFp16(float value) {
  uint32_t bits = std::bit_cast<uint32_t>(value);
  uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000);
  float magnitude = std::fabs(value);
  if (std::isnan(value)) return sign | 0x7e00;
  if (magnitude >= 65520.0f) return sign | 0x7c00;  // rounds to infinity
  if (magnitude < 6.103515625e-05f) {  // subnormal range: round(magnitude * 2^24)
    return sign | static_cast<uint16_t>(std::nearbyint(magnitude * 16777216.0f));
  }
  uint32_t m = std::bit_cast<uint32_t>(magnitude);
  m += 0xfff + ((m >> 13) & 1);  // round the 13 dropped mantissa bits to nearest-even
  return sign | static_cast<uint16_t>(((m >> 23) - 112) << 10 | ((m >> 13) & 0x3ff));
}

namespace {

template <class T>
void SumOf(void* out, const void* a, const void* b, size_t count) {
  T* o = static_cast<T*>(out);
  const T* x = static_cast<const T*>(a);
  const T* y = static_cast<const T*>(b);
  for (size_t i = 0; i < count; ++i) o[i] = x[i] + y[i];
}

template <float (*ToFloat)(uint16_t), uint16_t (*FromFloat)(float)>
void SumOfHalves(void* out, const void* a, const void* b, size_t count) {
  uint16_t* o = static_cast<uint16_t*>(out);
  const uint16_t* x = static_cast<const uint16_t*>(a);
  const uint16_t* y = static_cast<const uint16_t*>(b);
  for (size_t i = 0; i < count; ++i) o[i] = FromFloat(ToFloat(x[i]) + ToFloat(y[i]));
}

template <class T>
void DivideAll(void* buf, size_t count, int divisor) {
  T* b = static_cast<T*>(buf);
  for (size_t i = 0; i < count; ++i) b[i] /= static_cast<T>(divisor);
}

template <float (*ToFloat)(uint16_t), uint16_t (*FromFloat)(float)>
void DivideHalf(void* buf, size_t count, int divisor) {
  uint16_t* b = static_cast<uint16_t*>(buf);
  for (size_t i = 0; i < count; ++i) b[i] = FromFloat(ToFloat(b[i]) / static_cast<float>(divisor));
}

}  // namespace

void Sum(void* out, const void* a, const void* b, size_t count, DataType type) {
  switch (type) {
    case DataType::kFloat32: return SumOf<float>(out, a, b, count);
    case DataType::kBFloat16: return SumOfHalves<Bf16ToFloat, FloatToBf16>(out, a, b, count);
    case DataType::kFloat16: return SumOfHalves<Fp16ToFloat, FloatToFp16>(out, a, b, count);
    case DataType::kInt32: return SumOf<int32_t>(out, a, b, count);
    case DataType::kInt64: return SumOf<int64_t>(out, a, b, count);
    case DataType::kFloat64: return SumOf<double>(out, a, b, count);
  }
}

void DivideBy(void* buf, size_t count, DataType type, int divisor) {
  switch (type) {
    case DataType::kFloat32: return DivideAll<float>(buf, count, divisor);
    case DataType::kBFloat16: return DivideHalf<Bf16ToFloat, FloatToBf16>(buf, count, divisor);
    case DataType::kFloat16: return DivideHalf<Fp16ToFloat, FloatToFp16>(buf, count, divisor);
    case DataType::kInt32: return DivideAll<int32_t>(buf, count, divisor);
    case DataType::kInt64: return DivideAll<int64_t>(buf, count, divisor);
    case DataType::kFloat64: return DivideAll<double>(buf, count, divisor);
  }
}

}  // namespace meshtrain::comm
