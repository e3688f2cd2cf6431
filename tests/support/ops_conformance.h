// The kernel-table conformance suite (kernels/ops.h): every operation of a table against
// the CPU's Fp64 table, on random inputs (never zeros), at odd shapes (T = 37, a
// vocabulary of 1000 real rows padded to 1024 and of 50257 padded to 50304, head sizes
// 64 and 128, as many key/value heads as query heads, fewer, and one, widths that are
// not whole 128-bit vectors). Outputs that an operation writes are poisoned first (every byte 0xFF, a
// NaN), so an element left unwritten fails; outputs it accumulates into start from
// random values. Both sides get the same inputs: they are drawn, then rounded to the
// table's element types.
//
// A table is checked by instantiating the suite with a type that says how to make it:
//
//   struct CpuBf16 {
//     using Precision = kernels::Bf16;
//     static bool Available() { return true; }  // false: every test skips, saying why
//     static const char* Unavailable() { return ""; }
//     static std::unique_ptr<runtime::Backend> MakeBackend();
//     static std::unique_ptr<kernels::Ops<Precision>> MakeOps(runtime::Backend&, runtime::CachingAllocator*);
//     static constexpr double kTolerance = 1e-2;  // relative L2 error allowed, and why
//   };
//   INSTANTIATE_TYPED_TEST_SUITE_P(Cpu, OpsConformance, ::testing::Types<CpuBf16>);

#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "worker/kernels/cpu/cpu_ops.h"
#include "worker/kernels/dropout.h"
#include "worker/kernels/ops.h"
#include "worker/runtime/backend.h"
#include "worker/runtime/cpu_backend.h"
#include "worker/runtime/device_memory.h"

namespace meshtrain::testing {

// One side of a comparison: a backend, its allocator, a stream and a table.
template <class P>
struct OpsSide {
  using A = typename P::Act;
  using G = typename P::Acc;
  std::unique_ptr<runtime::Backend> backend;
  runtime::MemoryAccounting accounting;
  std::unique_ptr<runtime::CachingAllocator> allocator;
  std::unique_ptr<runtime::Stream> stream;
  std::unique_ptr<kernels::Ops<P>> ops;
  std::vector<std::shared_ptr<void>> keep;  // the device arrays of one test

  template <class T>
  runtime::DevicePtr<T> Put(const std::vector<double>& values) {
    auto array = std::make_shared<runtime::DeviceArray<T>>(allocator.get(), std::max<int64_t>(1, int64_t(values.size())),
                                                          runtime::MemoryCategory::kActivations);
    std::vector<T> host(values.size());
    for (size_t i = 0; i < values.size(); ++i) host[i] = Convert<T>(values[i]);
    backend->Upload(array->get(), host.data(), int64_t(host.size()), *stream);
    stream->Synchronize();
    keep.push_back(array);
    return array->get();
  }
  // An array of n elements poisoned with 0xFF bytes (NaN in every float type).
  template <class T>
  runtime::DevicePtr<T> Poisoned(int64_t n) {
    auto array = std::make_shared<runtime::DeviceArray<T>>(allocator.get(), std::max<int64_t>(1, n),
                                                          runtime::MemoryCategory::kActivations);
    backend->Fill(array->get(), 0xFF, array->bytes(), *stream);
    keep.push_back(array);
    return array->get();
  }
  // Raw elements (a table of segments), uploaded as they are.
  template <class T>
  runtime::DevicePtr<const T> PutRaw(const std::vector<T>& values) {
    auto array = std::make_shared<runtime::DeviceArray<T>>(allocator.get(), int64_t(values.size()),
                                                          runtime::MemoryCategory::kActivations);
    backend->Upload(array->get(), values.data(), int64_t(values.size()), *stream);
    stream->Synchronize();
    keep.push_back(array);
    return array->get();
  }
  template <class T>
  std::vector<double> Get(runtime::DevicePtr<T> from, int64_t n) {
    std::vector<std::remove_const_t<T>> host(static_cast<size_t>(n));
    backend->Download(host.data(), runtime::DevicePtr<const T>(from), n, *stream);
    stream->Synchronize();
    std::vector<double> values(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) values[size_t(i)] = ToDouble(host[size_t(i)]);
    return values;
  }

  template <class T>
  static T Convert(double x) {
    if constexpr (std::is_same_v<T, runtime::bf16>) return runtime::bf16(float(x));
    else return T(x);
  }
  template <class T>
  static double ToDouble(T x) {
    if constexpr (std::is_same_v<T, runtime::bf16>) return double(float(x));
    else return double(x);
  }
};

template <class Impl>
class OpsConformance : public ::testing::Test {
 protected:
  using P = typename Impl::Precision;
  using A = typename P::Act;
  using G = typename P::Acc;
  using RA = double;
  using RG = double;

  void SetUp() override {
    if (!Impl::Available()) GTEST_SKIP() << Impl::Unavailable();
    impl_.backend = Impl::MakeBackend();
    impl_.allocator = std::make_unique<runtime::CachingAllocator>(&impl_.accounting, impl_.backend->DeviceMemory());
    impl_.stream = impl_.backend->NewStream("conformance");
    impl_.ops = Impl::MakeOps(*impl_.backend, impl_.allocator.get());
    ref_.backend = std::make_unique<runtime::CpuBackend>();
    ref_.allocator = std::make_unique<runtime::CachingAllocator>(&ref_.accounting, ref_.backend->DeviceMemory());
    ref_.stream = ref_.backend->NewStream("reference");
    ref_.ops = kernels::MakeCpuOps<kernels::Fp64>();
  }
  void TearDown() override {
    if (impl_.stream) impl_.stream->Synchronize();
    impl_.keep.clear();
    ref_.keep.clear();
  }

