// The GPU table's float8 operations (kernels/ops.h, "Float8 products"; kernels/cuda/
// float8.h and cuda_ops.cc) against the CPU's bf16 emulation (kernels::MakeCpuOps<Bf16>,
// whose float8 products are cpu/float8_matmul.h's): amaxes and scales bit for bit, and
// the three products of both recipes, with and without the forward's bias, residual and
// GELU and the grad input's GELU derivative, at shapes that take one fp32 sum and several.
// On a device below compute capability 8.9 every float8 operation must refuse, naming
// the device; without a device every test skips ("skipped: no GPU").
//
// Tolerances: both sides see the same bf16 inputs and the same scales (computed on the
// host with kernels::Float8Scale from the inputs' amaxes), so they cast to the same float8
// codes; what remains is the order of the fp32 sums (and, tensorwise, cuBLASLt's
// descaling of the sum against the CPU's dequantised operands), a relative few 1e-7,
// which moves a bf16 output across a rounding boundary now and then (one bf16 step,
// 2^-8 relative, in a few elements: a relative L2 error well below 2e-3), and fp32
// outputs (dweight, dbias) by a few 1e-7.

#include <gtest/gtest.h>

#include <cuda_fp8.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "tests/support/gpu.h"
#include "tests/support/ops_conformance.h"
#include "worker/kernels/cpu/cpu_ops.h"
#include "worker/kernels/cuda/cuda_ops.h"
#include "worker/kernels/float8.h"
#include "worker/runtime/cuda.h"

namespace meshtrain::testing {

// OpsSide comes from the conformance suite's header, whose suite this file does not run.
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(OpsConformance);

namespace {

using kernels::Bf16;
using kernels::Float8;
using kernels::Float8Cast;
using kernels::Float8CastOf;
using kernels::Float8Operand;
using kernels::Float8Recipe;
using kernels::Float8Scaling;
using runtime::bf16;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

// Compute capability 8.9 and up: float8 tensor cores.
bool DeviceHasFloat8() {
  cudaDeviceProp properties{};
  return cudaGetDeviceProperties(&properties, 0) == cudaSuccess && properties.major * 10 + properties.minor >= 89;
}

#define MESHTRAIN_SKIP_WITHOUT_FLOAT8()                                                                   \
  do {                                                                                                    \
    MESHTRAIN_SKIP_WITHOUT_GPU();                                                                         \
    if (!DeviceHasFloat8()) GTEST_SKIP() << "skipped: cuda:0 is below compute capability 8.9 (no float8)"; \
  } while (0)

template <class P>
void Open(OpsSide<P>& side, std::unique_ptr<runtime::Backend> backend, const char* stream) {
  side.backend = std::move(backend);
  side.allocator = std::make_unique<runtime::CachingAllocator>(&side.accounting, side.backend->DeviceMemory());
  side.stream = side.backend->NewStream(stream);
}

// Equal as floats, NaN equal to NaN (whatever its payload).
bool SameFloat(double a, double b) { return (std::isnan(a) && std::isnan(b)) || a == b; }

class CudaFloat8 : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!HaveGpu()) return;  // each test skips, saying so
    Open(gpu_, runtime::cuda::MakeCudaBackend(0), "gpu");
    gpu_.ops = kernels::cuda::MakeCudaOps(*gpu_.backend, gpu_.allocator.get());
    Open(cpu_, std::make_unique<runtime::CpuBackend>(), "bf16 emulation");
    cpu_.ops = kernels::MakeCpuOps<Bf16>();
  }
  void TearDown() override {
    if (gpu_.stream) gpu_.stream->Synchronize();
  }

  // n draws of scale times a standard normal, as bf16 stores them; never zero.
  std::vector<double> Random(int64_t n, double scale = 1.0) {
    std::normal_distribution<double> normal(0.0, scale);
    std::vector<double> values(static_cast<size_t>(n));
    for (double& v : values) {
      do v = double(float(bf16(float(normal(rng_)))));
      while (v == 0.0);
    }
    return values;
  }
  std::vector<double> RandomFloat(int64_t n) {
    std::normal_distribution<double> normal(0.0, 1.0);
    std::vector<double> values(static_cast<size_t>(n));
    for (double& v : values) v = double(float(normal(rng_)));
    return values;
  }

  // The scales of x (rows,cols) as `cast` scales it: its amaxes on the host, then
  // kernels::Float8Scale (what Float8Amax and Float8Scales compute; checked apart).
  static std::vector<double> ScalesOf(const std::vector<double>& x, int64_t rows, int64_t cols, Float8Cast cast) {
    std::vector<double> amax(size_t(kernels::Float8ScaleCount(cast.scaling, rows, cols)), 0.0);
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t j = 0; j < cols; ++j) {
        const size_t at = cast.scaling == Float8Scaling::kTensor ? 0 : cast.scaling == Float8Scaling::kRow ? size_t(i)
                                                                                                            : size_t(j);
        amax[at] = std::max(amax[at], std::fabs(x[size_t(i * cols + j)]));
      }
    }
    std::vector<double> scale(amax.size());
    for (size_t i = 0; i < amax.size(); ++i) {
      scale[i] = kernels::Float8Scale(float(amax[i]), cast.format, cast.power_of_2_scales);
    }
    return scale;
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
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_FALSE(std::isnan(got[i])) << what << ": element " << i << " unwritten or NaN";
      ASSERT_FALSE(std::isnan(want[i])) << what << ": the emulation's element " << i << " is NaN";
    }
    const double error = RelativeL2(got, want);
    EXPECT_LE(error, tolerance) << what << ": relative L2 error " << error;
  }
  static void ExpectSame(const std::vector<double>& got, const std::vector<double>& want, const std::string& what) {
    ASSERT_EQ(got.size(), want.size()) << what;
    int reported = 0;
    for (size_t i = 0; i < got.size() && reported < 8; ++i) {
      if (!SameFloat(got[i], want[i])) {
        ADD_FAILURE() << what << ": element " << i << " is " << got[i] << ", the emulation's " << want[i];
        ++reported;
      }
    }
  }

  std::mt19937_64 rng_{20261202};
  OpsSide<Bf16> gpu_;
  OpsSide<Bf16> cpu_;
};

