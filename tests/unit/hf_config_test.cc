// Hugging Face's config.json in and out (api/hf_config.h): the published configs of the
// families give their presets' shapes, in transformers 4's form and in transformers 5's
// (rope_parameters); what would change the math is refused by name; what meshtrain writes
// reads back as the same model; and a job checked against a model directory.

#include "api/hf_config.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>

#include "api/manifest.h"
#include "api/model_shape.h"

namespace meshtrain::api {
namespace {

using Json = nlohmann::json;

// Llama 3.2 1B's config.json as transformers 4 saves it.
Json Llama32() {
  return Json::parse(R"({
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": false, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048,
    "initializer_range": 0.02, "intermediate_size": 8192, "max_position_embeddings": 131072, "mlp_bias": false,
    "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
    "original_max_position_embeddings": 8192, "rope_type": "llama3"}, "rope_theta": 500000.0,
    "tie_word_embeddings": true, "torch_dtype": "bfloat16", "transformers_version": "4.45.0", "use_cache": true,
    "vocab_size": 128256})");
}

ModelShape ShapeOfConfig(const Json& config, int64_t seq = 2048) {
  ModelSpec model;
  model.seq_len = seq;
  const FieldErrors errors = MergeHuggingFaceConfig(ParseHuggingFaceConfig(config.dump(), "config.json"), &model);
  EXPECT_TRUE(errors.empty()) << errors.front().ToString();
  return ShapeOf(model);
}

std::string ErrorOf(const Json& config) {
  try {
    ParseHuggingFaceConfig(config.dump(), "config.json");
  } catch (const HuggingFaceConfigError& e) {
    return e.what();
  }
  return "";
}

TEST(HuggingFaceConfig, PublishedConfigsGiveThePresetsShapes) {
  EXPECT_EQ(ShapeOfConfig(Llama32()), *FindPreset("llama3.2-1b"));
  // transformers 5 keeps rope_theta and the scaling in rope_parameters.
  Json v5 = Llama32();
  v5["rope_parameters"] = v5["rope_scaling"];
  v5["rope_parameters"]["rope_theta"] = 500000.0;
  v5.erase("rope_scaling");
  v5.erase("rope_theta");
  EXPECT_EQ(ShapeOfConfig(v5), *FindPreset("llama3.2-1b"));
  // The older spelling of the type.
  Json old = Llama32();
  old["rope_scaling"]["type"] = old["rope_scaling"]["rope_type"];
  old["rope_scaling"].erase("rope_type");
  EXPECT_EQ(ShapeOfConfig(old), *FindPreset("llama3.2-1b"));
  // What meshtrain writes reads back as the same model, for every preset.
  for (std::string_view name : PresetNames()) {
    const ModelShape& preset = *FindPreset(name);
    EXPECT_EQ(ShapeOfConfig(HuggingFaceConfigJson(preset, "float32"), preset.seq_len), preset) << name;
  }
}

TEST(HuggingFaceConfig, WhatWouldChangeTheMathIsRefusedByName) {
  auto with = [](const char* key, Json value) {
    Json c = Llama32();
    c[key] = std::move(value);
    return c;
  };
  EXPECT_NE(ErrorOf(with("architectures", {"Qwen2MoeForCausalLM"})).find("Qwen2MoeForCausalLM is not one meshtrain trains"),
            std::string::npos);
  EXPECT_NE(ErrorOf(with("hidden_act", "gelu")).find("hidden_act gelu is not implemented"), std::string::npos);
  EXPECT_NE(ErrorOf(with("attention_bias", true)).find("attention_bias true is not implemented"), std::string::npos);
  EXPECT_NE(ErrorOf(with("mlp_bias", true)).find("mlp_bias true is not implemented"), std::string::npos);
  EXPECT_NE(ErrorOf(with("rope_scaling", {{"rope_type", "yarn"}, {"factor", 4.0}})).find("\"yarn\" is not implemented"),
            std::string::npos);
  Json v5 = Llama32();
  v5["rope_parameters"] = {{"rope_type", "dynamic"}, {"factor", 2.0}, {"rope_theta", 500000.0}};
  v5.erase("rope_scaling");
  EXPECT_NE(ErrorOf(v5).find("rope_parameters type \"dynamic\" is not implemented"), std::string::npos) << ErrorOf(v5);
  Json theta = Llama32();
  theta["rope_parameters"] = theta["rope_scaling"];
  theta["rope_parameters"]["rope_theta"] = 10000.0;
  EXPECT_NE(ErrorOf(theta).find("rope_theta 500000.0 disagrees with rope_parameters' 10000.0"), std::string::npos)
      << ErrorOf(theta);
  Json partial = Llama32();
  partial["partial_rotary_factor"] = 0.5;
  EXPECT_NE(ErrorOf(partial).find("partial_rotary_factor 0.5 is not implemented"), std::string::npos);
  Json qwen = HuggingFaceConfigJson(*FindPreset("qwen2.5-0.5b"), "float32");
  qwen["use_sliding_window"] = true;
  EXPECT_NE(ErrorOf(qwen).find("use_sliding_window true is not implemented"), std::string::npos);
  EXPECT_NE(ErrorOf(Json::parse("[1]")).find("config.json: not a JSON object"), std::string::npos);
}