  // n values of `scale` times a standard normal, rounded to what T stores: both sides
  // then see the same numbers. Never zero.
  template <class T>
  std::vector<double> Random(int64_t n, double scale = 1.0) {
    std::normal_distribution<double> normal(0.0, scale);
    std::vector<double> values(static_cast<size_t>(n));
    for (double& v : values) {
      do v = OpsSide<P>::ToDouble(OpsSide<P>::template Convert<T>(normal(rng_)));
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

  // ||got - want|| / ||want|| within the table's tolerance, and every element written.
  void ExpectClose(const std::vector<double>& got, const std::vector<double>& want, const std::string& what,
                   double tolerance = Impl::kTolerance) {
    ASSERT_EQ(got.size(), want.size()) << what;
    double diff = 0, norm = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_FALSE(std::isnan(got[i])) << what << ": element " << i << " was not written (or is NaN)";
      diff += (got[i] - want[i]) * (got[i] - want[i]);
      norm += want[i] * want[i];
    }
    ASSERT_GT(norm, 0) << what << ": the reference is all zeros, so the comparison would prove nothing";
    const double error = std::sqrt(diff / norm);
    EXPECT_LE(error, tolerance) << what << ": relative L2 error " << error << " on " << impl_.ops->Describe();
  }

  std::mt19937_64 rng_{20261124};
  OpsSide<P> impl_;
  OpsSide<kernels::Fp64> ref_;
};

TYPED_TEST_SUITE_P(OpsConformance);

TYPED_TEST_P(OpsConformance, Encoder) {
  using Act = typename TestFixture::A;
  using Acc = typename TestFixture::G;
  auto& impl = this->impl_;
  auto& ref = this->ref_;
  const int B = 2, T = 37, C = 96, Vp = 256;
  const int64_t v_begin = 100, v_rows = 150;  // a slice of 150 real rows in 256, of a vocabulary of 400
  const auto tokens = this->Tokens(B * T, 400), wte = this->template Random<Act>(Vp * C), wpe = this->template Random<Act>(T * C);
  for (bool positions : {true, false}) {
    auto out = impl.template Poisoned<Act>(B * T * C);
    impl.ops->EncoderForward(out, impl.template Put<int32_t>(tokens), impl.template Put<Act>(wte),
                             positions ? impl.template Put<Act>(wpe) : nullptr, B, T, C, v_begin, v_rows, *impl.stream);
    auto ref_out = ref.template Poisoned<double>(B * T * C);
    ref.ops->EncoderForward(ref_out, ref.template Put<int32_t>(tokens), ref.template Put<double>(wte),
                            positions ? ref.template Put<double>(wpe) : nullptr, B, T, C, v_begin, v_rows, *ref.stream);
    this->ExpectClose(impl.Get(out, B * T * C), ref.Get(ref_out, B * T * C), positions ? "EncoderForward" : "EncoderForward without wpe");
  }
  const auto dout = this->template Random<Act>(B * T * C), dwte0 = this->template Random<Acc>(Vp * C), dwpe0 = this->template Random<Acc>(T * C);
  auto dwte = impl.template Put<Acc>(dwte0), dwpe = impl.template Put<Acc>(dwpe0);
  impl.ops->EncoderBackward(dwte, dwpe, impl.template Put<Act>(dout), impl.template Put<int32_t>(tokens), B, T, C, v_begin, v_rows, *impl.stream);
  auto ref_dwte = ref.template Put<double>(dwte0), ref_dwpe = ref.template Put<double>(dwpe0);
  ref.ops->EncoderBackward(ref_dwte, ref_dwpe, ref.template Put<double>(dout), ref.template Put<int32_t>(tokens), B, T, C, v_begin, v_rows, *ref.stream);
  const auto got_dwte = impl.Get(dwte, Vp * C);
  this->ExpectClose(got_dwte, ref.Get(ref_dwte, Vp * C), "EncoderBackward dwte");
  this->ExpectClose(impl.Get(dwpe, T * C), ref.Get(ref_dwpe, T * C), "EncoderBackward dwpe");
  for (int64_t i = v_rows * C; i < Vp * C; ++i) {  // the padding rows never train
    ASSERT_EQ(got_dwte[size_t(i)], dwte0[size_t(i)]) << "EncoderBackward wrote padding row " << i / C;
  }
}

TYPED_TEST_P(OpsConformance, LayerNorm) {
  using Act = typename TestFixture::A;
  using Acc = typename TestFixture::G;
  auto& impl = this->impl_;
  auto& ref = this->ref_;
  for (const auto& [N, C] : {std::pair{74, 96}, std::pair{16, 768}}) {
    const auto x = this->template Random<Act>(N * C, 2.0), y = this->template Random<Act>(N * C), w = this->template Random<Act>(C),
               b = this->template Random<Act>(C);
    auto out = impl.template Poisoned<Act>(N * C);
    auto mean = impl.template Poisoned<Acc>(N), rstd = impl.template Poisoned<Acc>(N);
    impl.ops->LayerNormForward(out, mean, rstd, impl.template Put<Act>(x), impl.template Put<Act>(w), impl.template Put<Act>(b), N, C, *impl.stream);
    auto ref_out = ref.template Poisoned<double>(N * C);
    auto ref_mean = ref.template Poisoned<double>(N), ref_rstd = ref.template Poisoned<double>(N);
    ref.ops->LayerNormForward(ref_out, ref_mean, ref_rstd, ref.template Put<double>(x), ref.template Put<double>(w), ref.template Put<double>(b), N, C, *ref.stream);
    const std::string at = " (N " + std::to_string(N) + ", C " + std::to_string(C) + ")";
    this->ExpectClose(impl.Get(out, N * C), ref.Get(ref_out, N * C), "LayerNormForward out" + at);
    this->ExpectClose(impl.Get(mean, N), ref.Get(ref_mean, N), "LayerNormForward mean" + at);
    this->ExpectClose(impl.Get(rstd, N), ref.Get(ref_rstd, N), "LayerNormForward rstd" + at);

    // The residual as stored by the table, so the reference normalises the same numbers.
    auto residual = impl.template Poisoned<Act>(N * C);
    out = impl.template Poisoned<Act>(N * C);
    impl.ops->ResidualLayerNormForward(residual, out, mean, rstd, impl.template Put<Act>(x), impl.template Put<Act>(y),
                                       impl.template Put<Act>(w), impl.template Put<Act>(b), N, C, *impl.stream);
    const auto got_residual = impl.Get(residual, N * C);
    std::vector<double> sum(x.size());
    for (size_t i = 0; i < sum.size(); ++i) sum[i] = x[i] + y[i];
    this->ExpectClose(got_residual, sum, "ResidualLayerNormForward residual" + at);
    ref.ops->LayerNormForward(ref_out, ref_mean, ref_rstd, ref.template Put<double>(got_residual), ref.template Put<double>(w), ref.template Put<double>(b), N, C, *ref.stream);
    this->ExpectClose(impl.Get(out, N * C), ref.Get(ref_out, N * C), "ResidualLayerNormForward out" + at);

    const auto dout = this->template Random<Act>(N * C), dinp0 = this->template Random<Act>(N * C), dw0 = this->template Random<Acc>(C),
               db0 = this->template Random<Acc>(C);
    const auto m = impl.Get(mean, N), s = impl.Get(rstd, N);
    auto dinp = impl.template Put<Act>(dinp0);
    auto dw = impl.template Put<Acc>(dw0), db = impl.template Put<Acc>(db0);
    impl.ops->LayerNormBackward(dinp, dw, db, impl.template Put<Act>(dout), impl.template Put<Act>(got_residual), impl.template Put<Act>(w),
                                impl.template Put<Acc>(m), impl.template Put<Acc>(s), N, C, *impl.stream);
    auto ref_dinp = ref.template Put<double>(dinp0);
    auto ref_dw = ref.template Put<double>(dw0), ref_db = ref.template Put<double>(db0);
    ref.ops->LayerNormBackward(ref_dinp, ref_dw, ref_db, ref.template Put<double>(dout), ref.template Put<double>(got_residual),
                               ref.template Put<double>(w), ref.template Put<double>(m), ref.template Put<double>(s), N, C, *ref.stream);
    this->ExpectClose(impl.Get(dinp, N * C), ref.Get(ref_dinp, N * C), "LayerNormBackward dinp (+=)" + at);
    this->ExpectClose(impl.Get(dw, C), ref.Get(ref_dw, C), "LayerNormBackward dweight (+=)" + at);
    this->ExpectClose(impl.Get(db, C), ref.Get(ref_db, C), "LayerNormBackward dbias (+=)" + at);
  }
}

TYPED_TEST_P(OpsConformance, Matmul) {
  using Act = typename TestFixture::A;
  using Acc = typename TestFixture::G;
  auto& impl = this->impl_;
  auto& ref = this->ref_;
  struct Case {
    int64_t N;
    int K, OC;
    bool bias, gelu, residual;
  };
  for (const Case& c : {Case{74, 96, 288, true, false, false}, Case{74, 96, 288, true, false, true},
                       Case{74, 96, 384, true, true, false}, Case{37, 128, 1000, false, false, false},
                       Case{37, 128, 1000, false, false, true}, Case{256, 768, 3072, true, true, false}}) {
    const std::string at = " (N " + std::to_string(c.N) + ", K " + std::to_string(c.K) + ", OC " + std::to_string(c.OC) +
                           (c.bias ? ", bias" : "") + (c.gelu ? ", gelu" : "") + (c.residual ? ", residual" : "") + ")";
    const auto x = this->template Random<Act>(c.N * c.K), w = this->template Random<Act>(int64_t(c.OC) * c.K, 0.05),
               b = this->template Random<Act>(c.OC), r = this->template Random<Act>(c.N * c.OC);
    auto out = impl.template Poisoned<Act>(c.N * c.OC);
    auto pre = c.gelu ? impl.template Poisoned<Act>(c.N * c.OC) : nullptr;
    impl.ops->MatmulForward(out, pre, impl.template Put<Act>(x), impl.template Put<Act>(w), c.bias ? impl.template Put<Act>(b) : nullptr,
                            c.residual ? impl.template Put<Act>(r) : nullptr, c.N, c.K, c.OC, *impl.stream);
    auto ref_out = ref.template Poisoned<double>(c.N * c.OC);
    auto ref_pre = c.gelu ? ref.template Poisoned<double>(c.N * c.OC) : nullptr;
    ref.ops->MatmulForward(ref_out, ref_pre, ref.template Put<double>(x), ref.template Put<double>(w),
                           c.bias ? ref.template Put<double>(b) : nullptr, c.residual ? ref.template Put<double>(r) : nullptr,
                           c.N, c.K, c.OC, *ref.stream);
    this->ExpectClose(impl.Get(out, c.N * c.OC), ref.Get(ref_out, c.N * c.OC), "MatmulForward out" + at);
    std::vector<double> got_pre;
    if (c.gelu) {
      got_pre = impl.Get(pre, c.N * c.OC);
      this->ExpectClose(got_pre, ref.Get(ref_pre, c.N * c.OC), "MatmulForward gelu_pre" + at);
    }

    // Backward of a layer whose input was gelu(pre) when c.gelu: pre is (N, K) then.
    const auto dout = this->template Random<Act>(c.N * c.OC), dw0 = this->template Random<Acc>(int64_t(c.OC) * c.K),
               db0 = this->template Random<Acc>(c.OC), in_pre = this->template Random<Act>(c.N * c.K);
    auto dinp = impl.template Poisoned<Act>(c.N * c.K);
    auto dw = impl.template Put<Acc>(dw0), db = impl.template Put<Acc>(db0);
    impl.ops->MatmulBackward(dinp, dw, c.bias ? db : nullptr, impl.template Put<Act>(dout), impl.template Put<Act>(x), impl.template Put<Act>(w),
                             c.gelu ? impl.template Put<Act>(in_pre) : nullptr, c.N, c.K, c.OC, *impl.stream);
    auto ref_dinp = ref.template Poisoned<double>(c.N * c.K);
    auto ref_dw = ref.template Put<double>(dw0), ref_db = ref.template Put<double>(db0);
    ref.ops->MatmulBackward(ref_dinp, ref_dw, c.bias ? ref_db : nullptr, ref.template Put<double>(dout), ref.template Put<double>(x),
                            ref.template Put<double>(w), c.gelu ? ref.template Put<double>(in_pre) : nullptr, c.N, c.K, c.OC, *ref.stream);
    this->ExpectClose(impl.Get(dinp, c.N * c.K), ref.Get(ref_dinp, c.N * c.K), "MatmulBackward dinp" + at);
    this->ExpectClose(impl.Get(dw, int64_t(c.OC) * c.K), ref.Get(ref_dw, int64_t(c.OC) * c.K), "MatmulBackward dweight (+=)" + at);
    if (c.bias) this->ExpectClose(impl.Get(db, c.OC), ref.Get(ref_db, c.OC), "MatmulBackward dbias (+=)" + at);
  }
}

// Multi-head (KVH = NH), grouped-query (KVH < NH) and multi-query (KVH = 1) attention:
// the key/value heads' gradients sum over their groups.
TYPED_TEST_P(OpsConformance, Attention) {
  using Act = typename TestFixture::A;
  using Acc = typename TestFixture::G;
  auto& impl = this->impl_;
  auto& ref = this->ref_;
  struct Case {
    int B, T, NH, KVH, HS;
  };
  for (const Case& c : {Case{2, 37, 2, 2, 64}, Case{1, 64, 1, 1, 128}, Case{2, 128, 4, 4, 64}, Case{2, 37, 4, 2, 64},
                        Case{1, 64, 8, 1, 128}, Case{2, 37, 6, 2, 32}}) {
    const int64_t rows = int64_t(c.B) * c.T, width = int64_t(c.NH + 2 * c.KVH) * c.HS, Q = int64_t(c.NH) * c.HS;
    const std::string at = " (B " + std::to_string(c.B) + ", T " + std::to_string(c.T) + ", " + std::to_string(c.NH) +
                           " query heads and " + std::to_string(c.KVH) + " key/value heads of " + std::to_string(c.HS) +
                           ")";
    const auto qkv = this->template Random<Act>(rows * width), dout = this->template Random<Act>(rows * Q);
    impl.ops->Attention(c.B, c.T, c.NH, c.KVH, c.HS);
    const int64_t state_n = impl.ops->AttentionStateElements(c.B, c.T, c.NH, c.KVH, c.HS);
    const int64_t scratch_n = impl.ops->AttentionScratchBytes(c.B, c.T, c.NH, c.KVH, c.HS);
    auto out = impl.template Poisoned<Act>(rows * Q);
    auto state = impl.template Poisoned<Acc>(state_n);
    auto scratch = impl.template Poisoned<std::byte>(scratch_n);
    auto dqkv = impl.template Poisoned<Act>(rows * width);
    auto impl_qkv = impl.template Put<Act>(qkv);
    impl.ops->AttentionForward(out, state, impl_qkv, c.B, c.T, c.NH, c.KVH, c.HS, *impl.stream);
    impl.ops->AttentionBackward(dqkv, scratch, impl.template Put<Act>(dout), impl_qkv, out, state, c.B, c.T, c.NH,
                                c.KVH, c.HS, *impl.stream);
    auto ref_out = ref.template Poisoned<double>(rows * Q);
    auto ref_state = ref.template Poisoned<double>(ref.ops->AttentionStateElements(c.B, c.T, c.NH, c.KVH, c.HS));
    auto ref_dqkv = ref.template Poisoned<double>(rows * width);
    auto ref_qkv = ref.template Put<double>(qkv);
    ref.ops->AttentionForward(ref_out, ref_state, ref_qkv, c.B, c.T, c.NH, c.KVH, c.HS, *ref.stream);
    ref.ops->AttentionBackward(ref_dqkv, nullptr, ref.template Put<double>(dout), ref_qkv, ref_out, ref_state, c.B, c.T,
                               c.NH, c.KVH, c.HS, *ref.stream);
    this->ExpectClose(impl.Get(out, rows * Q), ref.Get(ref_out, rows * Q), "AttentionForward" + at);
    // q, k and v's gradients apart, so that a wrong group sum shows as itself.
    const auto got = impl.Get(dqkv, rows * width), want = ref.Get(ref_dqkv, rows * width);
    const char* parts[3] = {"dq", "dk", "dv"};
    for (int part = 0; part < 3; ++part) {
      const int64_t begin = part == 0 ? 0 : Q + (part - 1) * int64_t(c.KVH) * c.HS;
      const int64_t end = part == 0 ? Q : begin + int64_t(c.KVH) * c.HS;
      std::vector<double> got_part, want_part;
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t i = begin; i < end; ++i) {
          got_part.push_back(got[size_t(r * width + i)]);
          want_part.push_back(want[size_t(r * width + i)]);
        }
      }
      this->ExpectClose(got_part, want_part, std::string("AttentionBackward ") + parts[part] + at);
    }
  }
}

