// Attention by blocks on the CPU's tables (kernels/ops.h, "Attention by blocks"): each
// table against the Fp64 reference, the ring's blocks against whole-sequence attention
// (tests/support/attention_blocks_conformance.h), finite differences of the Fp64
// backward, and the shapes the operations refuse.

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "tests/support/attention_blocks_conformance.h"
#include "tests/support/cpu_tables.h"

namespace meshtrain::testing {

// This binary runs the block suite only; OpsConformance, whose fixture it builds on, is
// instantiated by the tables' own binaries.
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(OpsConformance);

namespace attention_blocks_test {

INSTANTIATE_TYPED_TEST_SUITE_P(Cpu, AttentionBlocksConformance, CpuTables);

using kernels::AttentionBlock;
using kernels::AttentionMask;
using kernels::Fp64;

class AttentionBlocksFp64 : public ::testing::Test {
 protected:
  void SetUp() override {
    side_.backend = std::make_unique<runtime::CpuBackend>();
    side_.allocator = std::make_unique<runtime::CachingAllocator>(&side_.accounting, side_.backend->DeviceMemory());
    side_.stream = side_.backend->NewStream("fp64");
    side_.ops = kernels::MakeCpuOps<Fp64>();
  }
  void TearDown() override { side_.stream->Synchronize(); }

  std::vector<double> Random(int64_t n) {
    std::normal_distribution<double> normal(0.0, 1.0);
    std::vector<double> values(static_cast<size_t>(n));
    for (double& v : values) v = normal(rng_);
    return values;
  }

