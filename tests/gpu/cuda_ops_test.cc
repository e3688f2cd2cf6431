// The GPU's kernel table (kernels/cuda/cuda_ops.h) against the CPU's Fp64 table: the
// shared conformance suites (tests/support/ops_conformance.h and, for the mixture of
// experts, moe_conformance.h), once with cuDNN's fused
// attention and once with attention on the scores path, and then what the suite does not
// see: the unfused forms of cuBLASLt's epilogues, the fused and scores paths on the same
// inputs (with grouped key/value heads too), a head size cuDNN refuses, wide rows, many
// segments, and bit-for-bit repeats of the reductions that must not depend on timing
// (LayerNorm's and RMSNorm's dweight among them).
//
// Tolerances are relative L2 errors against float64. Inputs are drawn and rounded to
// bf16 first, so both sides see the same numbers; what remains is the GPU's bf16 storage
// of outputs and intermediates (8 significant bits, a relative 2^-9 = 2e-3 per rounding),
// which lands between 1e-3 and 1e-2, and fp32 accumulation, far below that.

#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "tests/support/gpu.h"
#include "tests/support/moe_conformance.h"
#include "tests/support/ops_conformance.h"
#include "worker/kernels/cuda/cuda_ops.h"
#include "worker/kernels/cuda/grouped_gemm.h"
#include "worker/runtime/cuda.h"

namespace meshtrain::testing {
namespace {

using kernels::AttentionKind;
using kernels::Bf16;
using kernels::Fp64;

template <bool kFused>
struct CudaTable {
  using Precision = Bf16;
  static bool Available() { return HaveGpu(); }
  static const char* Unavailable() { return "skipped: no GPU"; }
  static std::unique_ptr<runtime::Backend> MakeBackend() { return runtime::cuda::MakeCudaBackend(0); }
  static std::unique_ptr<kernels::Ops<Bf16>> MakeOps(runtime::Backend& backend, runtime::CachingAllocator* allocator) {
    return kernels::cuda::MakeCudaOpsWith(backend, allocator, {.fused_attention = kFused});
  }
  // bf16 storage of every Act value: outputs within a few 1e-3 of fp64 (see above).
  static constexpr double kTolerance = 1e-2;
};

using CudaTables = ::testing::Types<CudaTable<true>, CudaTable<false>>;
INSTANTIATE_TYPED_TEST_SUITE_P(Cuda, OpsConformance, CudaTables);
INSTANTIATE_TYPED_TEST_SUITE_P(Cuda, MoeConformance, CudaTables);

// --- Focused tests ---

template <class P>
void Open(OpsSide<P>& side, std::unique_ptr<runtime::Backend> backend, const char* stream) {
  side.backend = std::move(backend);
  side.allocator = std::make_unique<runtime::CachingAllocator>(&side.accounting, side.backend->DeviceMemory());
  side.stream = side.backend->NewStream(stream);
}

class CudaOps : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!HaveGpu()) return;  // each test skips, saying so
    Open(gpu_, runtime::cuda::MakeCudaBackend(0), "gpu");
    gpu_.ops = kernels::cuda::MakeCudaOps(*gpu_.backend, gpu_.allocator.get());
    Open(ref_, std::make_unique<runtime::CpuBackend>(), "reference");
    ref_.ops = kernels::MakeCpuOps<Fp64>();
  }
  void TearDown() override {
    if (gpu_.stream) gpu_.stream->Synchronize();
  }

  // n draws of scale times a standard normal, as bf16 stores them; never zero.
  std::vector<double> Random(int64_t n, double scale = 1.0) {
    std::normal_distribution<double> normal(0.0, scale);
    std::vector<double> values(static_cast<size_t>(n));
    for (double& v : values) {
      do v = double(float(runtime::bf16(float(normal(rng_)))));
      while (v == 0.0);
    }
    return values;
  }
  // As Random, in fp32 (parameter gradients, master weights).
  std::vector<double> RandomFloat(int64_t n, double scale = 1.0) {
    std::normal_distribution<double> normal(0.0, scale);
    std::vector<double> values(static_cast<size_t>(n));
    for (double& v : values) {
      do v = double(float(normal(rng_)));
      while (v == 0.0);
    }
    return values;
  }
  std::vector<double> Tokens(int64_t n, int32_t below) {
    std::uniform_int_distribution<int32_t> pick(0, below - 1);
    std::vector<double> tokens(static_cast<size_t>(n));
    for (double& t : tokens) t = pick(rng_);
    return tokens;
  }

  static double RelativeL2(const std::vector<double>& got, const std::vector<double>& want) {
    double diff = 0, norm = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      diff += (got[i] - want[i]) * (got[i] - want[i]);
      norm += want[i] * want[i];
    }
    return std::sqrt(diff / norm);
  }
  // Every element written (no NaN from the poison) and within `tolerance`.
  static void ExpectClose(const std::vector<double>& got, const std::vector<double>& want, const std::string& what,
                          double tolerance) {
    ASSERT_EQ(got.size(), want.size()) << what;
    for (size_t i = 0; i < got.size(); ++i) ASSERT_FALSE(std::isnan(got[i])) << what << ": element " << i << " unwritten";
    const double error = RelativeL2(got, want);
    EXPECT_LE(error, tolerance) << what << ": relative L2 error " << error;
  }

  // Prints the mean time of `body` over 10 runs, after one to warm up.
  template <class Body>
  void Time(const char* name, Body body) {
    body();
    gpu_.stream->Synchronize();
    constexpr int kRepeats = 10;
    const auto start = std::chrono::steady_clock::now();
    for (int r = 0; r < kRepeats; ++r) body();
    gpu_.stream->Synchronize();
    const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count() / kRepeats;
    std::printf("%-44s %9.1f us\n", name, us);
  }

  std::mt19937_64 rng_{20261125};
  OpsSide<Bf16> gpu_;
  OpsSide<Fp64> ref_;
};