// --- The conversion the casts use, on the host (no device needed) ---

// __nv_cvt_float_to_fp8 with __NV_SATFINITE (the casts' conversion: its host form is the
// one sm_80 code runs, and sm_89+ hardware's cvt.rn.satfinite is specified alike) against
// kernels::EncodeFloat8, for every bf16 times scales as the casts form them (in fp32):
// the same code, except that a NaN may lose its sign.
TEST(CudaFloat8Conversion, MatchesEncodeFloat8) {
  int64_t differ = 0;
  for (const float scale : {1.0f, 0.0078125f, 448.0f / 3.7f, 57344.0f / 0.01f, 0.0f, 1.0e-30f, 3.0e30f}) {
    for (uint32_t bits = 0; bits < 0x10000; ++bits) {
      const float x = float(bf16::ToFloat(uint16_t(bits))) * scale;
      for (const Float8 format : {Float8::kE4M3, Float8::kE5M2}) {
        const uint8_t want = kernels::EncodeFloat8(x, format);
        const __nv_fp8_interpretation_t interpretation = format == Float8::kE4M3 ? __NV_E4M3 : __NV_E5M2;
        const uint8_t got = uint8_t(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, interpretation));
        const bool both_nan =
            std::isnan(kernels::DecodeFloat8(want, format)) && std::isnan(kernels::DecodeFloat8(got, format));
        if (got != want && !both_nan && ++differ <= 8) {
          ADD_FAILURE() << "bf16 bits " << bits << " times " << scale << ": " << int(got) << ", EncodeFloat8 "
                        << int(want);
        }
      }
    }
  }
  EXPECT_EQ(differ, 0);
}

// --- Below compute capability 8.9 ---