// Qwen3-0.6B's config.json as transformers 4.51 saves it.
Json Qwen3() {
  return Json::parse(R"({
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024,
    "initializer_range": 0.02, "intermediate_size": 3072, "max_position_embeddings": 40960, "max_window_layers": 28,
    "model_type": "qwen3", "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_scaling": null, "rope_theta": 1000000, "sliding_window": null,
    "tie_word_embeddings": true, "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": true,
    "use_sliding_window": false, "vocab_size": 151936})");
}

// Qwen3 is its own family: its config gives its preset, head_dim defaults to Qwen3's 128
// (not hidden / heads = 64), what meshtrain writes names Qwen3ForCausalLM with head_dim,
// and its keys that would change the math are refused by name.
TEST(HuggingFaceConfig, Qwen3ReadsAsQwen3AndItsUnimplementedKeysAreNamed) {
  EXPECT_EQ(ShapeOfConfig(Qwen3()), *FindPreset("qwen3-0.6b"));
  Json no_head_dim = Qwen3();
  no_head_dim.erase("head_dim");
  EXPECT_EQ(ShapeOfConfig(no_head_dim).head_dim, 128);
  const Json written = HuggingFaceConfigJson(*FindPreset("qwen3-8b"), "bfloat16");
  EXPECT_EQ(written.at("architectures")[0], "Qwen3ForCausalLM");
  EXPECT_EQ(written.at("model_type"), "qwen3");
  EXPECT_EQ(written.at("head_dim"), 128);
  EXPECT_EQ(written.at("tie_word_embeddings"), false);
  EXPECT_EQ(written.at("use_sliding_window"), false);
  auto with = [](const char* key, Json value) {
    Json c = Qwen3();
    c[key] = std::move(value);
    return c;
  };
  EXPECT_NE(ErrorOf(with("use_sliding_window", true)).find("config.json: use_sliding_window true is not implemented"),
            std::string::npos);
  EXPECT_NE(ErrorOf(with("rope_scaling", {{"rope_type", "yarn"}, {"factor", 4.0},
                                          {"original_max_position_embeddings", 32768}}))
                .find("rope_scaling type \"yarn\" is not implemented"),
            std::string::npos);
  EXPECT_NE(ErrorOf(with("attention_bias", true)).find("attention_bias true is not implemented"), std::string::npos);
  EXPECT_NE(ErrorOf(with("layer_types", {"full_attention", "sliding_attention"}))
                .find("layer_types[1] \"sliding_attention\" is not implemented"),
            std::string::npos);
  EXPECT_NE(ErrorOf(with("head_dim", 0)).find("head_dim must be a positive integer"), std::string::npos);
}