// The residual stream's norm of the Llama class, at widths of 96, 768 and an odd 333,
// with two epsilons.
TYPED_TEST_P(OpsConformance, RmsNorm) {
  using Act = typename TestFixture::A;
  using Acc = typename TestFixture::G;
  auto& impl = this->impl_;
  auto& ref = this->ref_;
  for (const auto& [N, C, eps] : {std::tuple{74, 96, 1e-5f}, std::tuple{16, 768, 1e-6f}, std::tuple{37, 333, 1e-5f}}) {
    const auto x = this->template Random<Act>(N * C, 2.0), y = this->template Random<Act>(N * C),
               w = this->template Random<Act>(C);
    auto out = impl.template Poisoned<Act>(N * C);
    auto rstd = impl.template Poisoned<Acc>(N);
    impl.ops->RmsNormForward(out, rstd, impl.template Put<Act>(x), impl.template Put<Act>(w), N, C, eps, *impl.stream);
    auto ref_out = ref.template Poisoned<double>(N * C);
    auto ref_rstd = ref.template Poisoned<double>(N);
    ref.ops->RmsNormForward(ref_out, ref_rstd, ref.template Put<double>(x), ref.template Put<double>(w), N, C, eps,
                            *ref.stream);
    const std::string at = " (N " + std::to_string(N) + ", C " + std::to_string(C) + ")";
    this->ExpectClose(impl.Get(out, N * C), ref.Get(ref_out, N * C), "RmsNormForward out" + at);
    this->ExpectClose(impl.Get(rstd, N), ref.Get(ref_rstd, N), "RmsNormForward rstd" + at);

    // The residual as stored by the table, so the reference normalises the same numbers;
    // once into a new array and once in place over a.
    for (bool in_place : {false, true}) {
      const std::string how = in_place ? ", residual over a" : "";
      auto a = impl.template Put<Act>(x);
      auto residual = in_place ? a : impl.template Poisoned<Act>(N * C);
      out = impl.template Poisoned<Act>(N * C);
      rstd = impl.template Poisoned<Acc>(N);
      impl.ops->ResidualRmsNormForward(residual, out, rstd, a, impl.template Put<Act>(y), impl.template Put<Act>(w), N,
                                       C, eps, *impl.stream);
      const auto got_residual = impl.Get(residual, N * C);
      std::vector<double> sum(x.size());
      for (size_t i = 0; i < sum.size(); ++i) sum[i] = x[i] + y[i];
      this->ExpectClose(got_residual, sum, "ResidualRmsNormForward residual" + at + how);
      ref.ops->RmsNormForward(ref_out, ref_rstd, ref.template Put<double>(got_residual), ref.template Put<double>(w), N,
                              C, eps, *ref.stream);
      this->ExpectClose(impl.Get(out, N * C), ref.Get(ref_out, N * C), "ResidualRmsNormForward out" + at + how);
      this->ExpectClose(impl.Get(rstd, N), ref.Get(ref_rstd, N), "ResidualRmsNormForward rstd" + at + how);
    }

    // dinp and dweight accumulate (+=) into random values.
    const auto dout = this->template Random<Act>(N * C), dinp0 = this->template Random<Act>(N * C),
               dw0 = this->template Random<Acc>(C);
    // The table's own rstd of x, as the engine hands the backward what its forward kept.
    impl.ops->RmsNormForward(out, rstd, impl.template Put<Act>(x), impl.template Put<Act>(w), N, C, eps, *impl.stream);
    const auto s_x = impl.Get(rstd, N);
    auto dinp = impl.template Put<Act>(dinp0);
    auto dw = impl.template Put<Acc>(dw0);
    impl.ops->RmsNormBackward(dinp, dw, impl.template Put<Act>(dout), impl.template Put<Act>(x),
                              impl.template Put<Act>(w), impl.template Put<Acc>(s_x), N, C, *impl.stream);
    auto ref_dinp = ref.template Put<double>(dinp0);
    auto ref_dw = ref.template Put<double>(dw0);
    ref.ops->RmsNormBackward(ref_dinp, ref_dw, ref.template Put<double>(dout), ref.template Put<double>(x),
                             ref.template Put<double>(w), ref.template Put<double>(s_x), N, C, *ref.stream);
    this->ExpectClose(impl.Get(dinp, N * C), ref.Get(ref_dinp, N * C), "RmsNormBackward dinp (+=)" + at);
    this->ExpectClose(impl.Get(dw, C), ref.Get(ref_dw, C), "RmsNormBackward dweight (+=)" + at);
  }
}

