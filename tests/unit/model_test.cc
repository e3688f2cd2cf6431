// The whole GPT-2 model: gradients against finite differences in fp64, fp32 against
// fp64, and the parameter layout and initialisation.

#include "worker/model/gpt2.h"

#include <cmath>
#include <random>

#include <gtest/gtest.h>

namespace meshtrain::model {
namespace {

const api::ModelShape kTiny{.layers = 2, .heads = 2, .hidden = 8, .vocab_size = 11, .seq_len = 6};
constexpr int B = 2, Tn = 5;

std::vector<int32_t> Tokens(uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> t(B * Tn);
  for (int32_t& x : t) x = int32_t(rng() % kTiny.vocab_size);
  return t;
}

TEST(ModelLayout, UnitsTileTheBufferAndMatchTheParameterCount) {
  for (std::string_view name : api::PresetNames()) {
    const ParameterLayout layout(*api::FindPreset(name));
    EXPECT_EQ(layout.total(), api::FindPreset(name)->ParameterCount()) << name;
    int64_t expect_begin = 0;
    for (int u = 0; u < layout.units(); ++u) {
      const auto [begin, end] = layout.Unit(u);
      EXPECT_EQ(begin, expect_begin) << name << " unit " << u;
      EXPECT_GT(end, begin);
      expect_begin = end;
    }
    EXPECT_EQ(expect_begin, layout.total()) << name;
  }
}

TEST(ModelInit, IsAPureFunctionOfSeedTensorAndIndex) {
  const ParameterLayout layout(kTiny);
  std::vector<float> a(layout.total()), b(layout.total());
  InitParameters(a.data(), layout, 42);
  InitParameters(b.data(), layout, 42);
  EXPECT_EQ(a, b);
  // Any element can be recomputed alone, as a shard would.
  const ParamTensor& qkv = layout.tensors()[6];
  ASSERT_EQ(qkv.name, "h0.qkv.w");
  for (int64_t i : {int64_t(0), qkv.size / 2, qkv.size - 1}) {
    EXPECT_EQ(a[qkv.offset + i], float(0.02 * CounterNormal(42, 6, uint64_t(i))));
  }
  InitParameters(b.data(), layout, 43);
  EXPECT_NE(a, b);
  // Statistics of a large tensor: mean 0, stddev 0.02.
  const ParameterLayout big(*api::FindPreset("gpt2-tiny"));
  std::vector<float> p(big.total());
  InitParameters(p.data(), big, 1);
  const ParamTensor& wte = big.tensors()[0];
  double sum = 0, sq = 0;
  for (int64_t i = 0; i < wte.size; ++i) sum += p[wte.offset + i], sq += double(p[wte.offset + i]) * p[wte.offset + i];
  EXPECT_NEAR(sum / wte.size, 0.0, 1e-3);
  EXPECT_NEAR(std::sqrt(sq / wte.size), 0.02, 5e-4);
  EXPECT_EQ(p[big.Offset(Param::kLnfW)], 1.0f);
  EXPECT_EQ(p[big.Offset(Param::kQkvB, 0)], 0.0f);
}

TEST(ModelGradients, WholeModelMatchesFiniteDifferences) {
  Gpt2<double> model(kTiny, B, Tn);
  InitParameters(model.params().data(), model.layout(), 7);
  // Larger weights than at init, so that every path carries signal.
  for (double& p : model.params()) p *= 10;
  const auto inputs = Tokens(1), targets = Tokens(2);
  model.ZeroGrad();
  const double loss = model.Forward(inputs.data(), targets.data(), B, Tn);
  EXPECT_GT(loss, 0);
  model.Backward(1.0);
  const std::vector<double> analytic(model.grads().begin(), model.grads().end());
  const double h = 1e-5;
  for (const ParamTensor& t : model.layout().tensors()) {
    for (int64_t i : {int64_t(0), t.size / 3, t.size - 1}) {
      double& p = model.params()[t.offset + i];
      const double saved = p;
      p = saved + h;
      const double plus = model.Forward(inputs.data(), targets.data(), B, Tn);
      p = saved - h;
      const double minus = model.Forward(inputs.data(), targets.data(), B, Tn);
      p = saved;
      const double numeric = (plus - minus) / (2 * h);
      // Truncation error of central differences at these weights is ~1e-6 relative.
      EXPECT_NEAR(analytic[t.offset + i], numeric, 1e-5 * std::max(1.0, std::abs(numeric))) << t.name << "[" << i << "]";
    }
  }
}

TEST(ModelPrecision, FloatModelMatchesTheDoubleReference) {
  Gpt2<double> ref(kTiny, B, Tn);
  Gpt2<float> model(kTiny, B, Tn);
  InitParameters(ref.params().data(), ref.layout(), 3);
  InitParameters(model.params().data(), model.layout(), 3);
  for (size_t i = 0; i < ref.params().size(); ++i) ref.params()[i] = model.params()[i];
  const auto inputs = Tokens(5), targets = Tokens(6);
  ref.ZeroGrad();
  model.ZeroGrad();
  const double ref_loss = ref.Forward(inputs.data(), targets.data(), B, Tn);
  const double loss = model.Forward(inputs.data(), targets.data(), B, Tn);
  EXPECT_NEAR(loss, ref_loss, 1e-5 * ref_loss);
  EXPECT_NEAR(ref_loss, std::log(double(kTiny.vocab_size)), 0.1);  // near-uniform predictions at init
  ref.Backward(1.0);
  model.Backward(1.0f);
  double scale = 0;
  for (double g : ref.grads()) scale = std::max(scale, std::abs(g));
  for (size_t i = 0; i < ref.grads().size(); ++i) ASSERT_NEAR(model.grads()[i], ref.grads()[i], 1e-4 * scale) << i;
}

TEST(ModelBehaviour, GradientsAccumulateAndInputsAreChecked) {
  Gpt2<double> model(kTiny, B, Tn);
  InitParameters(model.params().data(), model.layout(), 9);
  const auto inputs = Tokens(1), targets = Tokens(2);
  model.ZeroGrad();
  model.Forward(inputs.data(), targets.data(), B, Tn);
  model.Backward(1.0);
  const std::vector<double> once(model.grads().begin(), model.grads().end());
  model.Forward(inputs.data(), targets.data(), B, Tn);
  model.Backward(1.0);
  for (size_t i = 0; i < once.size(); ++i) ASSERT_NEAR(model.grads()[i], 2 * once[i], 1e-12 + 1e-9 * std::abs(once[i]));
  std::vector<int32_t> bad = inputs;
  bad[3] = int32_t(kTiny.vocab_size);
  EXPECT_THROW(model.Forward(bad.data(), targets.data(), B, Tn), std::out_of_range);
  EXPECT_THROW(model.Forward(inputs.data(), targets.data(), B + 1, Tn), std::invalid_argument);
}

}  // namespace
}  // namespace meshtrain::model