// Shapes cuBLASLt's epilogues take (leading dimensions of the GELU input divisible by 8)
// and shapes they do not (OC 1001, K 99), where the table multiplies plainly and adds the
// bias, GELU and its gradient in its own kernels; and every shape again through a table
// that never takes the epilogues: all against fp64.
TEST_F(CudaOps, MatmulEpiloguesFusedAndUnfused) {
  MESHTRAIN_SKIP_WITHOUT_GPU();
  OpsSide<Bf16> unfused;
  Open(unfused, runtime::cuda::MakeCudaBackend(0), "unfused");
  unfused.ops = kernels::cuda::MakeCudaOpsWith(*unfused.backend, unfused.allocator.get(), {.fused_epilogues = false});
  struct Case {
    int64_t N;
    int K, OC;
    bool bias, gelu, residual;
  };
  for (const Case c : {Case{64, 96, 384, true, true, false}, Case{64, 96, 384, false, true, false},
                       Case{37, 99, 1001, true, true, false}, Case{37, 100, 1000, false, true, false},
                       Case{37, 99, 1001, true, false, false}, Case{512, 768, 50304, false, false, false},
                       Case{64, 3072, 768, true, false, true}, Case{37, 99, 1001, true, false, true}}) {
    const auto x = Random(c.N * c.K), w = Random(int64_t(c.OC) * c.K, 0.05), b = Random(c.OC), r = Random(c.N * c.OC);
    const auto dout = Random(c.N * c.OC), in_pre = Random(c.N * c.K), dw0 = RandomFloat(int64_t(c.OC) * c.K),
               db0 = RandomFloat(c.OC);
    auto ref_out = ref_.Poisoned<double>(c.N * c.OC);
    auto ref_pre = c.gelu ? ref_.Poisoned<double>(c.N * c.OC) : nullptr;
    ref_.ops->MatmulForward(ref_out, ref_pre, ref_.Put<double>(x), ref_.Put<double>(w),
                            c.bias ? ref_.Put<double>(b) : nullptr, c.residual ? ref_.Put<double>(r) : nullptr, c.N,
                            c.K, c.OC, *ref_.stream);
    auto ref_dinp = ref_.Poisoned<double>(c.N * c.K);
    auto ref_dw = ref_.Put<double>(dw0), ref_db = ref_.Put<double>(db0);
    ref_.ops->MatmulBackward(ref_dinp, ref_dw, c.bias ? ref_db : nullptr, ref_.Put<double>(dout), ref_.Put<double>(x),
                             ref_.Put<double>(w), c.gelu ? ref_.Put<double>(in_pre) : nullptr, c.N, c.K, c.OC,
                             *ref_.stream);
    for (OpsSide<Bf16>* side : {&gpu_, &unfused}) {
      const std::string at = std::string(side == &gpu_ ? " (table" : " (unfused") + ", N " + std::to_string(c.N) +
                             ", K " + std::to_string(c.K) + ", OC " + std::to_string(c.OC) + (c.bias ? ", bias" : "") +
                             (c.gelu ? ", gelu" : "") + (c.residual ? ", residual" : "") + ")";
      auto out = side->Poisoned<runtime::bf16>(c.N * c.OC);
      auto pre = c.gelu ? side->Poisoned<runtime::bf16>(c.N * c.OC) : nullptr;
      side->ops->MatmulForward(out, pre, side->Put<runtime::bf16>(x), side->Put<runtime::bf16>(w),
                               c.bias ? side->Put<runtime::bf16>(b) : nullptr,
                               c.residual ? side->Put<runtime::bf16>(r) : nullptr, c.N, c.K, c.OC, *side->stream);
      // bf16 outputs of fp32 sums of bf16 products: a few 1e-3.
      ExpectClose(side->Get(out, c.N * c.OC), ref_.Get(ref_out, c.N * c.OC), "MatmulForward out" + at, 1e-2);
      if (c.gelu) ExpectClose(side->Get(pre, c.N * c.OC), ref_.Get(ref_pre, c.N * c.OC), "gelu_pre" + at, 1e-2);

      auto dinp = side->Poisoned<runtime::bf16>(c.N * c.K);
      auto dw = side->Put<float>(dw0), db = side->Put<float>(db0);
      side->ops->MatmulBackward(dinp, dw, c.bias ? db : nullptr, side->Put<runtime::bf16>(dout),
                                side->Put<runtime::bf16>(x), side->Put<runtime::bf16>(w),
                                c.gelu ? side->Put<runtime::bf16>(in_pre) : nullptr, c.N, c.K, c.OC, *side->stream);
      ExpectClose(side->Get(dinp, c.N * c.K), ref_.Get(ref_dinp, c.N * c.K), "MatmulBackward dinp" + at, 1e-2);
      // fp32 accumulation of exact bf16 products into fp32: far below 1e-3.
      ExpectClose(side->Get(dw, int64_t(c.OC) * c.K), ref_.Get(ref_dw, int64_t(c.OC) * c.K), "dweight (+=)" + at, 1e-3);
      if (c.bias) ExpectClose(side->Get(db, c.OC), ref_.Get(ref_db, c.OC), "dbias (+=)" + at, 1e-5);
      side->keep.clear();
    }
  }
}

// The bias gradient in dweight's product (cuBLASLt's BGRADB) and in the table's own
// column sums, at GPT-2 124M's four products of a micro-batch of 16 x 1024 and at odd
// shapes, through three tables: as built (BGRADB where it fills the device), BGRADB
// wherever cuBLASLt has it, and no epilogues. dbias against the column sums in float64 on
// the host, dweight against the table without epilogues, each table's dbias again bit for
// bit; and cuBLASLt has BGRADB for GPT-2's products.
TEST_F(CudaOps, BiasGradientInTheProductMatchesTheColumnSums) {
  MESHTRAIN_SKIP_WITHOUT_GPU();
  int64_t as_built = 0, wherever = 0;
  OpsSide<Bf16> sides[3];
  const char* names[3] = {"as built", "BGRADB wherever possible", "no epilogues"};
  const kernels::cuda::CudaOpsOptions options[3] = {
      {.bias_gradients_in_product = &as_built},
      {.bias_gradient_wherever_possible = true, .bias_gradients_in_product = &wherever},
      {.fused_epilogues = false}};
  for (int t = 0; t < 3; ++t) {
    Open(sides[t], runtime::cuda::MakeCudaBackend(0), names[t]);
    sides[t].ops = kernels::cuda::MakeCudaOpsWith(*sides[t].backend, sides[t].allocator.get(), options[t]);
  }
  struct Case {
    int64_t N;
    int K, OC;
  };
  const Case gpt2[] = {{16384, 768, 2304}, {16384, 768, 768}, {16384, 768, 3072}, {16384, 3072, 768}};
  const Case odd[] = {{37, 99, 1001}, {1000, 64, 96}};
  auto check = [&](const Case& c) {
    const std::string shape =
        "N " + std::to_string(c.N) + ", K " + std::to_string(c.K) + ", OC " + std::to_string(c.OC);
    const auto x = Random(c.N * c.K), w = Random(int64_t(c.OC) * c.K, 0.05), dout = Random(c.N * c.OC);
    const auto dw0 = RandomFloat(int64_t(c.OC) * c.K), db0 = RandomFloat(c.OC);
    std::vector<double> want_db = db0;
    for (int64_t row = 0; row < c.N; ++row)
      for (int col = 0; col < c.OC; ++col) want_db[size_t(col)] += dout[size_t(row * c.OC + col)];
    std::vector<double> dws[3];
    for (int t = 2; t >= 0; --t) {
      OpsSide<Bf16>& side = sides[t];
      const std::string at = std::string(" (") + names[t] + ", " + shape + ")";
      auto device_x = side.Put<runtime::bf16>(x), device_w = side.Put<runtime::bf16>(w);
      auto device_dout = side.Put<runtime::bf16>(dout);
      std::vector<double> dbs[2];
      for (int repeat = 0; repeat < 2; ++repeat) {
        auto dw = side.Put<float>(dw0), db = side.Put<float>(db0);
        side.ops->MatmulBackward(nullptr, dw, db, device_dout, device_x, device_w, nullptr, c.N, c.K, c.OC,
                                 *side.stream);
        dws[t] = side.Get(dw, int64_t(c.OC) * c.K);
        dbs[repeat] = side.Get(db, c.OC);
      }
      // fp32 sums of exact bf16 values, in different orders: a few 1e-7 of the sums.
      ExpectClose(dbs[0], want_db, "dbias (+=)" + at, 1e-5);
      EXPECT_EQ(dbs[1], dbs[0]) << "dbias, repeated" << at;
      if (t != 2) ExpectClose(dws[t], dws[2], "dweight (+=), against no epilogues" + at, 1e-5);
      side.keep.clear();
    }
  };
  for (const Case& c : gpt2) check(c);
  std::printf("BGRADB summed the bias gradient in %lld of %zu calls of GPT-2's products as built, in %lld wherever "
              "possible\n", static_cast<long long>(as_built), 2 * std::size(gpt2), static_cast<long long>(wherever));
  EXPECT_GT(wherever, 0) << "cuBLASLt offered BGRADB for none of GPT-2's products (bf16 A and B, fp32 D and bias)";
  for (const Case& c : odd) check(c);
}