// RoPE in place on the q and k heads of qkv, with transformers' Llama tables (angle t *
// 10000^(-2i/HS)): forward and backward against the reference, v left as it was (bit for
// bit), and the backward undoing the forward. Head sizes 64, 128 and 20 (half of it not
// a whole 128-bit vector).
TYPED_TEST_P(OpsConformance, Rope) {
  using Act = typename TestFixture::A;
  using Acc = typename TestFixture::G;
  using Side = OpsSide<typename TestFixture::P>;
  auto& impl = this->impl_;
  auto& ref = this->ref_;
  struct Case {
    int B, T, NH, KVH, HS;
  };
  for (const Case& c : {Case{2, 37, 4, 2, 64}, Case{1, 64, 8, 1, 128}, Case{2, 37, 3, 3, 20}}) {
    const int half = c.HS / 2;
    const int64_t rows = int64_t(c.B) * c.T, width = int64_t(c.NH + 2 * c.KVH) * c.HS;
    const int64_t v_begin = int64_t(c.NH + c.KVH) * c.HS, n = rows * width;
    const std::string at = " (B " + std::to_string(c.B) + ", T " + std::to_string(c.T) + ", " + std::to_string(c.NH) +
                           " query heads and " + std::to_string(c.KVH) + " key/value heads of " + std::to_string(c.HS) +
                           ")";
    std::vector<double> cos(size_t(c.T) * half), sin(size_t(c.T) * half);
    for (int t = 0; t < c.T; ++t) {
      for (int i = 0; i < half; ++i) {
        const double angle = t * std::pow(10000.0, -2.0 * i / c.HS);
        cos[size_t(t) * half + i] = Side::ToDouble(Side::template Convert<Acc>(std::cos(angle)));
        sin[size_t(t) * half + i] = Side::ToDouble(Side::template Convert<Acc>(std::sin(angle)));
      }
    }
    const auto qkv = this->template Random<Act>(n), dqkv = this->template Random<Act>(n);
    auto impl_cos = impl.template Put<Acc>(cos), impl_sin = impl.template Put<Acc>(sin);
    auto ref_cos = ref.template Put<double>(cos), ref_sin = ref.template Put<double>(sin);
    auto expect_v_untouched = [&](const std::vector<double>& got, const std::vector<double>& before,
                                  const std::string& what) {
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t i = v_begin; i < width; ++i) {
          ASSERT_EQ(got[size_t(r * width + i)], before[size_t(r * width + i)])
              << what << " changed v at row " << r << ", channel " << i << at;
        }
      }
    };

    auto x = impl.template Put<Act>(qkv);
    impl.ops->RopeForward(x, impl_cos, impl_sin, c.B, c.T, c.NH, c.KVH, c.HS, *impl.stream);
    auto ref_x = ref.template Put<double>(qkv);
    ref.ops->RopeForward(ref_x, ref_cos, ref_sin, c.B, c.T, c.NH, c.KVH, c.HS, *ref.stream);
    const auto rotated = impl.Get(x, n);
    this->ExpectClose(rotated, ref.Get(ref_x, n), "RopeForward" + at);
    expect_v_untouched(rotated, qkv, "RopeForward");

    auto d = impl.template Put<Act>(dqkv);
    impl.ops->RopeBackward(d, impl_cos, impl_sin, c.B, c.T, c.NH, c.KVH, c.HS, *impl.stream);
    auto ref_d = ref.template Put<double>(dqkv);
    ref.ops->RopeBackward(ref_d, ref_cos, ref_sin, c.B, c.T, c.NH, c.KVH, c.HS, *ref.stream);
    const auto got_d = impl.Get(d, n);
    this->ExpectClose(got_d, ref.Get(ref_d, n), "RopeBackward" + at);
    expect_v_untouched(got_d, dqkv, "RopeBackward");

    // Rotating back by the same angle: what went in, up to the rounding of each store.
    impl.ops->RopeBackward(x, impl_cos, impl_sin, c.B, c.T, c.NH, c.KVH, c.HS, *impl.stream);
    this->ExpectClose(impl.Get(x, n), qkv, "RopeBackward of RopeForward" + at);
  }
}

