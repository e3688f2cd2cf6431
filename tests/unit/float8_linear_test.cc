// Float8 training's linear layers (model/layers.h, kernels/ops.h "Float8 products"):
// - the CPU tables' float8 products are cpu/float8_matmul.h's products followed by
//   MatmulForward's and MatmulBackward's epilogues, the fp32 table bit for bit and the bf16
//   emulation within bf16's rounding of what it stores;
// - the table's amax and scales are cpu::Float8Amax's and kernels::Float8Scale's, the
//   scales of gathered copies those of their max;
// - under tensor parallelism, the scales each TP rank casts with are those of the whole
//   logical operand, bit for bit, for both recipes, every product and both splits: the
//   ranks run on two threads with a TP group that gathers through host memory.

#include <gtest/gtest.h>

#include <barrier>
#include <cmath>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "worker/kernels/cpu/cpu_ops.h"
#include "worker/kernels/cpu/float8_matmul.h"
#include "worker/model/layers.h"
#include "worker/runtime/cpu_backend.h"
#include "worker/runtime/device_memory.h"
#include "worker/runtime/device_side.h"

namespace meshtrain::float8_linear_test {
namespace {

using kernels::Float8Recipe;
using kernels::Fp32;
using runtime::DeviceSide;

// One table on the CPU backend, with host views of its arrays.
template <class P>
struct Side {
  runtime::MemoryAccounting accounting;
  std::unique_ptr<runtime::Backend> backend = std::make_unique<runtime::CpuBackend>();
  runtime::CachingAllocator allocator{&accounting, backend->DeviceMemory()};
  std::unique_ptr<runtime::Stream> stream = backend->NewStream("float8");
  std::unique_ptr<kernels::Ops<P>> ops = kernels::MakeCpuOps<P>();
  std::vector<std::shared_ptr<void>> keep;