  std::mt19937_64 rng_{20261201};
  OpsSide<Fp64> side_;
};

// The loss sum(w * out) of one block (the whole result: its lse and D are the final
// ones), its gradient by AttentionBlockBackward against central differences in every
// element of q, k and v, with grouped heads, for both masks.
TEST_F(AttentionBlocksFp64, BackwardMatchesFiniteDifferences) {
  struct Case {
    int Tq, Tk;
    AttentionMask mask;
  };
  const int B = 2, NH = 4, KVH = 2, HS = 8;
  const int64_t Q = int64_t(NH) * HS, KH = int64_t(KVH) * HS;
  for (const Case c : {Case{3, 5, AttentionMask::kNone}, Case{4, 4, AttentionMask::kCausal}}) {
    const AttentionBlock shape = AttentionBlock::Contiguous(B, c.Tq, c.Tk, NH, KVH, HS, c.mask);
    const std::string at = c.mask == AttentionMask::kNone ? " (kNone)" : " (kCausal)";
    std::vector<double> inputs[3] = {Random(B * c.Tq * Q), Random(B * c.Tk * KH), Random(B * c.Tk * KH)};
    const auto w = Random(B * c.Tq * Q);
    auto loss = [&] {
      auto out = side_.Poisoned<double>(B * c.Tq * Q), lse = side_.Poisoned<double>(B * NH * c.Tq);
      side_.ops->AttentionBlockForward(out, lse, side_.Put<double>(inputs[0]), side_.Put<double>(inputs[1]),
                                       side_.Put<double>(inputs[2]), shape, *side_.stream);
      const auto o = side_.Get(out, B * c.Tq * Q);
      double sum = 0;
      for (size_t i = 0; i < o.size(); ++i) sum += w[i] * o[i];
      side_.keep.clear();
      return sum;
    };
    // The analytic gradient.
    auto q = side_.Put<double>(inputs[0]), k = side_.Put<double>(inputs[1]), v = side_.Put<double>(inputs[2]);
    auto out = side_.Poisoned<double>(B * c.Tq * Q), lse = side_.Poisoned<double>(B * NH * c.Tq);
    auto D = side_.Poisoned<double>(B * NH * c.Tq), dout = side_.Put<double>(w);
    side_.ops->AttentionBlockForward(out, lse, q, k, v, shape, *side_.stream);
    side_.ops->AttentionRowDot(D, dout, out, shape, *side_.stream);
    auto dq = side_.Put<double>(std::vector<double>(size_t(B * c.Tq * Q), 0.0));
    auto dk = side_.Put<double>(std::vector<double>(size_t(B * c.Tk * KH), 0.0));
    auto dv = side_.Put<double>(std::vector<double>(size_t(B * c.Tk * KH), 0.0));
    side_.ops->AttentionBlockBackward(dq, dk, dv, dout, q, k, v, lse, D, shape, *side_.stream);
    const std::vector<double> analytic[3] = {side_.Get(dq, B * c.Tq * Q), side_.Get(dk, B * c.Tk * KH),
                                             side_.Get(dv, B * c.Tk * KH)};
    side_.keep.clear();
    const char* names[3] = {"dq", "dk", "dv"};
    constexpr double kStep = 1e-5;
    for (int which = 0; which < 3; ++which) {
      double diff = 0, norm = 0;
      for (size_t i = 0; i < inputs[which].size(); ++i) {
        const double x = inputs[which][i];
        inputs[which][i] = x + kStep;
        const double up = loss();
        inputs[which][i] = x - kStep;
        const double down = loss();
        inputs[which][i] = x;
        const double numeric = (up - down) / (2 * kStep);
        diff += (numeric - analytic[which][i]) * (numeric - analytic[which][i]);
        norm += numeric * numeric;
      }
      ASSERT_GT(norm, 0) << names[which] << at;
      EXPECT_LE(std::sqrt(diff / norm), 1e-7) << names[which] << at << ": relative L2 error against central differences";
    }
  }
}

// Merging is exact and symmetric: two halves of the keys merged in either order give
// the block over all of them.
TEST_F(AttentionBlocksFp64, MergeOfHalvesIsTheWholeBlock) {
  const int B = 2, Tq = 5, Tk = 9, split = 4, NH = 4, KVH = 2, HS = 8;
  const int64_t Q = int64_t(NH) * HS, KH = int64_t(KVH) * HS;
  const auto q = Random(B * Tq * Q), k = Random(B * Tk * KH), v = Random(B * Tk * KH);
  auto in_q = side_.Put<double>(q), in_k = side_.Put<double>(k), in_v = side_.Put<double>(v);
  AttentionBlock whole = AttentionBlock::Contiguous(B, Tq, Tk, NH, KVH, HS, AttentionMask::kNone);
  auto out = side_.Poisoned<double>(B * Tq * Q), lse = side_.Poisoned<double>(B * NH * Tq);
  side_.ops->AttentionBlockForward(out, lse, in_q, in_k, in_v, whole, *side_.stream);
  const auto want_out = side_.Get(out, B * Tq * Q), want_lse = side_.Get(lse, B * NH * Tq);
  for (bool first_half_first : {true, false}) {
    // Each half: its keys' rows inside k and v (batch stride of the whole).
    AttentionBlock half[2] = {whole, whole};
    half[0].Tk = split;
    half[1].Tk = Tk - split;
    auto outs = side_.Poisoned<double>(2 * B * Tq * Q), lses = side_.Poisoned<double>(2 * B * NH * Tq);
    for (int h = 0; h < 2; ++h) {
      const int64_t key_row = h == 0 ? 0 : split;
      side_.ops->AttentionBlockForward(outs + h * B * Tq * Q, lses + h * B * NH * Tq, in_q, in_k + key_row * KH,
                                       in_v + key_row * KH, half[h], *side_.stream);
    }
    const int into = first_half_first ? 0 : 1;
    side_.ops->AttentionMerge(outs + into * B * Tq * Q, lses + into * B * NH * Tq, outs + (1 - into) * B * Tq * Q,
                              lses + (1 - into) * B * NH * Tq, whole, *side_.stream);
    const auto got_out = side_.Get(outs + into * B * Tq * Q, B * Tq * Q);
    const auto got_lse = side_.Get(lses + into * B * NH * Tq, B * NH * Tq);
    for (size_t i = 0; i < got_out.size(); ++i) ASSERT_NEAR(got_out[i], want_out[i], 1e-13) << "out " << i;
    for (size_t i = 0; i < got_lse.size(); ++i) ASSERT_NEAR(got_lse[i], want_lse[i], 1e-13) << "lse " << i;
  }
}

// The contract's shapes: heads that do not make groups, and a causal block that is not
// square, are refused when the call is made, on every table.
TEST(AttentionBlocks, RefusesBrokenShapes) {
  runtime::CpuBackend backend;
  const auto stream = backend.NewStream("refusals");
  const auto ops = kernels::MakeCpuOps<kernels::Fp32>();
  const AttentionBlock square = AttentionBlock::Contiguous(1, 4, 4, 4, 2, 8, AttentionMask::kCausal);
  AttentionBlock not_square = square;
  not_square.Tk = 5;
  AttentionBlock ungrouped = square;
  ungrouped.KVH = 3;
  for (const AttentionBlock& shape : {not_square, ungrouped}) {
    EXPECT_THROW(ops->AttentionBlockForward(nullptr, nullptr, nullptr, nullptr, nullptr, shape, *stream),
                 std::invalid_argument);
    EXPECT_THROW(ops->AttentionMerge(nullptr, nullptr, nullptr, nullptr, shape, *stream), std::invalid_argument);
    EXPECT_THROW(ops->AttentionRowDot(nullptr, nullptr, nullptr, shape, *stream), std::invalid_argument);
    EXPECT_THROW(ops->AttentionBlockBackward(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                                             nullptr, shape, *stream),
                 std::invalid_argument);
  }
  stream->Synchronize();
}

}  // namespace attention_blocks_test
}  // namespace meshtrain::testing