// A model directory against the job: the shape from config.json, a field that disagrees
// named with both values, a misspelt family named as one (not an internal error), and no
// false warning that an elastic job of config.json's shape cannot shrink.
TEST(HuggingFaceConfig, AJobIsCheckedAgainstItsModelDirectory) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("meshtrain-hf-config-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "config.json") << Llama32().dump();
  auto job = [&](const Json& model, const Json& extra = Json::object()) {
    Json manifest = {{"apiVersion", "meshtrain.dev/v1alpha1"},
                     {"kind", "TrainingJob"},
                     {"metadata", {{"name", "hf"}}},
                     {"spec",
                      {{"image", "meshtrain"},
                       {"nodes", 2},
                       {"gpusPerNode", 8},
                       {"model", model},
                       {"data", {{"train", "/data/*.bin"}}},
                       {"training", {{"globalBatchTokens", 1 << 20}}}}}};
    manifest["spec"].update(extra);
    return CheckTrainingJob(manifest, "job.yaml", 0, ModelDirectory::kIfPresent);
  };
  const Json from = {{"init", {{"from", dir.string()}}}};
  const CheckedJob plain = job(from);
  ASSERT_TRUE(plain.ok()) << plain.errors.front().ToString();
  EXPECT_EQ(ShapeOf(plain.job.spec.model), *FindPreset("llama3.2-1b"));
  Json hidden = from;
  hidden["hidden"] = 4096;
  const CheckedJob disagrees = job(hidden);
  ASSERT_FALSE(disagrees.ok());
  EXPECT_EQ(disagrees.errors.front().ToString(),
            "spec.model.hidden: 4096 disagrees with spec.model.init.from's " + (dir / "config.json").string() +
                ", whose hidden_size is 2048");
  Json typo = from;
  typo["preset"] = "llama3.2-1b";
  typo["family"] = "lama";
  const CheckedJob misspelt = job(typo);
  ASSERT_FALSE(misspelt.ok());
  bool named = false;
  for (const FieldError& e : misspelt.errors) named |= e.path == "spec.model.family";
  EXPECT_TRUE(named) << misspelt.errors.front().ToString();
  const CheckedJob elastic = job(from, {{"elastic", {{"minNodes", 1}}}});
  ASSERT_TRUE(elastic.ok()) << elastic.errors.front().ToString();
  for (const FieldError& w : elastic.warnings) EXPECT_NE(w.path, "spec.elastic.minNodes") << w.ToString();
  std::filesystem::remove_all(dir);
}

// config.json comes from the internet: JSON nested past kMaxModelJsonDepth is refused
// before it is parsed (100,000 levels recursed past the stack when copied or printed),
// text that is not JSON is named with its place, a number past a double's range is an
// error of the file (it escaped as nlohmann's), and a size so large that products of two
// would overflow is refused by key.
TEST(HuggingFaceConfig, DeepMalformedAndHugeConfigsAreRefusedNamingTheFile) {
  auto error = [](const std::string& text) {
    try {
      ParseHuggingFaceConfig(text, "dir/config.json");
    } catch (const HuggingFaceConfigError& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  for (const int depth : {5000, 100000}) {
    const std::string deep = std::string(size_t(depth), '[') + std::string(size_t(depth), ']');
    EXPECT_EQ(error(deep), "dir/config.json: JSON nested deeper than 512 at byte 512 (line 1, column 513)");
    EXPECT_EQ(error("{\n  \"rope_scaling\": " + deep + "}"),
              "dir/config.json: JSON nested deeper than 512 at byte 531 (line 2, column 530)");
    try {
      ParseModelJson(deep, "x.json");
      ADD_FAILURE() << "JSON " << depth << " deep was read";
    } catch (const ModelJsonError& e) {
      EXPECT_EQ(e.reason(), "JSON nested deeper than 512 at byte 512 (line 1, column 513)");
    }
  }
  // Brackets in strings are not nesting, and 512 levels are JSON.
  EXPECT_NO_THROW(ParseModelJson("[\"" + std::string(1000, '[') + "\\\"[\"]", "x.json"));
  EXPECT_NO_THROW(ParseModelJson(std::string(512, '[') + std::string(512, ']'), "x.json"));
  // nlohmann reads "tru" and stops at the '}' after it.
  EXPECT_EQ(error("{\"a\": tru}").substr(0, 63), "dir/config.json: not valid JSON at byte 9 (line 1, column 10): ");
  EXPECT_EQ(error("{\"vocab_size\": 1e999}"), "dir/config.json: not valid JSON: number overflow parsing '1e999'");
  Json huge = Llama32();
  huge["hidden_size"] = int64_t(1) << 62;
  EXPECT_NE(error(huge.dump()).find("dir/config.json: hidden_size must be a positive integer below 2^31, got " +
                                    std::to_string(int64_t(1) << 62)),
            std::string::npos)
      << error(huge.dump());
  huge = Llama32();
  huge["vocab_size"] = uint64_t(1) << 63;  // past int64: it read as negative
  EXPECT_NE(error(huge.dump()).find("vocab_size must be a positive integer below 2^31"), std::string::npos);
}

TEST(HuggingFaceConfig, RopeModelsKeepTheirWeightsAtAnotherWindow) {
  ModelShape a = *FindPreset("llama-tiny"), b = a;
  b.seq_len = 64;
  b.max_positions = 64;  // a hand-written Llama spec defaults maxPositions to seqLen
  EXPECT_TRUE(a.SameWeights(b));
  ModelShape g = *FindPreset("gpt2-tiny"), h = g;
  h.max_positions = 256;  // GPT-2's position table grows
  EXPECT_FALSE(g.SameWeights(h));
}

}  // namespace
}  // namespace meshtrain::api