// SwiGLU at a width of whole 128-bit vectors and at an odd one.
TYPED_TEST_P(OpsConformance, SwiGlu) {
  using Act = typename TestFixture::A;
  auto& impl = this->impl_;
  auto& ref = this->ref_;
  for (const auto& [N, H] : {std::pair{74, 96}, std::pair{37, 333}}) {
    const std::string at = " (N " + std::to_string(N) + ", H " + std::to_string(H) + ")";
    const auto gate_up = this->template Random<Act>(int64_t(N) * 2 * H, 2.0),
               dout = this->template Random<Act>(int64_t(N) * H);
    auto out = impl.template Poisoned<Act>(int64_t(N) * H);
    auto impl_gate_up = impl.template Put<Act>(gate_up);
    impl.ops->SwiGluForward(out, impl_gate_up, N, H, *impl.stream);
    auto ref_out = ref.template Poisoned<double>(int64_t(N) * H);
    auto ref_gate_up = ref.template Put<double>(gate_up);
    ref.ops->SwiGluForward(ref_out, ref_gate_up, N, H, *ref.stream);
    this->ExpectClose(impl.Get(out, int64_t(N) * H), ref.Get(ref_out, int64_t(N) * H), "SwiGluForward" + at);

    auto dgate_up = impl.template Poisoned<Act>(int64_t(N) * 2 * H);
    impl.ops->SwiGluBackward(dgate_up, impl.template Put<Act>(dout), impl_gate_up, N, H, *impl.stream);
    auto ref_dgate_up = ref.template Poisoned<double>(int64_t(N) * 2 * H);
    ref.ops->SwiGluBackward(ref_dgate_up, ref.template Put<double>(dout), ref_gate_up, N, H, *ref.stream);
    const auto got = impl.Get(dgate_up, int64_t(N) * 2 * H), want = ref.Get(ref_dgate_up, int64_t(N) * 2 * H);
    for (int half = 0; half < 2; ++half) {  // the gate's gradient, then the up's
      std::vector<double> got_half, want_half;
      for (int64_t r = 0; r < N; ++r) {
        for (int64_t j = 0; j < H; ++j) {
          got_half.push_back(got[size_t(r * 2 * H + half * H + j)]);
          want_half.push_back(want[size_t(r * 2 * H + half * H + j)]);
        }
      }
      this->ExpectClose(got_half, want_half, std::string(half ? "SwiGluBackward dup" : "SwiGluBackward dgate") + at);
    }
  }
}