  template <class T>
  runtime::DevicePtr<T> Put(const std::vector<T>& values) {
    auto array = std::make_shared<runtime::DeviceArray<T>>(&allocator, std::max<int64_t>(1, int64_t(values.size())),
                                                          runtime::MemoryCategory::kActivations);
    backend->Upload(array->get(), values.data(), int64_t(values.size()), *stream);
    stream->Synchronize();  // values may go before the stream would read them
    keep.push_back(array);
    return array->get();
  }
  template <class T>
  runtime::DevicePtr<T> Zeros(int64_t n) {
    return Put(std::vector<T>(size_t(n), T(0.0f)));
  }
  template <class T>
  std::vector<T> Get(runtime::DevicePtr<T> from, int64_t n) {
    stream->Synchronize();
    const T* at = DeviceSide::Address(from);
    return std::vector<T>(at, at + n);
  }
};

std::vector<float> Random(std::mt19937& rng, int64_t n, float spread = 1.0f) {
  std::normal_distribution<float> normal(0.0f, spread);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = normal(rng);
  return v;
}

// --- The CPU tables' products ---

constexpr int64_t N = 24;
constexpr int K = 40, OC = 32;

struct Operands {
  std::vector<float> inp, weight, dout, bias, residual;
};

Operands MakeOperands() {
  std::mt19937 rng(56);
  return {Random(rng, N * K), Random(rng, int64_t(OC) * K, 0.05f), Random(rng, N * OC, 1e-3f), Random(rng, OC),
          Random(rng, N * OC)};
}

// Scales of an operand (rows,cols) as `recipe` casts it into `operand`'s product.
std::vector<float> ScalesFor(const std::vector<float>& x, int64_t rows, int64_t cols, Float8Recipe recipe,
                             kernels::Float8Operand operand) {
  const kernels::Float8Cast cast = kernels::Float8CastOf(recipe, operand);
  std::vector<float> amax(size_t(kernels::Float8ScaleCount(cast.scaling, rows, cols)));
  kernels::cpu::Float8Amax(amax.data(), x.data(), rows, cols, cast.scaling);
  std::vector<float> scale(amax.size());
  kernels::cpu::Float8Scales(scale.data(), amax.data(), int64_t(amax.size()), cast.format, cast.power_of_2_scales);
  return scale;
}

TEST(Float8Products, Fp32TableIsTheEmulationThenTheEpilogues) {
  const Operands o = MakeOperands();
  using kernels::Float8Operand;
  for (Float8Recipe recipe : {Float8Recipe::kTensorwise, Float8Recipe::kRowwise}) {
    SCOPED_TRACE(kernels::Float8RecipeName(recipe));
    Side<Fp32> side;
    const auto si = ScalesFor(o.inp, N, K, recipe, Float8Operand::kInpForward);
    const auto sw = ScalesFor(o.weight, OC, K, recipe, Float8Operand::kWeightForward);
    std::vector<float> product(size_t(N * OC));
    kernels::cpu::Float8MatmulForward(product.data(), o.inp.data(), si.data(), o.weight.data(), sw.data(), N, K, OC,
                                      recipe);
    // Bias then residual, each added in fp32 as MatmulForward's epilogue adds them.
    auto out = side.Zeros<float>(N * OC);
    side.ops->Float8MatmulForward(out, nullptr, side.Put(o.inp), side.Put(si), side.Put(o.weight), side.Put(sw),
                                  side.Put(o.bias), side.Put(o.residual), N, K, OC, recipe, *side.stream);
    const std::vector<float> got = side.Get(out, N * OC);
    for (int64_t i = 0; i < N * OC; ++i) {
      const float want = (product[size_t(i)] + o.bias[size_t(i % OC)]) + o.residual[size_t(i)];
      ASSERT_EQ(got[size_t(i)], want) << "out[" << i << "]";
    }
    // With GELU: gelu_pre is the sum with the bias; out is GELU of it.
    auto gelu_out = side.Zeros<float>(N * OC), gelu_pre = side.Zeros<float>(N * OC);
    side.ops->Float8MatmulForward(gelu_out, gelu_pre, side.Put(o.inp), side.Put(si), side.Put(o.weight), side.Put(sw),
                                  side.Put(o.bias), nullptr, N, K, OC, recipe, *side.stream);
    const std::vector<float> pre = side.Get(gelu_pre, N * OC), act = side.Get(gelu_out, N * OC);
    for (int64_t i = 0; i < N * OC; ++i) {
      ASSERT_EQ(pre[size_t(i)], product[size_t(i)] + o.bias[size_t(i % OC)]) << "gelu_pre[" << i << "]";
      const double x = pre[size_t(i)];
      const double gelu = 0.5 * x * (1 + std::tanh(std::sqrt(2 / M_PI) * (x + 0.044715 * x * x * x)));
      ASSERT_NEAR(act[size_t(i)], gelu, 1e-6 * (1 + std::abs(gelu))) << "out[" << i << "] with GELU";
    }

    // The grad input, plain: the emulation's product as it is.
    const auto sd = ScalesFor(o.dout, N, OC, recipe, Float8Operand::kDoutForGradInput);
    const auto swi = ScalesFor(o.weight, OC, K, recipe, Float8Operand::kWeightForGradInput);
    std::vector<float> dinp_want(size_t(N * K));
    kernels::cpu::Float8MatmulGradInput(dinp_want.data(), o.dout.data(), sd.data(), o.weight.data(), swi.data(), N, K,
                                        OC, recipe);
    auto dinp = side.Zeros<float>(N * K);
    side.ops->Float8MatmulGradInput(dinp, side.Put(o.dout), side.Put(sd), side.Put(o.weight), side.Put(swi), nullptr, N,
                                    K, OC, recipe, *side.stream);
    EXPECT_EQ(side.Get(dinp, N * K), dinp_want) << "dinp";

    // The grad weight accumulates into what is there; dbias adds dout's column sums, uncast.
    const auto sdw = ScalesFor(o.dout, N, OC, recipe, Float8Operand::kDoutForGradWeight);
    const auto siw = ScalesFor(o.inp, N, K, recipe, Float8Operand::kInpForGradWeight);
    std::vector<float> dweight_want(size_t(OC * K), 0.5f);
    kernels::cpu::Float8MatmulGradWeight(dweight_want.data(), o.dout.data(), sdw.data(), o.inp.data(), siw.data(), N,
                                         K, OC, recipe);
    auto dweight = side.Put(std::vector<float>(size_t(OC * K), 0.5f));
    auto dbias = side.Put(std::vector<float>(size_t(OC), 1.0f));
    side.ops->Float8MatmulGradWeight(dweight, dbias, side.Put(o.dout), side.Put(sdw), side.Put(o.inp), side.Put(siw), N,
                                     K, OC, recipe, *side.stream);
    EXPECT_EQ(side.Get(dweight, OC * K), dweight_want) << "dweight";
    const std::vector<float> db = side.Get(dbias, OC);
    for (int j = 0; j < OC; ++j) {
      double sum = 0;
      for (int64_t r = 0; r < N; ++r) sum += o.dout[size_t(r * OC + j)];
      EXPECT_NEAR(db[size_t(j)], 1.0 + sum, 1e-6) << "dbias[" << j << "]";
    }
  }
}

// The bf16 emulation casts the same values (its bf16 operands, widened exactly) and rounds
// what it stores to bf16: within bf16's relative rounding (2^-8) of the fp32 table on the
// same operands, rounded to bf16 first.
TEST(Float8Products, Bf16TableAgreesWithFp32WithinBf16Rounding) {
  using kernels::Bf16;
  using runtime::bf16;
  Operands o = MakeOperands();
  for (std::vector<float>* v : {&o.inp, &o.weight, &o.dout, &o.bias}) {
    for (float& x : *v) x = float(bf16(x));
  }
  auto to_bf16 = [](const std::vector<float>& v) {
    std::vector<bf16> out(v.size());
    for (size_t i = 0; i < v.size(); ++i) out[i] = bf16(v[i]);
    return out;
  };
  for (Float8Recipe recipe : {Float8Recipe::kTensorwise, Float8Recipe::kRowwise}) {
    SCOPED_TRACE(kernels::Float8RecipeName(recipe));
    const auto si = ScalesFor(o.inp, N, K, recipe, kernels::Float8Operand::kInpForward);
    const auto sw = ScalesFor(o.weight, OC, K, recipe, kernels::Float8Operand::kWeightForward);
    Side<Fp32> fp32;
    auto out32 = fp32.Zeros<float>(N * OC);
    fp32.ops->Float8MatmulForward(out32, nullptr, fp32.Put(o.inp), fp32.Put(si), fp32.Put(o.weight), fp32.Put(sw),
                                  fp32.Put(o.bias), nullptr, N, K, OC, recipe, *fp32.stream);
    Side<Bf16> b16;
    auto out16 = b16.Zeros<bf16>(N * OC);
    b16.ops->Float8MatmulForward(out16, nullptr, b16.Put(to_bf16(o.inp)), b16.Put(si), b16.Put(to_bf16(o.weight)),
                                 b16.Put(sw), b16.Put(to_bf16(o.bias)), nullptr, N, K, OC, recipe, *b16.stream);
    const std::vector<float> want = fp32.Get(out32, N * OC);
    const std::vector<bf16> got = b16.Get(out16, N * OC);
    for (int64_t i = 0; i < N * OC; ++i) {
      ASSERT_NEAR(float(got[size_t(i)]), want[size_t(i)], std::abs(want[size_t(i)]) * 0x1p-8 + 1e-6) << i;
    }
  }
}

TEST(Float8Products, AmaxAndScalesOfGatheredCopies) {
  Side<Fp32> side;
  std::mt19937 rng(7);
  const std::vector<float> x = Random(rng, 6 * 10);
  for (auto scaling : {kernels::Float8Scaling::kTensor, kernels::Float8Scaling::kRow, kernels::Float8Scaling::kColumn}) {
    const int64_t n = kernels::Float8ScaleCount(scaling, 6, 10);
    std::vector<float> want(static_cast<size_t>(n));
    kernels::cpu::Float8Amax(want.data(), x.data(), 6, 10, scaling);
    auto amax = side.Zeros<float>(n);
    side.ops->Float8Amax(amax, side.Put(x), 6, 10, scaling, *side.stream);
    EXPECT_EQ(side.Get(amax, n), want);
  }
  // Three copies of 4 amaxes, 5 apart: each scale is of the max over the copies, NaN
  // where a copy holds one.
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> copies = {1, 2, 3, 4, -1, 8, 5, nan, 1, -1, -1, 0.25f, 7, 0.1f, -1};
  auto scale = side.Zeros<float>(4);
  side.ops->Float8Scales(scale, side.Put(copies), 4, 3, 5, kernels::Float8::kE4M3, false, *side.stream);
  const std::vector<float> got = side.Get(scale, 4);
  EXPECT_EQ(got[0], kernels::Float8Scale(8, kernels::Float8::kE4M3, false));
  EXPECT_EQ(got[1], kernels::Float8Scale(5, kernels::Float8::kE4M3, false));
  EXPECT_TRUE(std::isnan(got[2]));
  EXPECT_EQ(got[3], kernels::Float8Scale(4, kernels::Float8::kE4M3, false));
  auto pow2 = side.Zeros<float>(1);
  side.ops->Float8Scales(pow2, side.Put(std::vector<float>{3.0f}), 1, 1, 1, kernels::Float8::kE4M3, true, *side.stream);
  EXPECT_EQ(side.Get(pow2, 1)[0], 128.0f) << "448 / 3 = 149.3, rounded down to a power of 2";
}

// --- The scales under tensor parallelism ---

// A TP group of threads in one process: AllGather meets the other ranks at a barrier on
// the stream's thread and copies their inputs through host memory.
class ThreadGroup final : public model::TensorParallelGroup<Fp32> {
  template <class T>
  using Ptr = runtime::DevicePtr<T>;