// The fused (cuDNN) and scores paths on the same inputs agree with each other, and cuDNN
// takes on this GPU the head sizes GPT-2 uses and the grouped key/value heads of the
// Llama class (4 query heads a group at 8B's head size, and one key/value head), each
// path reading K and V where they lie in qkv; dq, dk and dv are compared apart, so a
// group's sum that one path gets wrong shows as itself.
TEST_F(CudaOps, FusedAttentionMatchesTheScoresPath) {
  MESHTRAIN_SKIP_WITHOUT_GPU();
  OpsSide<Bf16> scores;
  Open(scores, runtime::cuda::MakeCudaBackend(0), "scores");
  scores.ops = kernels::cuda::MakeCudaOpsWith(*scores.backend, scores.allocator.get(), {.fused_attention = false});
  int major = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0), cudaSuccess);
  struct Case {
    int B, T, NH, KVH, HS;
  };
  for (const Case c : {Case{2, 37, 2, 2, 64}, Case{1, 200, 2, 2, 128}, Case{4, 1024, 12, 12, 64},
                       Case{2, 37, 4, 2, 64}, Case{1, 200, 8, 1, 128}, Case{2, 1024, 32, 8, 128},
                       Case{1, 300, 6, 3, 32}}) {
    const int64_t rows = int64_t(c.B) * c.T, width = int64_t(c.NH + 2 * c.KVH) * c.HS, Q = int64_t(c.NH) * c.HS;
    const std::string at = " (B " + std::to_string(c.B) + ", T " + std::to_string(c.T) + ", " + std::to_string(c.NH) +
                           " query heads and " + std::to_string(c.KVH) + " key/value heads of " + std::to_string(c.HS) +
                           ")";
    const AttentionKind kind = gpu_.ops->Attention(c.B, c.T, c.NH, c.KVH, c.HS);
    if (major >= 8) {
      EXPECT_EQ(kind, AttentionKind::kFused) << "cuDNN refused" << at << " (see stderr)";
    }
    EXPECT_EQ(scores.ops->Attention(c.B, c.T, c.NH, c.KVH, c.HS), AttentionKind::kScores);
    EXPECT_EQ(gpu_.ops->AttentionStateElements(c.B, c.T, c.NH, c.KVH, c.HS),
              kind == AttentionKind::kFused ? rows * c.NH : rows * c.NH * c.T);
    const auto qkv = Random(rows * width), dout = Random(rows * Q);
    std::vector<double> outs[2], grads[2];
    for (int path = 0; path < 2; ++path) {
      OpsSide<Bf16>& side = path == 0 ? gpu_ : scores;
      auto out = side.Poisoned<runtime::bf16>(rows * Q);
      auto state = side.Poisoned<float>(side.ops->AttentionStateElements(c.B, c.T, c.NH, c.KVH, c.HS));
      auto scratch = side.Poisoned<std::byte>(side.ops->AttentionScratchBytes(c.B, c.T, c.NH, c.KVH, c.HS));
      auto dqkv = side.Poisoned<runtime::bf16>(rows * width);
      auto device_qkv = side.Put<runtime::bf16>(qkv);
      side.ops->AttentionForward(out, state, device_qkv, c.B, c.T, c.NH, c.KVH, c.HS, *side.stream);
      side.ops->AttentionBackward(dqkv, scratch, side.Put<runtime::bf16>(dout), device_qkv, out, state, c.B, c.T, c.NH,
                                  c.KVH, c.HS, *side.stream);
      outs[path] = side.Get(out, rows * Q);
      grads[path] = side.Get(dqkv, rows * width);
      EXPECT_TRUE(side.Get(device_qkv, rows * width) == qkv) << "attention wrote into qkv" << at;
      side.keep.clear();
    }
    // Two bf16 computations with different roundings (flash attention's P in bf16 per
    // tile, the scores path's P stored in bf16): each within a few 1e-3 of the truth.
    ExpectClose(outs[0], outs[1], "AttentionForward, fused against scores" + at, 1e-2);
    const char* parts[3] = {"dq", "dk", "dv"};
    for (int part = 0; part < 3; ++part) {
      const int64_t begin = part == 0 ? 0 : Q + (part - 1) * int64_t(c.KVH) * c.HS;
      const int64_t end = part == 0 ? Q : begin + int64_t(c.KVH) * c.HS;
      std::vector<double> fused, plain;
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t i = begin; i < end; ++i) {
          fused.push_back(grads[0][size_t(r * width + i)]);
          plain.push_back(grads[1][size_t(r * width + i)]);
        }
      }
      ExpectClose(fused, plain, std::string("AttentionBackward ") + parts[part] + ", fused against scores" + at, 2e-2);
    }
  }
}

// A head size cuDNN has no kernel for, with groups of three query heads: the scores path,
// said once, and right against fp64.
TEST_F(CudaOps, OddHeadSizeTakesTheScoresPath) {
  MESHTRAIN_SKIP_WITHOUT_GPU();
  const int B = 2, T = 37, NH = 6, KVH = 2, HS = 20;
  const int64_t width = int64_t(NH + 2 * KVH) * HS, Q = int64_t(NH) * HS;
  ASSERT_EQ(gpu_.ops->Attention(B, T, NH, KVH, HS), AttentionKind::kScores);
  const int64_t rows = int64_t(B) * T;
  EXPECT_EQ(gpu_.ops->AttentionStateElements(B, T, NH, KVH, HS), rows * NH * T);
  const auto qkv = Random(rows * width), dout = Random(rows * Q);
  auto out = gpu_.Poisoned<runtime::bf16>(rows * Q);
  auto state = gpu_.Poisoned<float>(gpu_.ops->AttentionStateElements(B, T, NH, KVH, HS));
  auto scratch = gpu_.Poisoned<std::byte>(gpu_.ops->AttentionScratchBytes(B, T, NH, KVH, HS));
  auto dqkv = gpu_.Poisoned<runtime::bf16>(rows * width);
  auto device_qkv = gpu_.Put<runtime::bf16>(qkv);
  gpu_.ops->AttentionForward(out, state, device_qkv, B, T, NH, KVH, HS, *gpu_.stream);
  gpu_.ops->AttentionBackward(dqkv, scratch, gpu_.Put<runtime::bf16>(dout), device_qkv, out, state, B, T, NH, KVH, HS,
                              *gpu_.stream);
  auto ref_out = ref_.Poisoned<double>(rows * Q);
  auto ref_state = ref_.Poisoned<double>(rows * NH * T);
  auto ref_dqkv = ref_.Poisoned<double>(rows * width);
  auto ref_qkv = ref_.Put<double>(qkv);
  ref_.ops->AttentionForward(ref_out, ref_state, ref_qkv, B, T, NH, KVH, HS, *ref_.stream);
  ref_.ops->AttentionBackward(ref_dqkv, nullptr, ref_.Put<double>(dout), ref_qkv, ref_out, ref_state, B, T, NH, KVH,
                              HS, *ref_.stream);
  // bf16 outputs over fp32 probabilities and bf16 P for the products.
  ExpectClose(gpu_.Get(out, rows * Q), ref_.Get(ref_out, rows * Q), "AttentionForward, HS 20", 1e-2);
  ExpectClose(gpu_.Get(dqkv, rows * width), ref_.Get(ref_dqkv, rows * width), "AttentionBackward, HS 20", 1e-2);
  // The probabilities are the state: fp32 from fp32 scores of bf16 operands.
  ExpectClose(gpu_.Get(state, rows * NH * T), ref_.Get(ref_state, rows * NH * T), "attention probabilities", 1e-5);
}

