// The whole GPT-2 model: gradients against finite differences in fp64, fp32 against
// fp64, and the parameter layout and initialisation.

#include "worker/model/gpt2.h"

#include <cmath>
#include <random>

#include <gtest/gtest.h>

#include "api/engine_memory.h"

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

// The planner's memory model counts units with api::UnitElementsOf; it must be what
// the layout the engine shards holds, on every TP rank of every preset.
TEST(ModelLayout, UnitSizesAreTheOnesThePlannerCounts) {
  for (std::string_view name : api::PresetNames()) {
    const api::ModelShape& shape = *api::FindPreset(name);
    for (int tp : {1, 2, 4}) {
      if (shape.heads % tp != 0) continue;
      for (int t = 0; t < tp; ++t) {
        const ParameterLayout layout(shape, t, tp);
        const api::UnitElements expected = api::UnitElementsOf(shape, t, tp);
        EXPECT_EQ(layout.Unit(0).second - layout.Unit(0).first, expected.root) << name << " tp " << t << "/" << tp;
        for (int u = 1; u < layout.units(); ++u) {
          ASSERT_EQ(layout.Unit(u).second - layout.Unit(u).first, expected.block) << name << " unit " << u;
        }
      }
    }
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

// A TP slice initialises exactly its elements of the single-rank model: every element of
// the whole model lands in exactly one slice (or, for a tensor every rank holds whole,
// in all of them), bit for bit, including a vocabulary the group does not divide.
TEST(ModelInit, TensorParallelSlicesAreTheSingleRankModelBitForBit) {
  const api::ModelShape shape{.layers = 2, .heads = 4, .hidden = 8, .vocab_size = 11, .seq_len = 6};
  const ParameterLayout whole(shape);
  std::vector<float> reference(size_t(whole.total()));
  InitParameters(reference.data(), whole, 5);
  for (int T : {2, 4}) {
    std::vector<int> covered(size_t(whole.total()), 0);
    for (int t = 0; t < T; ++t) {
      const ParameterLayout slice(shape, t, T);
      std::vector<float> local(size_t(slice.total()));
      InitParameterRange(local.data(), slice, 5, 0, slice.total());
      ASSERT_EQ(slice.tensors().size(), whole.tensors().size());
      for (size_t id = 0; id < slice.tensors().size(); ++id) {
        const ParamTensor& part = slice.tensors()[id];
        const ParamTensor& full = whole.tensors()[id];
        for (int64_t i = 0; i < part.size; ++i) {
          const int64_t at = full.offset + slice.GlobalIndex(part, i);
          ASSERT_LT(at, full.offset + full.size) << part.name << " element " << i;
          EXPECT_EQ(local[size_t(part.offset + i)], reference[size_t(at)]) << part.name << " element " << i << " of tp " << t;
          ++covered[size_t(at)];
        }
      }
    }
    for (const ParamTensor& t : whole.tensors()) {
      const bool replicated = ParameterLayout(shape, 0, T).tensors()[size_t(&t - whole.tensors().data())].tp_replicated();
      for (int64_t i = 0; i < t.size; ++i) {
        ASSERT_EQ(covered[size_t(t.offset + i)], replicated ? T : 1) << t.name << " element " << i << ", T=" << T;
      }
    }
  }
}

TEST(ModelLayout, ATensorParallelDegreeThatDoesNotDivideTheHeadsNamesTheField) {
  const api::ModelShape shape{.layers = 1, .heads = 6, .hidden = 12, .vocab_size = 11, .seq_len = 6};
  try {
    ParameterLayout(shape, 0, 4);
    ADD_FAILURE() << "4 ranks split 6 heads";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("spec.parallelism.tensorParallelDegree: must divide spec.model.heads (6), got 4"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(ParameterLayout(shape, 2, 3).VocabRange(), (std::pair<int64_t, int64_t>{7, 11}));
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
