// The float8 conversions (worker/kernels/float8.h) against tables written from the OCP
// 8-bit floating point specification (OFP8 v1.0, tables 1 and 2): every boundary of E4M3
// and E5M2 (zero, the subnormals, the smallest normal, one, the largest finite value,
// infinity and NaN), rounding to nearest even at midpoints in the normals and the
// subnormals, and saturation of what lies past the largest finite value.

#include "worker/kernels/float8.h"

#include <bit>
#include <cmath>
#include <limits>
#include <random>

#include <gtest/gtest.h>

namespace meshtrain::kernels {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

struct Code {
  uint8_t bits;
  float value;
};

TEST(Float8, E4M3DecodesTheSpecificationsBoundaries) {
  const Code table[] = {
      {0x00, 0.0f},       {0x01, 0x1p-9f},     {0x02, 0x1p-8f},  {0x07, 0x1.cp-7f},  // subnormals m x 2^-9
      {0x08, 0x1p-6f},    {0x09, 0x1.2p-6f},                                        // the smallest normals
      {0x38, 1.0f},       {0x39, 1.125f},      {0x3F, 1.875f},   {0x40, 2.0f},
      {0x77, 240.0f},     {0x78, 256.0f},      {0x7E, 448.0f},                      // the largest finite
      {0x80, -0.0f},      {0x81, -0x1p-9f},    {0xB8, -1.0f},    {0xFE, -448.0f},
  };
  for (const Code& c : table) {
    EXPECT_EQ(DecodeFloat8(c.bits, Float8::kE4M3), c.value) << int(c.bits);
    EXPECT_EQ(std::signbit(DecodeFloat8(c.bits, Float8::kE4M3)), std::signbit(c.value)) << int(c.bits);
  }
  EXPECT_TRUE(std::isnan(DecodeFloat8(0x7F, Float8::kE4M3)));
  EXPECT_TRUE(std::isnan(DecodeFloat8(0xFF, Float8::kE4M3)));
  EXPECT_EQ(Float8Max(Float8::kE4M3), 448.0f);
}

TEST(Float8, E5M2DecodesTheSpecificationsBoundaries) {
  const Code table[] = {
      {0x00, 0.0f},      {0x01, 0x1p-16f},  {0x02, 0x1p-15f},  {0x03, 0x1.8p-15f},  // subnormals m x 2^-16
      {0x04, 0x1p-14f},  {0x05, 0x1.4p-14f},                                       // the smallest normals
      {0x3C, 1.0f},      {0x3D, 1.25f},     {0x3E, 1.5f},      {0x3F, 1.75f},
      {0x78, 32768.0f},  {0x7B, 57344.0f},                                         // the largest finite
      {0x7C, kInf},      {0xFC, -kInf},     {0xBC, -1.0f},     {0xFB, -57344.0f},
  };
  for (const Code& c : table) EXPECT_EQ(DecodeFloat8(c.bits, Float8::kE5M2), c.value) << int(c.bits);
  for (uint8_t nan : {0x7D, 0x7E, 0x7F, 0xFD, 0xFE, 0xFF}) {
    EXPECT_TRUE(std::isnan(DecodeFloat8(nan, Float8::kE5M2))) << int(nan);
  }
  EXPECT_EQ(Float8Max(Float8::kE5M2), 57344.0f);
}

// Every finite code is its own value's encoding; the values grow with the codes.
TEST(Float8, EveryFiniteCodeEncodesBackToItselfInOrder) {
  for (Float8 format : {Float8::kE4M3, Float8::kE5M2}) {
    float last = -1;
    for (int bits = 0; bits < 0x80; ++bits) {
      const float value = DecodeFloat8(uint8_t(bits), format);
      if (!std::isfinite(value)) continue;
      EXPECT_EQ(EncodeFloat8(value, format), bits) << bits;
      EXPECT_EQ(EncodeFloat8(-value, format), bits | 0x80) << bits;
      EXPECT_GT(value, last) << bits;
      last = value;
    }
  }
}

TEST(Float8, RoundsToNearestEvenAndSaturates) {
  const struct {
    float x;
    Float8 format;
    uint8_t bits;
  } cases[] = {
      // E4M3: midpoints go to the even mantissa, in the normals and the subnormals.
      {1.0625f, Float8::kE4M3, 0x38},    // between 1 (0x38) and 1.125: to 1
      {1.1875f, Float8::kE4M3, 0x3A},    // between 1.125 (0x39) and 1.25: to 1.25
      {1.07f, Float8::kE4M3, 0x39},      // past the midpoint: up
      {0x1p-10f, Float8::kE4M3, 0x00},   // half the smallest subnormal: to 0
      {0x1.8p-9f, Float8::kE4M3, 0x02},  // between 2^-9 (0x01) and 2^-8: to 2^-8
      {0x1.ep-7f, Float8::kE4M3, 0x08},  // between 7 x 2^-9 and the smallest normal: to it
      {0x1p-12f, Float8::kE4M3, 0x00},   // far below: 0
      {-0x1p-12f, Float8::kE4M3, 0x80},  // with its sign
      {464.0f, Float8::kE4M3, 0x7E},     // past 448: saturated
      {1e30f, Float8::kE4M3, 0x7E},
      {kInf, Float8::kE4M3, 0x7E},
      {-kInf, Float8::kE4M3, 0xFE},
      {kNaN, Float8::kE4M3, 0x7F},
      // E5M2
      {1.125f, Float8::kE5M2, 0x3C},     // between 1 (0x3C) and 1.25: to 1
      {1.375f, Float8::kE5M2, 0x3E},     // between 1.25 (0x3D) and 1.5: to 1.5
      {0x1p-17f, Float8::kE5M2, 0x00},   // half the smallest subnormal: to 0
      {0x1.8p-16f, Float8::kE5M2, 0x02}, // between 2^-16 and 2^-15: to 2^-15
      {61440.0f, Float8::kE5M2, 0x7B},   // the midpoint past 57344: saturated, not infinity
      {1e30f, Float8::kE5M2, 0x7B},
      {kInf, Float8::kE5M2, 0x7B},
      {-kInf, Float8::kE5M2, 0xFB},
      {kNaN, Float8::kE5M2, 0x7F},
  };
  for (const auto& c : cases) {
    EXPECT_EQ(EncodeFloat8(c.x, c.format), c.bits) << c.x << (c.format == Float8::kE4M3 ? " as E4M3" : " as E5M2");
  }
}

// Encoding at every boundary of the specification's tables: the zeros, the smallest and
// largest subnormals, the smallest normal, the largest finite value and what lies past it
// (E4M3's S.1111.111 and E5M2's S.11111.00 are NaN and infinity: a saturating encoder
// never gives them for a number), the float range's ends, and NaN with either sign.
TEST(Float8, EncodesTheSpecificationsBoundaries) {
  constexpr float kFloatMax = std::numeric_limits<float>::max();
  constexpr float kFloatTiniest = std::numeric_limits<float>::denorm_min();
  const struct {
    float x;
    uint8_t bits;
  } e4m3[] = {
      {0.0f, 0x00},          {-0.0f, 0x80},
      {0x1p-9f, 0x01},       {-0x1p-9f, 0x81},        // the smallest subnormal
      {0x1.000002p-10f, 0x01},                        // just past half of it: up
      {kFloatTiniest, 0x00}, {-kFloatTiniest, 0x80},  // float's smallest: to a signed 0
      {0x1.cp-7f, 0x07},                              // the largest subnormal, 7 x 2^-9
      {0x1p-6f, 0x08},       {-0x1p-6f, 0x88},        // the smallest normal
      {0x1.dp-7f, 0x07},     {0x1.fp-7f, 0x08},       // either side of the midpoint between them
      {1.0f, 0x38},          {256.0f, 0x78},          {416.0f, 0x7D},
      {448.0f, 0x7E},        {-448.0f, 0xFE},         // the largest finite
      {456.0f, 0x7E},        {463.99997f, 0x7E},      // below the midpoint past 448
      {480.0f, 0x7E},        {-480.0f, 0xFE},         // S.1111.111's value if it were a number: saturated
      {kFloatMax, 0x7E},     {-kFloatMax, 0xFE},
      {-kNaN, 0xFF},
  };
  for (const auto& c : e4m3) EXPECT_EQ(EncodeFloat8(c.x, Float8::kE4M3), c.bits) << c.x;
  const struct {
    float x;
    uint8_t bits;
  } e5m2[] = {
      {0.0f, 0x00},          {-0.0f, 0x80},
      {0x1p-16f, 0x01},      {-0x1p-16f, 0x81},       // the smallest subnormal
      {0x1.000002p-17f, 0x01},                        // just past half of it: up
      {kFloatTiniest, 0x00}, {-kFloatTiniest, 0x80},
      {0x1.8p-15f, 0x03},                             // the largest subnormal, 3 x 2^-16
      {0x1p-14f, 0x04},      {-0x1p-14f, 0x84},       // the smallest normal
      {0x1.cp-15f, 0x04},                             // the midpoint between them: to the even 0x04
      {1.0f, 0x3C},          {32768.0f, 0x78},        {49152.0f, 0x7A},
      {57344.0f, 0x7B},      {-57344.0f, 0xFB},       // the largest finite
      {61439.996f, 0x7B},                             // below the midpoint past 57344
      {65536.0f, 0x7B},      {-65536.0f, 0xFB},       // infinity's place: saturated
      {kFloatMax, 0x7B},     {-kFloatMax, 0xFB},
      {-kNaN, 0xFF},
  };
  for (const auto& c : e5m2) EXPECT_EQ(EncodeFloat8(c.x, Float8::kE5M2), c.bits) << c.x;
}

// Between every two neighbouring finite values of a format: the midpoint goes to the code
// with the even mantissa, one float either side of it to the nearer code; with either
// sign. Past the largest finite value, every float saturates.
TEST(Float8, EveryMidpointRoundsToEvenAndItsNeighboursToTheNearer) {
  for (Float8 format : {Float8::kE4M3, Float8::kE5M2}) {
    const int largest = format == Float8::kE4M3 ? 0x7E : 0x7B;
    for (int bits = 0; bits < largest; ++bits) {
      const float low = DecodeFloat8(uint8_t(bits), format), high = DecodeFloat8(uint8_t(bits + 1), format);
      const float mid = (low + high) / 2;  // exact: a float8 value has few bits
      const uint8_t even = uint8_t(bits % 2 == 0 ? bits : bits + 1);
      for (float sign : {1.0f, -1.0f}) {
        const uint8_t s = sign < 0 ? 0x80 : 0;
        EXPECT_EQ(EncodeFloat8(sign * mid, format), even | s) << bits;
        EXPECT_EQ(EncodeFloat8(sign * std::nextafter(mid, 0.0f), format), bits | s) << bits;
        EXPECT_EQ(EncodeFloat8(sign * std::nextafter(mid, kInf), format), (bits + 1) | s) << bits;
      }
    }
    const float max = Float8Max(format);
    for (float x = std::nextafter(max, kInf); std::isfinite(x); x *= 1.5f) {
      EXPECT_EQ(EncodeFloat8(x, format), largest) << x;
      EXPECT_EQ(EncodeFloat8(-x, format), largest | 0x80) << x;
    }
  }
}

// RoundToFloat8, the products' cast on a float's bits, is DecodeFloat8(EncodeFloat8(x))
// for every float of every exponent (all 256 with both signs), with mantissas that hit
// each format's ties, the bits just either side of them and random ones: 2 x 512 x 2048.
TEST(Float8, RoundToFloat8IsEncodeThenDecode) {
  std::mt19937 rng(8);
  std::uniform_int_distribution<uint32_t> mantissa(0, (1u << 23) - 1);
  int64_t checked = 0;
  for (const Float8 format : {Float8::kE4M3, Float8::kE5M2}) {
    const uint32_t tie = format == Float8::kE4M3 ? 1u << 19 : 1u << 20;
    for (uint32_t top = 0; top < 512; ++top) {  // sign and exponent
      for (int k = 0; k < 2048; ++k) {
        uint32_t m = mantissa(rng);
        if (k < 64) m = (m & ~(2 * tie - 1)) | tie;  // exactly a tie of the format's mantissa
        if (k >= 64 && k < 128) m = ((m & ~(2 * tie - 1)) | tie) + (k % 2 ? 1 : -1);  // beside one
        if (k == 128) m = 0;
        if (k == 129) m = (1u << 23) - 1;
        const float x = std::bit_cast<float>(top << 23 | (m & ((1u << 23) - 1)));
        const float want = DecodeFloat8(EncodeFloat8(x, format), format), got = RoundToFloat8(x, format);
        if (std::isnan(want)) {
          ASSERT_TRUE(std::isnan(got)) << x;
        } else {
          ASSERT_EQ(std::bit_cast<uint32_t>(got), std::bit_cast<uint32_t>(want))
              << "x " << x << " (bits " << std::hex << std::bit_cast<uint32_t>(x) << ") in "
              << (format == Float8::kE4M3 ? "E4M3" : "E5M2") << ": " << got << " against " << want;
        }
        ++checked;
      }
    }
  }
  EXPECT_EQ(checked, 2 * 512 * 2048);
}

}  // namespace
}  // namespace meshtrain::kernels