// Many rows share a few tokens (and some fall outside the slice): dwte and dwpe are sums
// in row order, the same bits on every run, and fp32-close to fp64.
TEST_F(CudaOps, EncoderBackwardRepeatsBitForBit) {
  MESHTRAIN_SKIP_WITHOUT_GPU();
  for (const int C : {768, 100}) {  // 128-bit and element-wise paths
    const int B = 4, T = 256;
    const int64_t v_begin = 2, v_rows = 5, Vp = 8;
    const auto tokens = Tokens(B * T, 9), dout = Random(int64_t(B) * T * C), dwte0 = RandomFloat(Vp * C),
               dwpe0 = RandomFloat(int64_t(T) * C);
    std::vector<double> runs[2][2];
    for (int run = 0; run < 2; ++run) {
      auto dwte = gpu_.Put<float>(dwte0), dwpe = gpu_.Put<float>(dwpe0);
      gpu_.ops->EncoderBackward(dwte, dwpe, gpu_.Put<runtime::bf16>(dout), gpu_.Put<int32_t>(tokens), B, T, C, v_begin,
                                v_rows, *gpu_.stream);
      runs[run][0] = gpu_.Get(dwte, Vp * C);
      runs[run][1] = gpu_.Get(dwpe, int64_t(T) * C);
    }
    EXPECT_EQ(runs[0][0], runs[1][0]) << "dwte differs between runs, C " << C;
    EXPECT_EQ(runs[0][1], runs[1][1]) << "dwpe differs between runs, C " << C;
    auto ref_dwte = ref_.Put<double>(dwte0), ref_dwpe = ref_.Put<double>(dwpe0);
    ref_.ops->EncoderBackward(ref_dwte, ref_dwpe, ref_.Put<double>(dout), ref_.Put<int32_t>(tokens), B, T, C, v_begin,
                              v_rows, *ref_.stream);
    // fp32 sums of a few hundred exact bf16 terms.
    ExpectClose(runs[0][0], ref_.Get(ref_dwte, Vp * C), "EncoderBackward dwte, C " + std::to_string(C), 1e-5);
    ExpectClose(runs[0][1], ref_.Get(ref_dwpe, int64_t(T) * C), "EncoderBackward dwpe, C " + std::to_string(C), 1e-5);
    for (int64_t i = v_rows * C; i < Vp * C; ++i) ASSERT_EQ(runs[0][0][size_t(i)], dwte0[size_t(i)]) << "padding row";
  }
}

// Rows wider than 48 KiB of per-warp partial sums (one warp a block, opted-in shared
// memory), an odd width (element-wise path), and the limit.
TEST_F(CudaOps, LayerNormBackwardWideRowsRepeatBitForBit) {
  MESHTRAIN_SKIP_WITHOUT_GPU();
  for (const int C : {8192, 1600, 333}) {
    const int64_t N = 300;
    const std::string at = " (C " + std::to_string(C) + ")";
    const auto x = Random(N * C, 2.0), w = Random(C), dout = Random(N * C), dinp0 = Random(N * C),
               dw0 = RandomFloat(C), db0 = RandomFloat(C);
    auto mean = gpu_.Poisoned<float>(N), rstd = gpu_.Poisoned<float>(N);
    auto out = gpu_.Poisoned<runtime::bf16>(N * C);
    gpu_.ops->LayerNormForward(out, mean, rstd, gpu_.Put<runtime::bf16>(x), gpu_.Put<runtime::bf16>(w),
                               gpu_.Put<runtime::bf16>(w), N, C, *gpu_.stream);
    const auto m = gpu_.Get(mean, N), s = gpu_.Get(rstd, N);
    std::vector<double> runs[2][3];
    for (int run = 0; run < 2; ++run) {
      auto dinp = gpu_.Put<runtime::bf16>(dinp0);
      auto dw = gpu_.Put<float>(dw0), db = gpu_.Put<float>(db0);
      gpu_.ops->LayerNormBackward(dinp, dw, db, gpu_.Put<runtime::bf16>(dout), gpu_.Put<runtime::bf16>(x),
                                  gpu_.Put<runtime::bf16>(w), gpu_.Put<float>(m), gpu_.Put<float>(s), N, C,
                                  *gpu_.stream);
      runs[run][0] = gpu_.Get(dinp, N * C);
      runs[run][1] = gpu_.Get(dw, C);
      runs[run][2] = gpu_.Get(db, C);
    }
    EXPECT_EQ(runs[0][1], runs[1][1]) << "dweight differs between runs" << at;
    EXPECT_EQ(runs[0][2], runs[1][2]) << "dbias differs between runs" << at;
    auto ref_dinp = ref_.Put<double>(dinp0);
    auto ref_dw = ref_.Put<double>(dw0), ref_db = ref_.Put<double>(db0);
    ref_.ops->LayerNormBackward(ref_dinp, ref_dw, ref_db, ref_.Put<double>(dout), ref_.Put<double>(x),
                                ref_.Put<double>(w), ref_.Put<double>(m), ref_.Put<double>(s), N, C, *ref_.stream);
    ExpectClose(runs[0][0], ref_.Get(ref_dinp, N * C), "LayerNormBackward dinp (+=, bf16)" + at, 1e-2);
    ExpectClose(runs[0][1], ref_.Get(ref_dw, C), "LayerNormBackward dweight (fp32)" + at, 1e-4);
    ExpectClose(runs[0][2], ref_.Get(ref_db, C), "LayerNormBackward dbias (fp32)" + at, 1e-5);
    gpu_.keep.clear();
    ref_.keep.clear();
  }
  const int too_wide = 20000;
  auto row = gpu_.Poisoned<runtime::bf16>(too_wide);
  auto acc = gpu_.Poisoned<float>(too_wide);
  EXPECT_THROW(gpu_.ops->LayerNormBackward(row, acc, acc, row, row, row, acc, acc, 1, too_wide, *gpu_.stream),
               std::invalid_argument);
}