TYPED_TEST_P(OpsConformance, AddAndDropout) {
  using Act = typename TestFixture::A;
  auto& impl = this->impl_;
  auto& ref = this->ref_;
  const int64_t rows = 37, width = 48, stride = 96, first_row = 1000, first_column = 48;
  const auto a = this->template Random<Act>(rows * width), b = this->template Random<Act>(rows * width);
  auto out = impl.template Poisoned<Act>(rows * width);
  impl.ops->Add(out, impl.template Put<Act>(a), impl.template Put<Act>(b), rows * width, *impl.stream);
  auto ref_out = ref.template Poisoned<double>(rows * width);
  ref.ops->Add(ref_out, ref.template Put<double>(a), ref.template Put<double>(b), rows * width, *ref.stream);
  this->ExpectClose(impl.Get(out, rows * width), ref.Get(ref_out, rows * width), "Add");

  const uint64_t key = kernels::MixKey(7, 3);
  auto x = impl.template Put<Act>(a);
  auto y = impl.template Poisoned<Act>(rows * width);
  impl.ops->Dropout(y, x, rows, int(width), 0.25f, key, first_row, stride, first_column, *impl.stream);
  impl.ops->Dropout(x, x, rows, int(width), 0.25f, key, first_row, stride, first_column, *impl.stream);  // in place
  EXPECT_EQ(impl.Get(x, rows * width), impl.Get(y, rows * width)) << "Dropout in place and out of place";
  const auto dropped = impl.Get(y, rows * width);
  int64_t zeros = 0;
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < width; ++j) {
      const bool keep = kernels::DropoutKeeps(key, uint64_t((first_row + i) * stride + first_column + j), 0.25f);
      const double got = dropped[size_t(i * width + j)], want = keep ? a[size_t(i * width + j)] / 0.75 : 0.0;
      zeros += got == 0;
      ASSERT_EQ(got == 0, !keep) << "Dropout's mask differs at (" << i << ", " << j << ")";
      EXPECT_NEAR(got, want, std::abs(want) * TypeParam::kTolerance) << "Dropout's scaling at (" << i << ", " << j << ")";
    }
  }
  EXPECT_GT(zeros, rows * width / 8) << "about a quarter dropped";
  EXPECT_LT(zeros, rows * width * 3 / 8) << "about a quarter dropped";
}

