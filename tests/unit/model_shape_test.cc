#include "api/model_shape.h"

#include <gtest/gtest.h>

namespace meshtrain::api {
namespace {

TEST(ModelShape, Gpt2ParameterCountsMatchThePublishedSizes) {
  // 124,439,808 is GPT-2 small with its unpadded 50257-token vocabulary.
  EXPECT_EQ(FindPreset("gpt2-124m")->ParameterCount(), 124'439'808);
  EXPECT_NEAR(FindPreset("gpt2-350m")->ParameterCount() / 1e6, 354.8, 0.1);
  EXPECT_NEAR(FindPreset("gpt2-774m")->ParameterCount() / 1e6, 774.0, 0.1);
  EXPECT_NEAR(FindPreset("gpt2-1.5b")->ParameterCount() / 1e6, 1557.6, 0.1);
}

TEST(ModelShape, PresetsAreListedSmallestFirstAndFindable) {
  int64_t last = 0;
  for (std::string_view name : PresetNames()) {
    const ModelShape* shape = FindPreset(name);
    ASSERT_NE(shape, nullptr) << name;
    EXPECT_EQ(shape->hidden % shape->heads, 0) << name;
    EXPECT_GT(shape->ParameterCount(), last) << name;
    last = shape->ParameterCount();
  }
  EXPECT_EQ(FindPreset("gpt2-xl"), nullptr);
  EXPECT_EQ(FindPreset(""), nullptr);
}

TEST(ModelShape, ShapeOfNeedsEveryField) {
  ModelSpec spec;
  spec.layers = 2;
  EXPECT_THROW(ShapeOf(spec), std::logic_error);
  spec.heads = 2, spec.hidden = 8, spec.vocab_size = 10, spec.seq_len = 4;
  EXPECT_EQ(ShapeOf(spec), (ModelShape{2, 2, 8, 10, 4}));
}

}  // namespace
}  // namespace meshtrain::api