// RMSNorm's backward at rows wider than 48 KiB of per-warp partial sums (one warp a block,
// opted-in shared memory), at Llama 8B's width, at an odd width (element-wise path), and
// past the limit: dweight (partials per block, then summed in order) and dinp the same
// bits on every run, and close to fp64.
TEST_F(CudaOps, RmsNormBackwardRepeatsBitForBit) {
  MESHTRAIN_SKIP_WITHOUT_GPU();
  const float eps = 1e-5f;
  for (const int C : {16384, 4096, 333}) {
    const int64_t N = 300;
    const std::string at = " (C " + std::to_string(C) + ")";
    const auto x = Random(N * C, 2.0), w = Random(C), dout = Random(N * C), dinp0 = Random(N * C),
               dw0 = RandomFloat(C);
    auto rstd = gpu_.Poisoned<float>(N);
    auto out = gpu_.Poisoned<runtime::bf16>(N * C);
    gpu_.ops->RmsNormForward(out, rstd, gpu_.Put<runtime::bf16>(x), gpu_.Put<runtime::bf16>(w), N, C, eps,
                             *gpu_.stream);
    const auto s = gpu_.Get(rstd, N);
    std::vector<double> runs[2][2];
    for (int run = 0; run < 2; ++run) {
      auto dinp = gpu_.Put<runtime::bf16>(dinp0);
      auto dw = gpu_.Put<float>(dw0);
      gpu_.ops->RmsNormBackward(dinp, dw, gpu_.Put<runtime::bf16>(dout), gpu_.Put<runtime::bf16>(x),
                                gpu_.Put<runtime::bf16>(w), gpu_.Put<float>(s), N, C, *gpu_.stream);
      runs[run][0] = gpu_.Get(dinp, N * C);
      runs[run][1] = gpu_.Get(dw, C);
    }
    EXPECT_TRUE(runs[0][0] == runs[1][0]) << "dinp differs between runs" << at;
    EXPECT_TRUE(runs[0][1] == runs[1][1]) << "dweight differs between runs" << at;
    auto ref_dinp = ref_.Put<double>(dinp0);
    auto ref_dw = ref_.Put<double>(dw0);
    ref_.ops->RmsNormBackward(ref_dinp, ref_dw, ref_.Put<double>(dout), ref_.Put<double>(x), ref_.Put<double>(w),
                              ref_.Put<double>(s), N, C, *ref_.stream);
    ExpectClose(runs[0][0], ref_.Get(ref_dinp, N * C), "RmsNormBackward dinp (+=, bf16)" + at, 1e-2);
    // fp32 sums of 300 products of bf16 values, from fp32 rstd.
    ExpectClose(runs[0][1], ref_.Get(ref_dw, C), "RmsNormBackward dweight (fp32)" + at, 1e-4);
    gpu_.keep.clear();
    ref_.keep.clear();
  }
  const int too_wide = 40000;
  auto row = gpu_.Poisoned<runtime::bf16>(too_wide);
  auto acc = gpu_.Poisoned<float>(too_wide);
  EXPECT_THROW(gpu_.ops->RmsNormBackward(row, acc, row, row, row, acc, 1, too_wide, *gpu_.stream),
               std::invalid_argument);
}

// AdamW's one launch over a thousand segments of every size (empty ones among them),
// with the clipping factor read on the device, and the norm over the same segments.
TEST_F(CudaOps, ShardOperationsOverManySegments) {
  MESHTRAIN_SKIP_WITHOUT_GPU();
  std::vector<kernels::ShardSegment> segments;
  std::uniform_int_distribution<int64_t> size(0, 5000);
  int64_t n = 0;
  for (int s = 0; s < 1000; ++s) {
    const int64_t length = s % 97 == 0 ? 0 : size(rng_);
    segments.push_back({n, length, s % 2, int32_t(s % 3 != 0)});
    n += length + s % 5;  // gaps belong to no segment
  }
  const auto grads = RandomFloat(n), master0 = RandomFloat(n), m0 = RandomFloat(n, 0.01);
  auto v0 = RandomFloat(n, 0.01);
  for (double& v : v0) v = std::abs(v);
  kernels::AdamWStep step;
  step.learning_rate = 1e-3f;
  step.weight_decay = 0.1f;
  step.t = 5;
  auto master = gpu_.Put<float>(master0), m = gpu_.Put<float>(m0), v = gpu_.Put<float>(v0);
  auto params = gpu_.Poisoned<runtime::bf16>(n);
  auto device_grads = gpu_.Put<float>(grads);
  auto device_segments = gpu_.PutRaw(segments);
  gpu_.ops->AdamW(master, params, device_grads, m, v, device_segments, int(segments.size()), step,
                  gpu_.Put<float>({0.75}), *gpu_.stream);
  auto squares = gpu_.Put<double>({0.0});
  gpu_.ops->SumSquares(squares, device_grads, device_segments, int(segments.size()), *gpu_.stream);
  auto ref_master = ref_.Put<double>(master0), ref_m = ref_.Put<double>(m0), ref_v = ref_.Put<double>(v0);
  auto ref_segments = ref_.PutRaw(segments);
  ref_.ops->AdamW(ref_master, nullptr, ref_.Put<double>(grads), ref_m, ref_v, ref_segments, int(segments.size()), step,
                  ref_.Put<float>({0.75}), *ref_.stream);
  auto ref_squares = ref_.Put<double>({0.0});
  ref_.ops->SumSquares(ref_squares, ref_.Put<double>(grads), ref_segments, int(segments.size()), *ref_.stream);
  // fp32 arithmetic on fp32 state: a few ulps.
  const auto got_master = gpu_.Get(master, n), want_master = ref_.Get(ref_master, n);
  ExpectClose(got_master, want_master, "AdamW master", 1e-6);
  ExpectClose(gpu_.Get(m, n), ref_.Get(ref_m, n), "AdamW m", 1e-6);
  ExpectClose(gpu_.Get(v, n), ref_.Get(ref_v, n), "AdamW v", 1e-6);
  ExpectClose(gpu_.Get(squares, 1), ref_.Get(ref_squares, 1), "SumSquares", 1e-6);
  const auto got_params = gpu_.Get(params, n);
  std::vector<bool> covered(size_t(n), false);
  for (const auto& segment : segments) {
    for (int64_t i = segment.offset; i < segment.offset + segment.size; ++i) covered[size_t(i)] = true;
  }
  for (int64_t i = 0; i < n; ++i) {
    if (covered[size_t(i)]) {
      ASSERT_EQ(got_params[size_t(i)], double(float(runtime::bf16(float(got_master[size_t(i)]))))) << i;
    } else {
      ASSERT_EQ(got_master[size_t(i)], master0[size_t(i)]) << "AdamW touched the gap at " << i;
    }
  }
  segments.resize(4096);  // more than one launch takes
  auto too_many = gpu_.PutRaw(segments);
  EXPECT_THROW(gpu_.ops->AdamW(master, params, device_grads, m, v, too_many, int(segments.size()), step, nullptr,
                               *gpu_.stream),
               std::invalid_argument);
}