// Each float8 operation throws std::invalid_argument naming the device ("cuda:0 (<name>,
// compute capability 8.0) ...") before it enqueues anything.
TEST_F(CudaFloat8, RefusedBelowComputeCapability89NamingTheDevice) {
  MESHTRAIN_SKIP_WITHOUT_GPU();
  if (DeviceHasFloat8()) GTEST_SKIP() << "cuda:0 has float8 (compute capability 8.9 or higher): nothing to refuse";
  const int64_t N = 32;
  const int K = 32, OC = 32;
  auto x = gpu_.Put<bf16>(Random(N * K)), w = gpu_.Put<bf16>(Random(int64_t(OC) * K));
  auto d = gpu_.Put<bf16>(Random(N * OC));
  auto s = gpu_.Put<float>(std::vector<double>(64, 1.0));
  auto out = gpu_.Poisoned<bf16>(N * OC), dinp = gpu_.Poisoned<bf16>(N * K);
  auto dw = gpu_.Put<float>(std::vector<double>(size_t(OC) * K, 0.0));
  auto amax = gpu_.Poisoned<float>(64);
  auto expect_refusal = [&](const char* what, auto call) {
    try {
      call();
      ADD_FAILURE() << what << " did not refuse";
    } catch (const std::invalid_argument& e) {
      const std::string message = e.what();
      EXPECT_NE(message.find("cuda:0 ("), std::string::npos) << what << ": " << message;
      EXPECT_NE(message.find("compute capability"), std::string::npos) << what << ": " << message;
    }
  };
  auto& ops = *gpu_.ops;
  auto& stream = *gpu_.stream;
  expect_refusal("Float8Amax", [&] { ops.Float8Amax(amax, x, N, K, Float8Scaling::kRow, stream); });
  expect_refusal("Float8Scales", [&] { ops.Float8Scales(amax, s, 4, 1, 4, Float8::kE4M3, false, stream); });
  expect_refusal("Float8MatmulForward", [&] {
    ops.Float8MatmulForward(out, nullptr, x, s, w, s, nullptr, nullptr, N, K, OC, Float8Recipe::kTensorwise, stream);
  });
  expect_refusal("Float8MatmulGradInput", [&] {
    ops.Float8MatmulGradInput(dinp, d, s, w, s, nullptr, N, K, OC, Float8Recipe::kTensorwise, stream);
  });
  expect_refusal("Float8MatmulGradWeight", [&] {
    ops.Float8MatmulGradWeight(dw, nullptr, d, s, x, s, N, K, OC, Float8Recipe::kTensorwise, stream);
  });
  // Nothing was enqueued: the poison is still there.
  for (double v : gpu_.Get(out, N * OC)) ASSERT_TRUE(std::isnan(v));
  for (double v : gpu_.Get(amax, 64)) ASSERT_TRUE(std::isnan(v));
}

// --- Amax and scales: bit for bit ---

TEST_F(CudaFloat8, AmaxIsExactAndPropagatesNaN) {
  MESHTRAIN_SKIP_WITHOUT_FLOAT8();
  struct Case {
    int64_t rows;
    int cols;
    bool nan;
  };
  for (const Case c : {Case{64, 768, false}, Case{37, 99, false}, Case{1000, 16, false}, Case{3, 8191, false},
                       Case{4096, 64, false}, Case{1, 1, false}, Case{37, 99, true}, Case{256, 512, true}}) {
    std::vector<double> x = Random(c.rows * c.cols);
    // Magnitudes from bf16's subnormals to its largest, and an infinity.
    x[0] = 1e-40;
    if (c.rows * c.cols > 7) {
      x[3] = -3e38;
      x[7] = -kInf;
    }
    if (c.nan) x[size_t((c.rows / 2) * c.cols + c.cols / 3)] = kNaN;
    auto gx = gpu_.Put<bf16>(x), cx = cpu_.Put<bf16>(x);
    for (Float8Scaling scaling : {Float8Scaling::kTensor, Float8Scaling::kRow, Float8Scaling::kColumn}) {
      const int64_t n = kernels::Float8ScaleCount(scaling, c.rows, c.cols);
      const std::string at = " (" + std::to_string(c.rows) + " x " + std::to_string(c.cols) + ", scaling " +
                             std::to_string(int(scaling)) + (c.nan ? ", a NaN" : "") + ")";
      auto got = gpu_.Poisoned<float>(n);
      auto want = cpu_.Poisoned<float>(n);
      gpu_.ops->Float8Amax(got, gx, c.rows, c.cols, scaling, *gpu_.stream);
      cpu_.ops->Float8Amax(want, cx, c.rows, c.cols, scaling, *cpu_.stream);
      const std::vector<double> g = gpu_.Get(got, n), w = cpu_.Get(want, n);
      ExpectSame(g, w, "Float8Amax" + at);
      if (c.nan) {
        const int64_t nans = std::count_if(g.begin(), g.end(), [](double v) { return std::isnan(v); });
        EXPECT_EQ(nans, 1) << "Float8Amax: NaN in exactly the amax of the NaN" << at;
      }
    }
    gpu_.keep.clear();
    cpu_.keep.clear();
  }
}