TYPED_TEST_P(OpsConformance, CrossEntropy) {
  using Act = typename TestFixture::A;
  using Acc = typename TestFixture::G;
  auto& impl = this->impl_;
  auto& ref = this->ref_;
  for (const auto& [R, v_rows, Vp] : {std::tuple<int64_t, int64_t, int64_t>{37, 1000, 1024}, {8, 50257, 50304}}) {
    const std::string at = " (" + std::to_string(R) + " rows, " + std::to_string(v_rows) + " of " + std::to_string(Vp) + " columns)";
    auto logits = this->template Random<Act>(R * Vp, 2.0);
    auto targets = this->Tokens(R, int32_t(v_rows));
    for (int64_t r = 2; r < R; r += 5) targets[size_t(r)] = -1;  // masked: no loss, no gradient
    const float dloss = 1.0f / 64;
    for (bool gradient : {false, true}) {
      auto losses = impl.template Poisoned<Acc>(R);
      auto impl_logits = impl.template Put<Act>(logits);
      impl.ops->CrossEntropy(losses, gradient ? impl_logits : nullptr, impl_logits, impl.template Put<int32_t>(targets), R, v_rows, Vp,
                             dloss, *impl.stream);  // the gradient in place over the logits
      auto ref_losses = ref.template Poisoned<double>(R);
      auto ref_dlogits = ref.template Poisoned<double>(R * Vp);
      ref.ops->CrossEntropy(ref_losses, gradient ? ref_dlogits : nullptr, ref.template Put<double>(logits), ref.template Put<int32_t>(targets),
                            R, v_rows, Vp, dloss, *ref.stream);
      const auto got_losses = impl.Get(losses, R);
      this->ExpectClose(got_losses, ref.Get(ref_losses, R), std::string("CrossEntropy losses") + at);
      for (int64_t r = 2; r < R; r += 5) ASSERT_EQ(got_losses[size_t(r)], 0.0) << "masked row " << r << at;
      if (!gradient) continue;
      const auto got = impl.Get(impl_logits, R * Vp);
      this->ExpectClose(got, ref.Get(ref_dlogits, R * Vp), "CrossEntropy dlogits, in place" + at);
      for (int64_t r = 0; r < R; ++r) {
        for (int64_t c = v_rows; c < Vp; ++c) ASSERT_EQ(got[size_t(r * Vp + c)], 0.0) << "padding column " << c << at;
        if (targets[size_t(r)] >= 0) continue;
        for (int64_t c = 0; c < Vp; ++c) ASSERT_EQ(got[size_t(r * Vp + c)], 0.0) << "masked row " << r << at;
      }
    }
  }
}

// The vocabulary in two slices (500 and 501 real rows, each padded to 512): the slices'
// losses and gradients must be the whole vocabulary's (by the reference's CrossEntropy).
TYPED_TEST_P(OpsConformance, VocabSlices) {
  using Act = typename TestFixture::A;
  using Acc = typename TestFixture::G;
  auto& impl = this->impl_;
  auto& ref = this->ref_;
  const int64_t R = 37, Vp = 512, rows[2] = {500, 501}, V = rows[0] + rows[1];
  const auto whole = this->template Random<Act>(R * V, 2.0);
  auto targets = this->Tokens(R, int32_t(V));
  for (int64_t r = 3; r < R; r += 7) targets[size_t(r)] = -1;  // masked: no loss, no gradient on any slice
  const float dloss = 0.5f;
  std::vector<double> slice[2];
  for (int s = 0; s < 2; ++s) {
    slice[s].assign(size_t(R * Vp), 0.125);  // the padding: values that must not count
    for (int64_t r = 0; r < R; ++r) {
      for (int64_t c = 0; c < rows[s]; ++c) slice[s][size_t(r * Vp + c)] = whole[size_t(r * V + (s ? rows[0] : 0) + c)];
    }
  }
  auto device_targets = impl.template Put<int32_t>(targets);
  auto all_stats = impl.template Poisoned<Acc>(2 * R * 3);
  for (int s = 0; s < 2; ++s) {
    impl.ops->VocabSliceStats(all_stats + s * R * 3, impl.template Put<Act>(slice[s]), device_targets, R, rows[s], Vp,
                              s ? rows[0] : 0, *impl.stream);
  }
  auto ref_losses = ref.template Poisoned<double>(R);
  auto ref_dlogits = ref.template Poisoned<double>(R * V);
  ref.ops->CrossEntropy(ref_losses, ref_dlogits, ref.template Put<double>(whole), ref.template Put<int32_t>(targets), R, V, V, dloss, *ref.stream);
  const auto want_losses = ref.Get(ref_losses, R), want_dlogits = ref.Get(ref_dlogits, R * V);
  for (int s = 0; s < 2; ++s) {
    auto losses = impl.template Poisoned<Acc>(R);
    auto logits = impl.template Put<Act>(slice[s]);
    impl.ops->VocabSliceCrossEntropy(losses, logits, logits, all_stats, 2, device_targets, R, rows[s], Vp, s ? rows[0] : 0,
                                     dloss, *impl.stream);
    const auto got_losses = impl.Get(losses, R);
    this->ExpectClose(got_losses, want_losses, "VocabSliceCrossEntropy losses, slice " + std::to_string(s));
    const auto got = impl.Get(logits, R * Vp);
    for (int64_t r = 3; r < R; r += 7) {
      ASSERT_EQ(got_losses[size_t(r)], 0.0) << "masked row " << r;
      for (int64_t c = 0; c < Vp; ++c) ASSERT_EQ(got[size_t(r * Vp + c)], 0.0) << "masked row " << r;
    }
    std::vector<double> got_real, want_real;
    for (int64_t r = 0; r < R; ++r) {
      for (int64_t c = 0; c < rows[s]; ++c) {
        got_real.push_back(got[size_t(r * Vp + c)]);
        want_real.push_back(want_dlogits[size_t(r * V + (s ? rows[0] : 0) + c)]);
      }
      for (int64_t c = rows[s]; c < Vp; ++c) ASSERT_EQ(got[size_t(r * Vp + c)], 0.0) << "padding column " << c;
    }
    this->ExpectClose(got_real, want_real, "VocabSliceCrossEntropy dlogits, slice " + std::to_string(s));
  }
}

