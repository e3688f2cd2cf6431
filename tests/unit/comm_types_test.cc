#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "worker/comm/group.h"
#include "worker/comm/types.h"
#include "worker/launch/local_launcher.h"

namespace meshtrain::comm {
namespace {

TEST(CommTypes, Bf16RoundsToNearestEven) {
  EXPECT_EQ(FloatToBf16(1.0f), 0x3f80);
  EXPECT_EQ(Bf16ToFloat(0x3f80), 1.0f);
  // 1 + 2^-8 lies halfway between 1 and 1 + 2^-7: ties go to the even mantissa (1.0).
  EXPECT_EQ(FloatToBf16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);
  EXPECT_EQ(FloatToBf16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(std::numeric_limits<float>::quiet_NaN()))));
}

TEST(CommTypes, Fp16MatchesIeeeHalf) {
  EXPECT_EQ(FloatToFp16(1.0f), 0x3c00);
  EXPECT_EQ(FloatToFp16(-2.0f), 0xc000);
  EXPECT_EQ(FloatToFp16(65504.0f), 0x7bff);
  EXPECT_EQ(FloatToFp16(70000.0f), 0x7c00);  // overflow to infinity
  EXPECT_EQ(FloatToFp16(std::ldexp(1.0f, -24)), 0x0001);  // smallest subnormal
  EXPECT_EQ(Fp16ToFloat(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(FloatToFp16(1.0f + std::ldexp(1.0f, -11)), 0x3c00);  // tie to even
  // Every finite half survives a round trip through float.
  for (uint32_t bits = 0; bits < 0x10000; ++bits) {
    uint16_t h = static_cast<uint16_t>(bits);
    if ((h & 0x7c00) == 0x7c00) continue;
    ASSERT_EQ(FloatToFp16(Fp16ToFloat(h)), h) << std::hex << bits;
  }
}

TEST(CommTypes, SumIsCommutativeBitForBitAndRoundsHalves) {
  std::mt19937 generator(7);
  std::uniform_real_distribution<float> uniform(-100.0f, 100.0f);
  for (DataType type : kAllDataTypes) {
    size_t es = ElementSize(type);
    std::vector<char> a(1000 * es), b(1000 * es), ab(1000 * es), ba(1000 * es);
    for (size_t i = 0; i < 1000; ++i) {
      float x = uniform(generator), y = uniform(generator);
      switch (type) {
        case DataType::kFloat32: reinterpret_cast<float*>(a.data())[i] = x; reinterpret_cast<float*>(b.data())[i] = y; break;
        case DataType::kBFloat16: reinterpret_cast<uint16_t*>(a.data())[i] = FloatToBf16(x); reinterpret_cast<uint16_t*>(b.data())[i] = FloatToBf16(y); break;
        case DataType::kFloat16: reinterpret_cast<uint16_t*>(a.data())[i] = FloatToFp16(x); reinterpret_cast<uint16_t*>(b.data())[i] = FloatToFp16(y); break;
        case DataType::kFloat64: reinterpret_cast<double*>(a.data())[i] = x; reinterpret_cast<double*>(b.data())[i] = y; break;
        case DataType::kInt32: reinterpret_cast<int32_t*>(a.data())[i] = static_cast<int32_t>(x * 1000); reinterpret_cast<int32_t*>(b.data())[i] = static_cast<int32_t>(y * 1000); break;
        case DataType::kInt64: reinterpret_cast<int64_t*>(a.data())[i] = static_cast<int64_t>(x * 1e9); reinterpret_cast<int64_t*>(b.data())[i] = static_cast<int64_t>(y * 1e9); break;
      }
    }
    Sum(ab.data(), a.data(), b.data(), 1000, type);
    Sum(ba.data(), b.data(), a.data(), 1000, type);
    EXPECT_EQ(std::memcmp(ab.data(), ba.data(), ab.size()), 0) << DataTypeName(type);
  }
  uint16_t x = FloatToBf16(1.0f), y = FloatToBf16(std::ldexp(1.0f, -9)), out;
  Sum(&out, &x, &y, 1, DataType::kBFloat16);
  EXPECT_EQ(out, x);  // 1 + 2^-9 rounds back to 1 in bf16
  int32_t values[3] = {7, -7, 9};
  DivideBy(values, 3, DataType::kInt32, 2);
  EXPECT_EQ(values[0], 3);
  EXPECT_EQ(values[1], -3);  // truncates toward zero
}

TEST(CommGroup, WorldFromRankTableKnowsNodes) {
  Group world = Group::World(launch::VirtualRankTable(3, 2), 3);
  EXPECT_EQ(world.size(), 6);
  EXPECT_EQ(world.rank(), 3);
  EXPECT_EQ(world.NodeCount(), 3);
  EXPECT_TRUE(world.IsNodeMajor());
  EXPECT_EQ(world.PerNode(), 2);
  EXPECT_TRUE(world.SameNode(2, 3));
  EXPECT_FALSE(world.SameNode(1, 2));
  EXPECT_EQ(world.Describe(), "world (6 ranks on 3 nodes)");
}

TEST(CommGroup, SubgroupsKeepNodesAndDetectShape) {
  Group world = Group::World(launch::VirtualRankTable(2, 4), 5);
  Group shard = world.Subgroup("shard", {1, 3, 5, 7});  // two per node, node-major
  EXPECT_EQ(shard.rank(), 2);
  EXPECT_EQ(shard.GlobalRank(3), 7);
  EXPECT_TRUE(shard.IsNodeMajor());
  EXPECT_EQ(shard.NodeCount(), 2);
  Group uneven = world.Subgroup("uneven", {0, 4, 5});  // 1 on node 0, 2 on node 1
  EXPECT_FALSE(uneven.IsNodeMajor());
  Group rail = world.Subgroup("rail", {1, 5});  // one per node
  EXPECT_TRUE(rail.IsNodeMajor());
  EXPECT_EQ(rail.PerNode(), 1);
  EXPECT_THROW(world.Subgroup("bad", {3, 1}), std::invalid_argument);
  EXPECT_THROW(world.Subgroup("without me", {0, 1}), std::invalid_argument);
  EXPECT_THROW(Group::World(launch::VirtualRankTable(2, 2), 4), std::invalid_argument);
}

}  // namespace
}  // namespace meshtrain::comm