 public:
  struct Shared {
    explicit Shared(int size) : barrier(size), slots(size_t(size)) {}
    std::barrier<> barrier;
    std::vector<std::vector<float>> slots;
  };
  ThreadGroup(Shared* shared, int rank) : shared_(shared), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return int(shared_->slots.size()); }
  void AllReduceSum(Ptr<float>, int64_t, runtime::Stream&) override { FAIL() << "not used by the scales"; }
  void AllGather(Ptr<const float> in, Ptr<float> out, int64_t n, runtime::Stream& stream) override {
    stream.HostCallback([this, in, out, n] {
      const float* from = DeviceSide::Address(in);
      shared_->slots[size_t(rank_)].assign(from, from + n);
      shared_->barrier.arrive_and_wait();
      float* to = DeviceSide::Address(out);
      for (size_t r = 0; r < shared_->slots.size(); ++r) {
        std::copy(shared_->slots[r].begin(), shared_->slots[r].end(), to + r * size_t(n));
      }
      shared_->barrier.arrive_and_wait();
    });
  }

 private:
  Shared* shared_;
  int rank_;
};

using model::TpSplit;

// Columns [c0, c0 + cols) of x (rows, whole_cols), or rows [r0, r0 + rows) of x (.., cols).
std::vector<float> Columns(const std::vector<float>& x, int64_t rows, int64_t whole_cols, int64_t c0, int64_t cols) {
  std::vector<float> out;
  for (int64_t r = 0; r < rows; ++r) {
    out.insert(out.end(), x.begin() + r * whole_cols + c0, x.begin() + r * whole_cols + c0 + cols);
  }
  return out;
}
std::vector<float> Rows(const std::vector<float>& x, int64_t cols, int64_t r0, int64_t rows) {
  return {x.begin() + r0 * cols, x.begin() + (r0 + rows) * cols};
}

enum class Product { kForward, kGradInput, kGradWeight };

// The two operands' scales of `product` on one rank: the whole tensors without a group, or
// this rank's slices of them with one.
struct Scales {
  std::vector<float> a, b;
};
Scales ScalesOnRank(Product product, TpSplit split, Float8Recipe recipe, const Operands& whole,
                    ThreadGroup* group) {
  const int T = group ? group->size() : 1, r = group ? group->rank() : 0;
  // This rank's slices: weight (OC,K) by rows or columns; inp (N,K) by columns where the
  // weight's columns are split; dout (N,OC) by columns where its rows are.
  const bool rows = split == TpSplit::kRows;
  const int k = rows ? K : K / T, oc = rows ? OC / T : OC;
  const std::vector<float> weight = rows ? Rows(whole.weight, K, r * oc, oc) : Columns(whole.weight, OC, K, r * k, k);
  const std::vector<float> inp = rows ? whole.inp : Columns(whole.inp, N, K, r * k, k);
  const std::vector<float> dout = rows ? Columns(whole.dout, N, OC, r * oc, oc) : whole.dout;
  Side<Fp32> side;
  // The scratch as model::Float8Linear lays it out, for operands of up to `width` scales.
  const int64_t width = std::max<int64_t>({N, K, OC});
  model::Float8Linear float8{recipe, side.Zeros<float>((int64_t(T) + 2) * 2 * width), width};
  model::Context<Fp32> ctx{*side.ops, *side.stream, group};
  ctx.float8 = &float8;
  std::pair<runtime::DevicePtr<const float>, runtime::DevicePtr<const float>> scales;
  kernels::Float8Operand a{}, b{};
  int64_t a_rows = 0, a_cols = 0, b_rows = 0, b_cols = 0;
  switch (product) {
    case Product::kForward:
      scales = model::float8_detail::ForwardScales(ctx, split, side.Put(inp), side.Put(weight), N, k, oc);
      a = kernels::Float8Operand::kInpForward, b = kernels::Float8Operand::kWeightForward;
      a_rows = N, a_cols = k, b_rows = oc, b_cols = k;
      break;
    case Product::kGradInput:
      scales = model::float8_detail::GradInputScales(ctx, split, side.Put(dout), side.Put(weight), N, k, oc);
      a = kernels::Float8Operand::kDoutForGradInput, b = kernels::Float8Operand::kWeightForGradInput;
      a_rows = N, a_cols = oc, b_rows = oc, b_cols = k;
      break;
    case Product::kGradWeight:
      scales = model::float8_detail::GradWeightScales(ctx, split, side.Put(dout), side.Put(inp), N, k, oc);
      a = kernels::Float8Operand::kDoutForGradWeight, b = kernels::Float8Operand::kInpForGradWeight;
      a_rows = N, a_cols = oc, b_rows = N, b_cols = k;
      break;
  }
  const auto count = [&](kernels::Float8Operand operand, int64_t rows_, int64_t cols_) {
    return kernels::Float8ScaleCount(kernels::Float8CastOf(recipe, operand).scaling, rows_, cols_);
  };
  const int64_t na = count(a, a_rows, a_cols), nb = count(b, b_rows, b_cols);
  side.stream->Synchronize();
  const float* sa = DeviceSide::Address(scales.first);
  const float* sb = DeviceSide::Address(scales.second);
  return {std::vector<float>(sa, sa + na), std::vector<float>(sb, sb + nb)};
}

// The part of the whole tensor's scales a rank holds: all of them, or its slice where
// the scales run along an axis the group splits.
std::vector<float> PartOf(const std::vector<float>& whole, int64_t mine, int rank) {
  if (int64_t(whole.size()) == mine) return whole;
  return {whole.begin() + rank * mine, whole.begin() + (rank + 1) * mine};
}

TEST(Float8TensorParallel, EachRankScalesWithTheWholeTensorsScales) {
  Operands whole = MakeOperands();
  // A row and a column whose amax lies on one rank only, so that a scale of the rank's
  // own slice would differ from the whole's.
  whole.inp[3 * K + K - 1] = 40.0f;
  whole.weight[(OC - 1) * K + 2] = 3.0f;
  whole.dout[5 * OC + OC - 2] = 0.25f;
  constexpr int kT = 2;
  for (Float8Recipe recipe : {Float8Recipe::kTensorwise, Float8Recipe::kRowwise}) {
    for (TpSplit split : {TpSplit::kRows, TpSplit::kColumns}) {
      for (Product product : {Product::kForward, Product::kGradInput, Product::kGradWeight}) {
        const std::string what = std::string(kernels::Float8RecipeName(recipe)) +
                                 (split == TpSplit::kRows ? ", rows split" : ", columns split") + ", product " +
                                 std::to_string(int(product));
        const Scales one = ScalesOnRank(product, split, recipe, whole, nullptr);
        ThreadGroup::Shared shared(kT);
        std::vector<Scales> ranks(kT);
        std::vector<std::thread> threads;
        for (int r = 0; r < kT; ++r) {
          threads.emplace_back([&, r] {
            ThreadGroup group(&shared, r);
            ranks[size_t(r)] = ScalesOnRank(product, split, recipe, whole, &group);
          });
        }
        for (std::thread& t : threads) t.join();
        for (int r = 0; r < kT; ++r) {
          const Scales& s = ranks[size_t(r)];
          EXPECT_EQ(s.a, PartOf(one.a, int64_t(s.a.size()), r)) << what << ": rank " << r << "'s first operand";
          EXPECT_EQ(s.b, PartOf(one.b, int64_t(s.b.size()), r)) << what << ": rank " << r << "'s second operand";
        }
      }
    }
  }
}

}  // namespace
}  // namespace meshtrain::float8_linear_test