TYPED_TEST_P(OpsConformance, ShardOperations) {
  using Act = typename TestFixture::A;
  using Acc = typename TestFixture::G;
  auto& impl = this->impl_;
  auto& ref = this->ref_;
  const int64_t n = 100003;
  const auto losses = this->template Random<Acc>(777), into = this->template Random<Acc>(n), from = this->template Random<Acc>(n);
  auto sum = impl.template Put<double>({1.5});
  impl.ops->AddLoss(sum, impl.template Put<Acc>(losses), 777, 0.25, *impl.stream);
  auto ref_sum = ref.template Put<double>({1.5});
  ref.ops->AddLoss(ref_sum, ref.template Put<double>(losses), 777, 0.25, *ref.stream);
  this->ExpectClose(impl.Get(sum, 1), ref.Get(ref_sum, 1), "AddLoss", 1e-6);

  auto acc = impl.template Put<Acc>(into);
  impl.ops->Accumulate(acc, impl.template Put<Acc>(from), n, 1.0f, *impl.stream);
  auto ref_acc = ref.template Put<double>(into);
  ref.ops->Accumulate(ref_acc, ref.template Put<double>(from), n, 1.0f, *ref.stream);
  this->ExpectClose(impl.Get(acc, n), ref.Get(ref_acc, n), "Accumulate", 1e-6);
  impl.ops->Accumulate(acc, impl.template Put<Acc>(from), n, 0.25f, *impl.stream);  // += a quarter more
  ref.ops->Accumulate(ref_acc, ref.template Put<double>(from), n, 0.25f, *ref.stream);
  this->ExpectClose(impl.Get(acc, n), ref.Get(ref_acc, n), "Accumulate (scaled)", 1e-6);

  auto cast = impl.template Poisoned<Act>(n);
  impl.ops->Cast(cast, impl.template Put<Acc>(from), n, *impl.stream);
  this->ExpectClose(impl.Get(cast, n), from, "Cast");

  // Segments: two in the norm, one not, and a gap that belongs to none.
  const std::vector<kernels::ShardSegment> segments = {{0, 30000, 1, 1}, {30000, 20000, 0, 1}, {50000, 40000, 1, 0}};
  const int64_t covered = 90000;
  const auto seg_bytes = [&](auto& side) { return side.PutRaw(segments); };
  auto squares = impl.template Put<double>({2.0});
  impl.ops->SumSquares(squares, impl.template Put<Acc>(from), seg_bytes(impl), 3, *impl.stream);
  auto ref_squares = ref.template Put<double>({2.0});
  ref.ops->SumSquares(ref_squares, ref.template Put<double>(from), seg_bytes(ref), 3, *ref.stream);
  this->ExpectClose(impl.Get(squares, 1), ref.Get(ref_squares, 1), "SumSquares", 1e-6);

  for (const auto& [sum_of_squares, max_norm, want] : {std::tuple{16.0, 1.0f, 0.25}, {0.25, 1.0f, 1.0}, {16.0, 0.0f, 1.0}}) {
    auto scale = impl.template Poisoned<float>(1);
    impl.ops->ClipScale(scale, impl.template Put<double>({sum_of_squares}), max_norm, *impl.stream);
    EXPECT_NEAR(impl.Get(scale, 1)[0], want, 1e-7) << "ClipScale of norm " << std::sqrt(sum_of_squares) << " to " << max_norm;
  }

  kernels::AdamWStep step;
  step.learning_rate = 1e-3f, step.weight_decay = 0.1f, step.t = 3;
  const auto master0 = this->template Random<Acc>(n), m0 = this->template Random<Acc>(n, 0.01), v0 = this->template Random<Acc>(n, 0.01);
  std::vector<double> v_positive = v0;
  for (double& x : v_positive) x = std::abs(x);
  for (bool with_params : {true, false}) {
    auto master = impl.template Put<Acc>(master0), m = impl.template Put<Acc>(m0), v = impl.template Put<Acc>(v_positive);
    auto params = with_params ? impl.template Poisoned<Act>(n) : nullptr;
    impl.ops->AdamW(master, params, impl.template Put<Acc>(from), m, v, seg_bytes(impl), 3, step, impl.template Put<float>({0.5}), *impl.stream);
    auto ref_master = ref.template Put<double>(master0), ref_m = ref.template Put<double>(m0), ref_v = ref.template Put<double>(v_positive);
    ref.ops->AdamW(ref_master, nullptr, ref.template Put<double>(from), ref_m, ref_v, seg_bytes(ref), 3, step,
                   ref.template Put<float>({0.5}), *ref.stream);
    const auto got_master = impl.Get(master, n), want_master = ref.Get(ref_master, n);
    this->ExpectClose(got_master, want_master, "AdamW master", 1e-6);
    this->ExpectClose(impl.Get(m, n), ref.Get(ref_m, n), "AdamW m", 1e-6);
    this->ExpectClose(impl.Get(v, n), ref.Get(ref_v, n), "AdamW v", 1e-6);
    for (int64_t i = covered; i < n; ++i) ASSERT_EQ(got_master[size_t(i)], master0[size_t(i)]) << "AdamW touched the gap at " << i;
    if (with_params) {
      const auto got_params = impl.Get(params, n);
      for (int64_t i = 0; i < covered; ++i) {
        ASSERT_EQ(got_params[size_t(i)], OpsSide<typename TestFixture::P>::ToDouble(OpsSide<typename TestFixture::P>::template Convert<Act>(got_master[size_t(i)])))
            << "AdamW's compute copy at " << i;
      }
    }
  }
}

REGISTER_TYPED_TEST_SUITE_P(OpsConformance, Encoder, LayerNorm, RmsNorm, Matmul, Attention, Rope, SwiGlu, AddAndDropout,
                            CrossEntropy, VocabSlices, ShardOperations);

}  // namespace meshtrain::testing
