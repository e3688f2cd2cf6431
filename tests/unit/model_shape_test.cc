#include "api/model_shape.h"

#include <gtest/gtest.h>

#include <map>
#include <string>

namespace meshtrain::api {
namespace {

TEST(ModelShape, Gpt2ParameterCountsMatchThePublishedSizes) {
  // 124,439,808 is GPT-2 small with its unpadded 50257-token vocabulary.
  EXPECT_EQ(FindPreset("gpt2-124m")->ParameterCount(), 124'439'808);
  EXPECT_NEAR(FindPreset("gpt2-350m")->ParameterCount() / 1e6, 354.8, 0.1);
  EXPECT_NEAR(FindPreset("gpt2-774m")->ParameterCount() / 1e6, 774.0, 0.1);
  EXPECT_NEAR(FindPreset("gpt2-1.5b")->ParameterCount() / 1e6, 1557.6, 0.1);
}

// The published parameter counts of the Llama-class presets (each model's safetensors
// index's total_size over its dtype's bytes), from the family's description.
TEST(ModelShape, LlamaClassParameterCountsMatchThePublishedSizes) {
  EXPECT_EQ(FindPreset("llama3.2-1b")->ParameterCount(), 1'235'814'400);  // tied head
  EXPECT_EQ(FindPreset("llama3.2-3b")->ParameterCount(), 3'212'749'824);
  EXPECT_EQ(FindPreset("llama3.1-8b")->ParameterCount(), 8'030'261'248);  // untied
  EXPECT_EQ(FindPreset("llama3.1-70b")->ParameterCount(), 70'553'706'496);
  EXPECT_EQ(FindPreset("llama3.1-405b")->ParameterCount(), 405'853'388'800);
  EXPECT_EQ(FindPreset("mistral-7b")->ParameterCount(), 7'248'023'552);
  EXPECT_EQ(FindPreset("qwen2.5-0.5b")->ParameterCount(), 494'032'768);  // q, k and v biases, tied
  EXPECT_EQ(FindPreset("qwen2.5-7b")->ParameterCount(), 7'615'616'512);
  EXPECT_EQ(FindPreset("qwen2.5-72b")->ParameterCount(), 72'706'203'648);
  // Qwen3's model cards: 0.6B (0.44B without the embedding), 8.2B (6.95B), 32.8B (31.2B);
  // q_norm and k_norm add 2 x head_dim a block.
  EXPECT_EQ(FindPreset("qwen3-0.6b")->ParameterCount(), 596'049'920);
  EXPECT_EQ(FindPreset("qwen3-8b")->ParameterCount(), 8'190'735'360);
  EXPECT_EQ(FindPreset("qwen3-32b")->ParameterCount(), 32'762'123'264);
  // 6N + 12 L T Q, N without an untied embedding (a lookup): 8B at 2048 tokens.
  const ModelShape& l8 = *FindPreset("llama3.1-8b");
  EXPECT_DOUBLE_EQ(l8.TrainingFlopsPerToken(2048),
                   6.0 * (8'030'261'248.0 - 128256.0 * 4096) + 12.0 * 32 * 2048 * 4096);
}

TEST(ModelShape, PresetsAreListedSmallestFirstInTheirSeriesAndFindable) {
  std::map<std::string, int64_t> last;  // by family
  for (std::string_view name : PresetNames()) {
    const ModelShape* shape = FindPreset(name);
    ASSERT_NE(shape, nullptr) << name;
    if (shape->family == "gpt2") {
      EXPECT_EQ(shape->hidden % shape->heads, 0) << name;
    }
    EXPECT_EQ(shape->heads % shape->KvHeads(), 0) << name;
    EXPECT_LE(shape->seq_len, shape->MaxPositions()) << name;
    EXPECT_GT(shape->ParameterCount(), last[shape->family]) << name;
    last[shape->family] = shape->ParameterCount();
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