TEST_F(CudaFloat8, ScalesAreExact) {
  MESHTRAIN_SKIP_WITHOUT_FLOAT8();
  // Amaxes of every kind: zero, below and at the 1e-12 floor, ordinary, bf16's extremes,
  // infinity and NaN, and random ones across many binades.
  std::vector<double> amax = {0, 1e-13, 1e-12, 2e-12, 1, 448, 57344, 3e38, kInf, kNaN, 1e-40, 0.75};
  std::lognormal_distribution<double> spread(0.0, 8.0);
  while (amax.size() < 1000) amax.push_back(double(float(spread(rng_))));
  const int64_t n = int64_t(amax.size());
  for (int copies : {1, 3}) {
    // `copies` copies n + 5 apart, the later ones drawn apart (a NaN among them in one slot).
    const int64_t stride = n + 5;
    std::vector<double> gathered(size_t(stride * copies), 0.0);
    for (int c = 0; c < copies; ++c) {
      for (int64_t i = 0; i < n; ++i) {
        gathered[size_t(c * stride + i)] = c == 0 ? amax[size_t(i)] : double(float(spread(rng_)));
      }
    }
    if (copies > 1) gathered[size_t(2 * stride + 4)] = kNaN;
    auto ga = gpu_.Put<float>(gathered), ca = cpu_.Put<float>(gathered);
    for (Float8 format : {Float8::kE4M3, Float8::kE5M2}) {
      for (bool power_of_2 : {false, true}) {
        const std::string at = std::string(" (") + (format == Float8::kE4M3 ? "E4M3" : "E5M2") +
                               (power_of_2 ? ", powers of 2" : "") + ", " + std::to_string(copies) + " copies)";
        auto got = gpu_.Poisoned<float>(n), want = cpu_.Poisoned<float>(n);
        gpu_.ops->Float8Scales(got, ga, n, copies, stride, format, power_of_2, *gpu_.stream);
        cpu_.ops->Float8Scales(want, ca, n, copies, stride, format, power_of_2, *cpu_.stream);
        ExpectSame(gpu_.Get(got, n), cpu_.Get(want, n), "Float8Scales" + at);
      }
    }
    gpu_.keep.clear();
    cpu_.keep.clear();
  }
}

// --- The products ---

struct ProductCase {
  int64_t N;
  int K, OC;
  bool bias, gelu, residual;
};

std::string Describe(const ProductCase& c, Float8Recipe recipe) {
  return std::string(" (") + kernels::Float8RecipeName(recipe) + ", N " + std::to_string(c.N) + ", K " +
         std::to_string(c.K) + ", OC " + std::to_string(c.OC) + (c.bias ? ", bias" : "") + (c.gelu ? ", gelu" : "") +
         (c.residual ? ", residual" : "") + ")";
}