// The mixture of experts at a Qwen3-MoE-like shape (64 experts, the top 8, C 512) with
// one expert no token chooses: the experts chosen and the dispatch order (256 chunks'
// counts and ranks) are the reference's exactly; the grouped products over experts of
// uneven rows are within bf16's bound of fp64; and the backwards' sums (the combine's
// dweights, the permute's dx, the experts' dinp and dweight) are the same bits on a second
// run.
TEST_F(CudaOps, MixtureOfExpertsAtScaleRepeatsBitForBit) {
  MESHTRAIN_SKIP_WITHOUT_GPU();
  const int64_t N = 2048;
  const int E = 64, k = 8, C = 512, H = 256, unused = 5;
  const int64_t copies = N * k;
  std::vector<double> logits = Random(N * E);
  for (int64_t i = 0; i < N * E; ++i) {
    logits[size_t(i)] = i % E == unused ? -4.0 : std::clamp(std::round(logits[size_t(i)] * 64), -255.0, 255.0) / 64;
  }
  auto probs = gpu_.Poisoned<float>(N * E), weights = gpu_.Poisoned<float>(copies);
  auto experts = gpu_.Poisoned<int32_t>(copies), counts = gpu_.Poisoned<int32_t>(E),
       positions = gpu_.Poisoned<int32_t>(copies);
  gpu_.ops->RouterTopKForward(probs, experts, weights, gpu_.Put<runtime::bf16>(logits), N, E, k, true, *gpu_.stream);
  gpu_.ops->MoePermutePlan(counts, positions, experts, N, k, E, *gpu_.stream);
  auto ref_probs = ref_.Poisoned<double>(N * E), ref_weights = ref_.Poisoned<double>(copies);
  auto ref_experts = ref_.Poisoned<int32_t>(copies), ref_counts = ref_.Poisoned<int32_t>(E),
       ref_positions = ref_.Poisoned<int32_t>(copies);
  ref_.ops->RouterTopKForward(ref_probs, ref_experts, ref_weights, ref_.Put<double>(logits), N, E, k, true,
                              *ref_.stream);
  ref_.ops->MoePermutePlan(ref_counts, ref_positions, ref_experts, N, k, E, *ref_.stream);
  ASSERT_EQ(gpu_.Get(experts, copies), ref_.Get(ref_experts, copies)) << "RouterTopKForward experts";
  const auto got_counts = gpu_.Get(counts, E);
  ASSERT_EQ(got_counts, ref_.Get(ref_counts, E)) << "MoePermutePlan counts";
  ASSERT_EQ(gpu_.Get(positions, copies), ref_.Get(ref_positions, copies)) << "MoePermutePlan positions";
  ASSERT_EQ(got_counts[size_t(unused)], 0);
  ExpectClose(gpu_.Get(weights, copies), ref_.Get(ref_weights, copies), "RouterTopKForward weights", 1e-5);
  const std::vector<int32_t> rows(got_counts.begin(), got_counts.end());

  const auto x = Random(N * C), w = Random(int64_t(E) * 2 * H * C, 0.05), dgate_up = Random(copies * 2 * H),
             dout = Random(N * C);
  auto xs = gpu_.Poisoned<runtime::bf16>(copies * C), gate_up = gpu_.Poisoned<runtime::bf16>(copies * 2 * H);
  auto device_w = gpu_.Put<runtime::bf16>(w);
  gpu_.ops->MoePermute(xs, gpu_.Put<runtime::bf16>(x), positions, N, k, C, *gpu_.stream);
  gpu_.ops->GroupedMatmulForward(gate_up, xs, device_w, rows.data(), E, C, 2 * H, *gpu_.stream);
  const auto got_xs = gpu_.Get(xs, copies * C);
  auto ref_gate_up = ref_.Poisoned<double>(copies * 2 * H);
  auto ref_xs = ref_.Put<double>(got_xs), ref_w = ref_.Put<double>(w);
  ref_.ops->GroupedMatmulForward(ref_gate_up, ref_xs, ref_w, rows.data(), E, C, 2 * H, *ref_.stream);
  ExpectClose(gpu_.Get(gate_up, copies * 2 * H), ref_.Get(ref_gate_up, copies * 2 * H), "GroupedMatmulForward", 1e-2);

  std::vector<double> runs[2][4];
  for (int run = 0; run < 2; ++run) {
    auto dxs = gpu_.Poisoned<runtime::bf16>(copies * C);
    auto dw = gpu_.Put<float>(std::vector<double>(size_t(E) * 2 * H * C, 0.0));
    gpu_.ops->GroupedMatmulBackward(dxs, dw, gpu_.Put<runtime::bf16>(dgate_up), xs, device_w, rows.data(), E, C, 2 * H,
                                    *gpu_.stream);
    auto dx = gpu_.Put<runtime::bf16>(dout);
    gpu_.ops->MoePermuteBackward(dx, dxs, positions, N, k, C, *gpu_.stream);
    auto dys = gpu_.Poisoned<runtime::bf16>(copies * C);
    auto dweights = gpu_.Poisoned<float>(copies);
    gpu_.ops->MoeCombineBackward(dys, dweights, gpu_.Put<runtime::bf16>(dout), xs, weights, positions, N, k, C,
                                 *gpu_.stream);
    runs[run][0] = gpu_.Get(dxs, copies * C);
    runs[run][1] = gpu_.Get(dw, int64_t(E) * 2 * H * C);
    runs[run][2] = gpu_.Get(dx, N * C);
    runs[run][3] = gpu_.Get(dweights, copies);
  }
  const char* names[4] = {"GroupedMatmulBackward dinp", "GroupedMatmulBackward dweight", "MoePermuteBackward dx",
                          "MoeCombineBackward dweights"};
  for (int i = 0; i < 4; ++i) EXPECT_TRUE(runs[0][i] == runs[1][i]) << names[i] << " differs between runs";
  auto ref_dxs = ref_.Poisoned<double>(copies * C);
  auto ref_dw = ref_.Put<double>(std::vector<double>(size_t(E) * 2 * H * C, 0.0));
  ref_.ops->GroupedMatmulBackward(ref_dxs, ref_dw, ref_.Put<double>(dgate_up), ref_xs, ref_w, rows.data(), E, C, 2 * H,
                                  *ref_.stream);
  ExpectClose(runs[0][0], ref_.Get(ref_dxs, copies * C), "GroupedMatmulBackward dinp", 1e-2);
  // fp32 sums of exact bf16 products, as MatmulBackward's dweight.
  ExpectClose(runs[0][1], ref_.Get(ref_dw, int64_t(E) * 2 * H * C), "GroupedMatmulBackward dweight", 1e-3);
}

// The experts' products through cuBLAS's grouped API (kernels/cuda/grouped_gemm.h) with
// many calls in flight: more calls than its ring has slots of addresses, each of its own
// uneven row counts (experts with none among them) into its own arrays, enqueued with no
// wait between them and the caller's counts overwritten after each (the table reads them
// during the call only); and one call of more experts than one cuBLAS call takes. K and
// OC are multiples of 8, so every expert's rows start on 16 bytes and the grouped API
// takes them (the conformance suite's K 37 takes the loop of cuBLASLt products). Each call
// within bf16's bound of fp64, and an expert with no rows leaves its dweight as it was.
TEST_F(CudaOps, GroupedProductsInFlightMatchTheReference) {
  MESHTRAIN_SKIP_WITHOUT_GPU();
  using kernels::cuda::GroupedGemm;
  struct Case {
    std::vector<int32_t> counts;
    int K = 0, OC = 0;
    int64_t rows = 0;
    std::vector<double> x, w, dout, dw0;
    runtime::DevicePtr<runtime::bf16> device_x, device_w, device_dout, out, dinp;
    runtime::DevicePtr<float> dw;
  };
  std::vector<Case> cases;
  std::uniform_int_distribution<int32_t> pick(0, 40);
  for (int c = 0; c < 2 * GroupedGemm::kSlots + 1; ++c) {
    Case one;
    one.counts.resize(12);
    one.K = 64;
    one.OC = 96;
    for (int32_t& m : one.counts) m = pick(rng_) < 10 ? 0 : pick(rng_);
    one.counts[size_t(c) % 12] = 0;
    one.counts[size_t(c + 5) % 12] = 1 + c;
    cases.push_back(std::move(one));
  }
  Case many;
  many.counts.resize(size_t(GroupedGemm::kCapacity) + 37);
  many.K = 16;
  many.OC = 24;
  for (size_t e = 0; e < many.counts.size(); ++e) many.counts[e] = e % 7 == 3 ? 0 : 1 + 2 * int32_t(e % 2);
  cases.push_back(std::move(many));

  // Every input on the device first (Put waits on the stream), then the calls.
  for (Case& c : cases) {
    const int E = int(c.counts.size());
    c.rows = std::accumulate(c.counts.begin(), c.counts.end(), int64_t{0});
    const int64_t W = int64_t(E) * c.OC * c.K;
    c.x = Random(c.rows * c.K);
    c.w = Random(W, 0.05);
    c.dout = Random(c.rows * c.OC);
    c.dw0 = RandomFloat(W);
    c.device_x = gpu_.Put<runtime::bf16>(c.x);
    c.device_w = gpu_.Put<runtime::bf16>(c.w);
    c.device_dout = gpu_.Put<runtime::bf16>(c.dout);
    c.dw = gpu_.Put<float>(c.dw0);
  }
  for (Case& c : cases) {
    c.out = gpu_.Poisoned<runtime::bf16>(c.rows * c.OC);
    c.dinp = gpu_.Poisoned<runtime::bf16>(c.rows * c.K);
  }
  std::vector<int32_t> counts;
  for (Case& c : cases) {
    const int E = int(c.counts.size());
    counts = c.counts;
    gpu_.ops->GroupedMatmulForward(c.out, c.device_x, c.device_w, counts.data(), E, c.K, c.OC, *gpu_.stream);
    gpu_.ops->GroupedMatmulBackward(c.dinp, c.dw, c.device_dout, c.device_x, c.device_w, counts.data(), E, c.K, c.OC,
                                    *gpu_.stream);
    std::fill(counts.begin(), counts.end(), 1 << 20);
  }

  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    const int E = int(c.counts.size());
    const int64_t W = int64_t(E) * c.OC * c.K;
    const std::string at = " (call " + std::to_string(i) + ", " + std::to_string(E) + " experts, " +
                           std::to_string(c.rows) + " rows)";
    auto ref_x = ref_.Put<double>(c.x), ref_w = ref_.Put<double>(c.w);
    auto ref_out = ref_.Poisoned<double>(c.rows * c.OC), ref_dinp = ref_.Poisoned<double>(c.rows * c.K);
    auto ref_dw = ref_.Put<double>(c.dw0);
    ref_.ops->GroupedMatmulForward(ref_out, ref_x, ref_w, c.counts.data(), E, c.K, c.OC, *ref_.stream);
    ref_.ops->GroupedMatmulBackward(ref_dinp, ref_dw, ref_.Put<double>(c.dout), ref_x, ref_w, c.counts.data(), E,
                                    c.K, c.OC, *ref_.stream);
    ASSERT_GT(c.rows, 0) << at;
    ExpectClose(gpu_.Get(c.out, c.rows * c.OC), ref_.Get(ref_out, c.rows * c.OC), "GroupedMatmulForward" + at, 1e-2);
    ExpectClose(gpu_.Get(c.dinp, c.rows * c.K), ref_.Get(ref_dinp, c.rows * c.K), "GroupedMatmulBackward dinp" + at,
                1e-2);
    const auto got_dw = gpu_.Get(c.dw, W);
    ExpectClose(got_dw, ref_.Get(ref_dw, W), "GroupedMatmulBackward dweight (+=)" + at, 1e-3);
    for (int e = 0; e < E; ++e) {
      if (c.counts[size_t(e)] != 0) continue;
      for (int64_t j = int64_t(e) * c.OC * c.K; j < int64_t(e + 1) * c.OC * c.K; ++j) {
        ASSERT_EQ(got_dw[size_t(j)], c.dw0[size_t(j)]) << "GroupedMatmulBackward changed expert " << e << at;
      }
    }
  }
}

// Not a check: the per-operation times of one GPT-2 124M block at B 16, T 1024 (run with
// --gtest_also_run_disabled_tests), to compare with llm.c.
TEST_F(CudaOps, DISABLED_Gpt2BlockTimings) {
  MESHTRAIN_SKIP_WITHOUT_GPU();
  const int B = 16, T = 1024, C = 768, NH = 12, HS = 64, V = 50304;
  const int64_t N = int64_t(B) * T;
  auto bf = [&](int64_t n) { return gpu_.Put<runtime::bf16>(Random(n, 0.1)); };
  auto fl = [&](int64_t n) { return gpu_.Put<float>(RandomFloat(n, 0.1)); };
  auto x = bf(N * C), ln = bf(N * C), qkv = bf(N * 3 * C), att = bf(N * C), fch = bf(N * 4 * C), pre = bf(N * 4 * C);
  auto dln = bf(N * C), dfch = bf(N * 4 * C);  // dinp: MatmulBackward reads inp after writing it
  auto w_qkv = bf(3 * C * C), w_fc = bf(4 * C * C), w_proj = bf(C * 4 * C), bias = bf(4 * C), lnw = bf(C);
  auto wte = bf(int64_t(V) * C);
  auto dw = fl(4 * C * C), db = fl(4 * C), mean = fl(N), rstd = fl(N);
  const bool fused = gpu_.ops->Attention(B, T, NH, NH, HS) == AttentionKind::kFused;
  std::printf("attention: %s, state %lld floats, backward scratch %lld bytes\n", fused ? "fused (cuDNN)" : "scores",
              static_cast<long long>(gpu_.ops->AttentionStateElements(B, T, NH, NH, HS)),
              static_cast<long long>(gpu_.ops->AttentionScratchBytes(B, T, NH, NH, HS)));
  auto state = fl(gpu_.ops->AttentionStateElements(B, T, NH, NH, HS));
  auto scratch = gpu_.Poisoned<std::byte>(gpu_.ops->AttentionScratchBytes(B, T, NH, NH, HS));
  auto dqkv = bf(N * 3 * C), logits = bf(4096 * int64_t(V));
  auto losses = fl(4096);
  auto targets = gpu_.Put<int32_t>(Tokens(4096, 50257));
  auto time = [&](const char* name, auto body) { Time(name, body); };
  auto& s = *gpu_.stream;
  auto& ops = *gpu_.ops;
  time("LayerNormForward", [&] { ops.LayerNormForward(ln, mean, rstd, x, lnw, lnw, N, C, s); });
  time("ResidualLayerNormForward", [&] { ops.ResidualLayerNormForward(x, ln, mean, rstd, x, att, lnw, lnw, N, C, s); });
  time("MatmulForward qkv (bias)", [&] { ops.MatmulForward(qkv, nullptr, ln, w_qkv, bias, nullptr, N, C, 3 * C, s); });
  time("AttentionForward", [&] { ops.AttentionForward(att, state, qkv, B, T, NH, NH, HS, s); });
  time("MatmulForward fc (bias, gelu)", [&] { ops.MatmulForward(fch, pre, ln, w_fc, bias, nullptr, N, C, 4 * C, s); });
  time("MatmulForward proj (bias)", [&] { ops.MatmulForward(att, nullptr, fch, w_proj, bias, nullptr, N, 4 * C, C, s); });
  time("MatmulForward proj (bias, residual)", [&] { ops.MatmulForward(att, nullptr, fch, w_proj, bias, x, N, 4 * C, C, s); });
  time("MatmulBackward proj (dgelu, dbias)", [&] { ops.MatmulBackward(dfch, dw, db, att, fch, w_proj, pre, N, 4 * C, C, s); });
  time("MatmulBackward fc (dbias)", [&] { ops.MatmulBackward(dln, dw, db, fch, ln, w_fc, nullptr, N, C, 4 * C, s); });
  time("MatmulBackward fc (dweight, dbias)", [&] { ops.MatmulBackward(nullptr, dw, db, fch, ln, w_fc, nullptr, N, C, 4 * C, s); });
  time("MatmulBackward fc (dweight)", [&] { ops.MatmulBackward(nullptr, dw, nullptr, fch, ln, w_fc, nullptr, N, C, 4 * C, s); });
  time("MatmulBackward fc (dbias alone)", [&] { ops.MatmulBackward(nullptr, nullptr, db, fch, ln, w_fc, nullptr, N, C, 4 * C, s); });
  time("AttentionBackward", [&] { ops.AttentionBackward(dqkv, scratch, att, qkv, att, state, B, T, NH, NH, HS, s); });
  time("LayerNormBackward", [&] { ops.LayerNormBackward(x, dw, db, ln, x, lnw, mean, rstd, N, C, s); });
  time("Add", [&] { ops.Add(x, x, att, N * C, s); });
  time("MatmulForward lm head (4096 rows)", [&] { ops.MatmulForward(logits, nullptr, ln, wte, nullptr, nullptr, 4096, C, V, s); });
  time("CrossEntropy (4096 rows, in place)", [&] { ops.CrossEntropy(losses, logits, logits, targets, 4096, 50257, V, 1.0f / N, s); });

  // The root unit and the optimizer: text-like tokens (a few very common), 124M parameters.
  std::vector<double> text(static_cast<size_t>(N));
  std::uniform_real_distribution<double> uniform(0, 1);
  for (double& t : text) t = std::floor(50257 * std::pow(uniform(rng_), 4));
  auto tokens = gpu_.Put<int32_t>(text), uniform_tokens = gpu_.Put<int32_t>(Tokens(N, 50257));
  auto wpe = bf(int64_t(T) * C);
  auto dwte = fl(int64_t(V) * C), dwpe = fl(int64_t(T) * C);
  time("EncoderForward", [&] { ops.EncoderForward(x, tokens, wte, wpe, B, T, C, 0, 50257, s); });
  time("EncoderBackward (text-like tokens)", [&] { ops.EncoderBackward(dwte, dwpe, x, tokens, B, T, C, 0, 50257, s); });
  time("EncoderBackward (uniform tokens)", [&] { ops.EncoderBackward(dwte, dwpe, x, uniform_tokens, B, T, C, 0, 50257, s); });
  const int64_t P = 124475904;
  auto master = fl(P), grads = fl(P), m = fl(P), v = gpu_.Put<float>(std::vector<double>(static_cast<size_t>(P), 0.01));
  auto params = gpu_.Poisoned<runtime::bf16>(P);
  std::vector<kernels::ShardSegment> table;
  for (int64_t offset = 0; offset < P; offset += P / 16) table.push_back({offset, std::min(P / 16, P - offset), 1, 1});
  auto segments = gpu_.PutRaw(table);
  auto norm = gpu_.Put<double>({0.0});
  auto clip = gpu_.Put<float>({1.0});
  kernels::AdamWStep step;
  step.learning_rate = 1e-4f;
  time("SumSquares (124M)", [&] { ops.SumSquares(norm, grads, segments, int(table.size()), s); });
  time("AdamW (124M, with the bf16 copy)", [&] { ops.AdamW(master, params, grads, m, v, segments, int(table.size()), step, clip, s); });
}