// Forward, grad input and grad weight of both recipes against the emulation. The shapes:
// small ones; GPT-2's; and one whose fp32 sums (N x OC) pass the table's 64 MiB at once,
// so that its epilogues run over several ranges of rows (N 4112 = 4096 + 16).
TEST_F(CudaFloat8, ProductsMatchTheEmulation) {
  MESHTRAIN_SKIP_WITHOUT_FLOAT8();
  const ProductCase cases[] = {
      {64, 96, 384, false, false, false}, {64, 96, 384, true, false, false}, {64, 96, 384, true, true, false},
      {64, 96, 384, false, true, false},  {48, 64, 32, true, false, true},   {48, 64, 32, false, false, true},
      {512, 768, 2304, true, false, false}, {512, 3072, 768, true, false, true}, {512, 768, 3072, true, true, false},
      {4112, 128, 4096, true, false, false}, {16, 16, 16, false, false, false}};
  for (Float8Recipe recipe : {Float8Recipe::kTensorwise, Float8Recipe::kRowwise}) {
    for (const ProductCase& c : cases) {
      const std::string at = Describe(c, recipe);
      std::vector<double> x = Random(c.N * c.K), w = Random(int64_t(c.OC) * c.K, 0.05), b = Random(c.OC);
      const std::vector<double> r = Random(c.N * c.OC), dout = Random(c.N * c.OC, 0.01), pre = Random(c.N * c.K);
      const std::vector<double> dw0 = RandomFloat(int64_t(c.OC) * c.K), db0 = RandomFloat(c.OC);
      // A row of zeros (its rowwise scale is the largest there is) and an outlier are part
      // of every case.
      std::fill(x.begin() + c.K, x.begin() + 2 * c.K, 0.0);
      x[5] = 40.0;

      auto scales = [&](const std::vector<double>& t, int64_t rows, int64_t cols, Float8Operand operand) {
        return ScalesOf(t, rows, cols, Float8CastOf(recipe, operand));
      };
      const auto s_inp_fwd = scales(x, c.N, c.K, Float8Operand::kInpForward);
      // The forward's weight scales 16 times too large, so that its largest values pass the
      // format's range and saturate (448, __NV_SATFINITE), on both sides alike.
      auto s_w_fwd = scales(w, c.OC, c.K, Float8Operand::kWeightForward);
      for (double& s : s_w_fwd) s *= 16;
      const auto s_dout_gi = scales(dout, c.N, c.OC, Float8Operand::kDoutForGradInput);
      const auto s_w_gi = scales(w, c.OC, c.K, Float8Operand::kWeightForGradInput);
      const auto s_dout_gw = scales(dout, c.N, c.OC, Float8Operand::kDoutForGradWeight);
      const auto s_inp_gw = scales(x, c.N, c.K, Float8Operand::kInpForGradWeight);

      std::vector<double> results[2][6];  // [gpu, cpu][out, gelu_pre, dinp, dinp with GELU', dweight, dbias]
      OpsSide<Bf16>* sides[2] = {&gpu_, &cpu_};
      for (int t = 0; t < 2; ++t) {
        OpsSide<Bf16>& side = *sides[t];
        auto& ops = *side.ops;
        auto& stream = *side.stream;
        auto dx = side.Put<bf16>(x), dwt = side.Put<bf16>(w), ddout = side.Put<bf16>(dout);
        auto out = side.Poisoned<bf16>(c.N * c.OC);
        auto gelu_pre = c.gelu ? side.Poisoned<bf16>(c.N * c.OC) : nullptr;
        ops.Float8MatmulForward(out, gelu_pre, dx, side.Put<float>(s_inp_fwd), dwt, side.Put<float>(s_w_fwd),
                                c.bias ? side.Put<bf16>(b) : nullptr, c.residual ? side.Put<bf16>(r) : nullptr, c.N,
                                c.K, c.OC, recipe, stream);
        results[t][0] = side.Get(out, c.N * c.OC);
        if (c.gelu) results[t][1] = side.Get(gelu_pre, c.N * c.OC);

        auto ds_dout_gi = side.Put<float>(s_dout_gi), ds_w_gi = side.Put<float>(s_w_gi);
        auto dinp = side.Poisoned<bf16>(c.N * c.K);
        ops.Float8MatmulGradInput(dinp, ddout, ds_dout_gi, dwt, ds_w_gi, nullptr, c.N, c.K, c.OC, recipe, stream);
        results[t][2] = side.Get(dinp, c.N * c.K);
        if (c.gelu) {
          auto dinp_gelu = side.Poisoned<bf16>(c.N * c.K);
          ops.Float8MatmulGradInput(dinp_gelu, ddout, ds_dout_gi, dwt, ds_w_gi, side.Put<bf16>(pre), c.N, c.K, c.OC,
                                    recipe, stream);
          results[t][3] = side.Get(dinp_gelu, c.N * c.K);
        }

        auto dw = side.Put<float>(dw0), db = side.Put<float>(db0);
        ops.Float8MatmulGradWeight(dw, c.bias ? db : nullptr, ddout, side.Put<float>(s_dout_gw), dx,
                                   side.Put<float>(s_inp_gw), c.N, c.K, c.OC, recipe, stream);
        results[t][4] = side.Get(dw, int64_t(c.OC) * c.K);
        if (c.bias) results[t][5] = side.Get(db, c.OC);
        side.keep.clear();
      }
      // bf16 outputs: a rounding boundary crossed now and then (see the top); through GELU
      // more often, as the table's tanh is --use_fast_math's (MatmulForward's alike).
      const double gelu_tolerance = 5e-3;
      ExpectClose(results[0][0], results[1][0], "Float8MatmulForward out" + at, c.gelu ? gelu_tolerance : 2e-3);
      if (c.gelu) ExpectClose(results[0][1], results[1][1], "Float8MatmulForward gelu_pre" + at, 2e-3);
      ExpectClose(results[0][2], results[1][2], "Float8MatmulGradInput dinp" + at, 2e-3);
      if (c.gelu) {
        ExpectClose(results[0][3], results[1][3], "Float8MatmulGradInput dinp, through GELU'" + at, gelu_tolerance);
      }
      // fp32 sums in other orders, added to fp32.
      ExpectClose(results[0][4], results[1][4], "Float8MatmulGradWeight dweight (+=)" + at, 1e-5);
      if (c.bias) ExpectClose(results[0][5], results[1][5], "Float8MatmulGradWeight dbias (+=)" + at, 1e-5);
    }
  }
}