// Not a check: the per-operation times of one Llama 3 8B block (C 4096, 32 query heads
// over 8 key/value heads of 128, SwiGLU of 14336) at B 4, T 1024 on one GPU (run with
// --gtest_also_run_disabled_tests).
TEST_F(CudaOps, DISABLED_LlamaBlockTimings) {
  MESHTRAIN_SKIP_WITHOUT_GPU();
  const int B = 4, T = 1024, C = 4096, NH = 32, KVH = 8, HS = 128, H = 14336;
  const int QKV = (NH + 2 * KVH) * HS;
  const int64_t N = int64_t(B) * T;
  const float eps = 1e-5f;
  auto bf = [&](int64_t n) { return gpu_.Put<runtime::bf16>(Random(n, 0.1)); };
  auto fl = [&](int64_t n) { return gpu_.Put<float>(RandomFloat(n, 0.1)); };
  // Activations and their gradients; no output aliases an input of its call.
  auto x = bf(N * C), norm = bf(N * C), qkv = bf(N * QKV), att = bf(N * C), proj = bf(N * C), gate_up = bf(N * 2 * H),
       mlp = bf(N * H);
  auto dx = bf(N * C), dnorm = bf(N * C), datt = bf(N * C), dqkv = bf(N * QKV), dgate_up = bf(N * 2 * H),
       dmlp = bf(N * H);
  auto w_qkv = bf(int64_t(QKV) * C), w_o = bf(int64_t(C) * C), w_gate_up = bf(int64_t(2) * H * C),
       w_down = bf(int64_t(C) * H), w_norm = bf(C);
  auto dw = fl(int64_t(2) * H * C), rstd = fl(N);
  const int64_t angles = int64_t(T) * HS / 2;
  auto cos = gpu_.Put<float>(std::vector<double>(size_t(angles), 0.6));
  auto sin = gpu_.Put<float>(std::vector<double>(size_t(angles), 0.8));
  const bool fused = gpu_.ops->Attention(B, T, NH, KVH, HS) == AttentionKind::kFused;
  std::printf("attention: %s, state %lld floats, backward scratch %lld bytes\n", fused ? "fused (cuDNN)" : "scores",
              static_cast<long long>(gpu_.ops->AttentionStateElements(B, T, NH, KVH, HS)),
              static_cast<long long>(gpu_.ops->AttentionScratchBytes(B, T, NH, KVH, HS)));
  auto state = fl(gpu_.ops->AttentionStateElements(B, T, NH, KVH, HS));
  auto scratch = gpu_.Poisoned<std::byte>(gpu_.ops->AttentionScratchBytes(B, T, NH, KVH, HS));
  auto& s = *gpu_.stream;
  auto& ops = *gpu_.ops;
  Time("RmsNormForward", [&] { ops.RmsNormForward(norm, rstd, x, w_norm, N, C, eps, s); });
  Time("ResidualRmsNormForward", [&] { ops.ResidualRmsNormForward(x, norm, rstd, x, proj, w_norm, N, C, eps, s); });
  Time("MatmulForward qkv", [&] { ops.MatmulForward(qkv, nullptr, norm, w_qkv, nullptr, nullptr, N, C, QKV, s); });
  Time("RopeForward", [&] { ops.RopeForward(qkv, cos, sin, B, T, NH, KVH, HS, s); });
  Time("AttentionForward", [&] { ops.AttentionForward(att, state, qkv, B, T, NH, KVH, HS, s); });
  Time("MatmulForward o (residual)", [&] { ops.MatmulForward(proj, nullptr, att, w_o, nullptr, x, N, C, C, s); });
  Time("MatmulForward gate_up",
       [&] { ops.MatmulForward(gate_up, nullptr, norm, w_gate_up, nullptr, nullptr, N, C, 2 * H, s); });
  Time("SwiGluForward", [&] { ops.SwiGluForward(mlp, gate_up, N, H, s); });
  Time("MatmulForward down (residual)", [&] { ops.MatmulForward(proj, nullptr, mlp, w_down, nullptr, x, N, H, C, s); });
  Time("MatmulBackward down", [&] { ops.MatmulBackward(dmlp, dw, nullptr, dx, mlp, w_down, nullptr, N, H, C, s); });
  Time("SwiGluBackward", [&] { ops.SwiGluBackward(dgate_up, dmlp, gate_up, N, H, s); });
  Time("MatmulBackward gate_up",
       [&] { ops.MatmulBackward(dnorm, dw, nullptr, dgate_up, norm, w_gate_up, nullptr, N, C, 2 * H, s); });
  Time("RmsNormBackward", [&] { ops.RmsNormBackward(dx, dw, dnorm, x, w_norm, rstd, N, C, s); });
  Time("MatmulBackward o", [&] { ops.MatmulBackward(datt, dw, nullptr, dx, att, w_o, nullptr, N, C, C, s); });
  Time("AttentionBackward",
       [&] { ops.AttentionBackward(dqkv, scratch, datt, qkv, att, state, B, T, NH, KVH, HS, s); });
  Time("RopeBackward", [&] { ops.RopeBackward(dqkv, cos, sin, B, T, NH, KVH, HS, s); });
  Time("MatmulBackward qkv", [&] { ops.MatmulBackward(dnorm, dw, nullptr, dqkv, norm, w_qkv, nullptr, N, C, QKV, s); });
}

}  // namespace
}  // namespace meshtrain::testing