// The products' own checks: widths cuBLASLt's float8 products do not take, and the
// forward's residual with GELU; each refused before anything runs.
TEST_F(CudaFloat8, ProductsRefuseWidthsNotMultiplesOf16) {
  MESHTRAIN_SKIP_WITHOUT_FLOAT8();
  auto x = gpu_.Put<bf16>(Random(48 * 48)), w = gpu_.Put<bf16>(Random(48 * 48)), d = gpu_.Put<bf16>(Random(48 * 48));
  auto s = gpu_.Put<float>(std::vector<double>(48, 1.0));
  auto out = gpu_.Poisoned<bf16>(48 * 48);
  auto dw = gpu_.Put<float>(std::vector<double>(48 * 48, 0.0));
  auto& ops = *gpu_.ops;
  auto& stream = *gpu_.stream;
  for (Float8Recipe recipe : {Float8Recipe::kTensorwise, Float8Recipe::kRowwise}) {
    struct Shape {
      int64_t N;
      int K, OC;
    };
    for (const auto [N, K, OC] : {Shape{40, 48, 48}, Shape{48, 40, 48}, Shape{48, 48, 40}}) {
      const std::string at =
          " (N " + std::to_string(N) + ", K " + std::to_string(K) + ", OC " + std::to_string(OC) + ")";
      EXPECT_THROW(ops.Float8MatmulForward(out, nullptr, x, s, w, s, nullptr, nullptr, N, K, OC, recipe, stream),
                   std::invalid_argument)
          << "Float8MatmulForward" << at;
      EXPECT_THROW(ops.Float8MatmulGradInput(out, d, s, w, s, nullptr, N, K, OC, recipe, stream), std::invalid_argument)
          << "Float8MatmulGradInput" << at;
      EXPECT_THROW(ops.Float8MatmulGradWeight(dw, nullptr, d, s, x, s, N, K, OC, recipe, stream), std::invalid_argument)
          << "Float8MatmulGradWeight" << at;
    }
  }
  EXPECT_THROW(ops.Float8MatmulForward(out, out, x, s, w, s, nullptr, d, 48, 48, 48, Float8Recipe::kTensorwise, stream),
               std::invalid_argument);
  for (double v : gpu_.Get(out, 48 * 48)) ASSERT_TRUE(std::isnan(v)) << "a refused product wrote its output";
}

}  // namespace
}  // namespace meshtrain::testing
