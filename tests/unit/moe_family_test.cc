// The mixture-of-experts families (api/families/moe.cc, issue 54): Mixtral and Qwen3-MoE.
// Their presets are the published models (parameter counts of their safetensors indexes);
// their published config.json files give those presets, and what meshtrain writes reads
// back the same; config.json keys that would change the math are refused by key, those
// that change nothing at their values taken; the tensors carry the per-expert names of
// published checkpoints; and spec.model's expert fields are checked by field.

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>

#include <gtest/gtest.h>

#include "api/hf_config.h"
#include "api/json_codec.h"
#include "api/manifest.h"
#include "api/model_family.h"
#include "api/model_shape.h"

namespace meshtrain::api {
namespace {

using Json = nlohmann::json;

// mistralai/Mixtral-8x7B-v0.1's config.json (transformers 4.36, with 4.40's router_jitter_noise).
Json Mixtral8x7b() {
  return Json::parse(R"({
    "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mixtral", "num_attention_heads": 32, "num_experts_per_tok": 2,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": false,
    "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02, "router_jitter_noise": 0.0,
    "sliding_window": null, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
    "transformers_version": "4.36.0.dev0", "use_cache": true, "vocab_size": 32000})");
}

// Qwen/Qwen3-30B-A3B's config.json (transformers 4.51).
Json Qwen3_30bA3b() {
  return Json::parse(R"({
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144, "max_position_embeddings": 40960,
    "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
    "norm_topk_prob": true, "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": false, "rms_norm_eps": 1e-06,
    "rope_scaling": null, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": null,
    "tie_word_embeddings": false, "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": true,
    "use_sliding_window": false, "vocab_size": 151936})");
}

ModelShape MoeShapeOfConfig(const Json& config, int64_t seq = 2048) {
  ModelSpec model;
  model.seq_len = seq;
  const FieldErrors errors = MergeHuggingFaceConfig(ParseHuggingFaceConfig(config.dump(), "config.json"), &model);
  EXPECT_TRUE(errors.empty()) << errors.front().ToString();
  return ShapeOf(model);
}

std::string MoeConfigError(const Json& config) {
  try {
    ParseHuggingFaceConfig(config.dump(), "config.json");
  } catch (const HuggingFaceConfigError& e) {
    return e.what();
  }
  return "";
}

TEST(MoeFamilies, PresetsHaveThePublishedParameterCounts) {
  EXPECT_EQ(FindPreset("mixtral-8x7b")->ParameterCount(), 46'702'792'704);
  EXPECT_EQ(FindPreset("mixtral-8x22b")->ParameterCount(), 140'620'634'112);
  EXPECT_EQ(FindPreset("qwen3-30b-a3b")->ParameterCount(), 30'532'122'624);
  EXPECT_EQ(FindPreset("qwen3-235b-a22b")->ParameterCount(), 235'093'634'560);
  // A token multiplies by k of the E experts: Qwen3-30B-A3B's 3.3B active parameters
  // (without the embedding, a lookup) make 6N of its FLOPs.
  const ModelShape& q = *FindPreset("qwen3-30b-a3b");
  const double active = 30'532'122'624.0 - 151936.0 * 2048 - 48.0 * (128 - 8) * 3 * 768 * 2048;
  EXPECT_DOUBLE_EQ(q.TrainingFlopsPerToken(2048), 6 * active + 12.0 * 48 * 2048 * 32 * 128);
  EXPECT_EQ(FindPreset("moe-tiny")->family, "mixtral");
  EXPECT_EQ(FindPreset("qwen3-moe-tiny")->family, "qwen3_moe");
}

TEST(MoeFamilies, PublishedConfigsGiveThePresetsAndWhatIsWrittenReadsBack) {
  EXPECT_EQ(MoeShapeOfConfig(Mixtral8x7b()), *FindPreset("mixtral-8x7b"));
  EXPECT_EQ(MoeShapeOfConfig(Qwen3_30bA3b()), *FindPreset("qwen3-30b-a3b"));
  // transformers 4.36's Mixtral has no router_jitter_noise; Qwen3-MoE's head_dim defaults to 128.
  Json old = Mixtral8x7b();
  old.erase("router_jitter_noise");
  EXPECT_EQ(MoeShapeOfConfig(old), *FindPreset("mixtral-8x7b"));
  Json no_head_dim = Qwen3_30bA3b();
  no_head_dim.erase("head_dim");
  EXPECT_EQ(MoeShapeOfConfig(no_head_dim).head_dim, 128);
  for (const char* name : {"moe-tiny", "mixtral-8x22b", "qwen3-moe-tiny", "qwen3-235b-a22b"}) {
    const ModelShape& preset = *FindPreset(name);
    const Json written = HuggingFaceConfigJson(preset, "float32");
    EXPECT_EQ(MoeShapeOfConfig(written, preset.seq_len), preset) << name;
  }
  const Json mixtral = HuggingFaceConfigJson(*FindPreset("mixtral-8x7b"), "bfloat16");
  EXPECT_EQ(mixtral.at("architectures")[0], "MixtralForCausalLM");
  EXPECT_EQ(mixtral.at("model_type"), "mixtral");
  EXPECT_EQ(mixtral.at("num_local_experts"), 8);
  EXPECT_EQ(mixtral.at("num_experts_per_tok"), 2);
  EXPECT_EQ(mixtral.at("intermediate_size"), 14336);
  EXPECT_EQ(mixtral.at("router_jitter_noise"), 0.0);
  EXPECT_EQ(mixtral.at("output_router_logits"), false);
  const Json qwen = HuggingFaceConfigJson(*FindPreset("qwen3-30b-a3b"), "bfloat16");
  EXPECT_EQ(qwen.at("architectures")[0], "Qwen3MoeForCausalLM");
  EXPECT_EQ(qwen.at("model_type"), "qwen3_moe");
  EXPECT_EQ(qwen.at("num_experts"), 128);
  EXPECT_EQ(qwen.at("moe_intermediate_size"), 768);
  EXPECT_EQ(qwen.at("intermediate_size"), 6144);
  EXPECT_EQ(qwen.at("norm_topk_prob"), true);
  EXPECT_EQ(qwen.at("decoder_sparse_step"), 1);
  EXPECT_EQ(qwen.at("mlp_only_layers"), Json::array());
  EXPECT_EQ(qwen.at("head_dim"), 128);
  // Qwen3-MoE without norm_topk_prob: transformers' default, false.
  Json unnormed = Qwen3_30bA3b();
  unnormed.erase("norm_topk_prob");
  EXPECT_FALSE(MoeShapeOfConfig(unnormed).norm_topk_prob);
}

// Qwen3-MoE's decoder_sparse_step and mlp_only_layers choose the blocks that are dense, as
// transformers does: block l is sparse where l is not in mlp_only_layers and l + 1 is a
// multiple of the step. A dense block is Qwen3's attention and an intermediate_size wide
// SwiGLU MLP under Qwen3's names, a unit of its own.
TEST(MoeFamilies, QwenMoesDenseBlocksAreTheOnesTransformersMakesDense) {
  Json c = Qwen3_30bA3b();
  c["decoder_sparse_step"] = 2;
  c["mlp_only_layers"] = {47, 10};
  const ModelShape s = MoeShapeOfConfig(c);
  EXPECT_EQ(s.decoder_sparse_step, 2);
  EXPECT_EQ(s.mlp_only_layers, (std::vector<int64_t>{47, 10}));
  std::string kinds;
  for (int64_t l = 0; l < 12; ++l) kinds += s.DenseBlock(l) ? 'd' : 's';
  EXPECT_EQ(kinds, "dsdsdsdsdsds");  // (l + 1) % 2: block 10 is dense either way
  EXPECT_TRUE(s.DenseBlock(47));     // 48 % 2 == 0, but mlp_only_layers
  EXPECT_EQ(s.DenseBlocks(), 25);    // 24 of the step, and block 47
  EXPECT_FALSE(FindPreset("qwen3-30b-a3b")->DenseBlock(0));
  EXPECT_FALSE(FindPreset("llama-tiny")->DenseBlock(0));  // no experts: one kind of block
  // Parameters: the embedding, head and final norm; 23 sparse blocks and 25 dense ones.
  const int64_t C = 2048, attention = C + 2 * (32 * 128 * C) + 2 * (4 * 128 * C) + 2 * 128 + C;
  const int64_t sparse = attention + 128 * C + 128 * 3 * 768 * C, dense = attention + 3 * 6144 * C;
  EXPECT_EQ(s.ParameterCount(), 2 * 151936 * C + C + 23 * sparse + 25 * dense);
  const FamilyTensors f = TensorsOf(s);
  ASSERT_FALSE(f.dense_block.empty());
  EXPECT_EQ(&f.Block(s, 0), &f.dense_block);
  EXPECT_EQ(&f.Block(s, 1), &f.block);
  std::vector<std::string> names;
  for (const TensorInfo& t : f.dense_block) names.push_back(HuggingFaceName(t, 0));
  EXPECT_EQ(names, (std::vector<std::string>{
                       "model.layers.0.input_layernorm.weight", "model.layers.0.self_attn.q_proj.weight",
                       "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.weight",
                       "model.layers.0.self_attn.q_norm.weight", "model.layers.0.self_attn.k_norm.weight",
                       "model.layers.0.self_attn.o_proj.weight", "model.layers.0.post_attention_layernorm.weight",
                       "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight",
                       "model.layers.0.mlp.down_proj.weight"}));
  EXPECT_EQ(f.dense_block[8].shape, (std::vector<int64_t>{6144, C}));
  // The sparse blocks' attention is the dense blocks': the same tensors first.
  for (size_t i = 0; i < 8; ++i) EXPECT_EQ(f.block[i].kind, f.dense_block[i].kind) << i;
  EXPECT_EQ(f.block[8].kind, Param::kRouter);
  // The FLOPs of a mean block: sparse and dense in their shares.
  const double flops_sparse = 2.0 * (attention - C - C - 2 * 128 + 128 * C + 8 * 3 * 768 * C);
  const double flops_dense = 2.0 * (attention - C - C - 2 * 128 + 3 * 6144 * C);
  EXPECT_DOUBLE_EQ(BlockForwardFlopsPerToken(s, 2048, 1),
                   (23 * flops_sparse + 25 * flops_dense) / 48 + 4.0 * 2048 * 32 * 128);
  EXPECT_EQ(FirstBlockOfKind(s, true), 0);
  EXPECT_EQ(FirstBlockOfKind(s, false), 1);
  EXPECT_DOUBLE_EQ(BlockForwardFlopsPerToken(s, 2048, 2, 1), (flops_sparse + 4.0 * 2048 * 32 * 128) / 2);
  EXPECT_DOUBLE_EQ(BlockForwardFlopsPerToken(s, 2048, 2, 47), (flops_dense + 4.0 * 2048 * 32 * 128) / 2);
  // config.json round trip, and the dense width is no longer called unused.
  const Json written = HuggingFaceConfigJson(s, "bfloat16");
  EXPECT_EQ(written.at("decoder_sparse_step"), 2);
  EXPECT_EQ(written.at("mlp_only_layers"), Json({47, 10}));
  EXPECT_EQ(MoeShapeOfConfig(written), s);
  EXPECT_NE(DescribeShape(s).find("dense MLP 6144 in blocks 0 2 4"), std::string::npos) << DescribeShape(s);
  EXPECT_NE(DescribeShape(*FindPreset("qwen3-30b-a3b")).find("dense MLP 6144 (unused)"), std::string::npos);
  // The dense blocks' MLP is split by TP like any dense MLP.
  ModelShape odd = s;
  odd.intermediate = 6150;
  EXPECT_TRUE(TensorParallelDivides(odd, 1));
  EXPECT_FALSE(TensorParallelDivides(odd, 4));
  EXPECT_TRUE(TensorParallelDivides(*FindPreset("qwen3-30b-a3b"), 4));
}

TEST(MoeFamilies, ConfigKeysThatWouldChangeTheMathAreRefusedByKey) {
  auto mixtral = [](const char* key, Json value) {
    Json c = Mixtral8x7b();
    c[key] = std::move(value);
    return c;
  };
  auto qwen = [](const char* key, Json value) {
    Json c = Qwen3_30bA3b();
    c[key] = std::move(value);
    return c;
  };
  // Accepted where they change nothing.
  EXPECT_EQ(MoeConfigError(mixtral("router_jitter_noise", 0)), "");
  EXPECT_EQ(MoeConfigError(mixtral("sliding_window", nullptr)), "");
  EXPECT_EQ(MoeConfigError(qwen("use_sliding_window", false)), "");
  EXPECT_EQ(MoeConfigError(qwen("max_window_layers", 28)), "");
  EXPECT_EQ(MoeConfigError(qwen("intermediate_size", 12345)), "");  // the unused dense width
  EXPECT_EQ(MoeConfigError(qwen("shared_expert_intermediate_size", 0)), "");
  // output_router_logits turns the load-balancing loss on, with router_aux_loss_coef
  // (transformers' 0.001 where it is absent); false leaves it off.
  Json logits = mixtral("output_router_logits", true);
  logits["router_aux_loss_coef"] = 0.02;
  EXPECT_EQ(ParseHuggingFaceConfig(logits.dump(), "config.json").router_aux_loss_coef, 0.02);
  logits.erase("router_aux_loss_coef");
  EXPECT_EQ(ParseHuggingFaceConfig(logits.dump(), "config.json").router_aux_loss_coef, 0.001);
  EXPECT_FALSE(ParseHuggingFaceConfig(Mixtral8x7b().dump(), "config.json").router_aux_loss_coef.has_value());
  struct Bad {
    Json config;
    std::string want;
  };
  for (const Bad& b : std::vector<Bad>{
           {mixtral("router_jitter_noise", 0.01), "config.json: router_jitter_noise 0.01 is not implemented"},
           {[&] {
              Json c = mixtral("router_aux_loss_coef", -1);
              c["output_router_logits"] = true;
              return c;
            }(),
            "config.json: router_aux_loss_coef must not be negative"},
           {mixtral("num_experts_per_tok", 9), "config.json: num_experts_per_tok 9 exceeds num_local_experts (8)"},
           {mixtral("num_local_experts", 0), "config.json: num_local_experts must be a positive integer"},
           {mixtral("hidden_act", "gelu"), "config.json: hidden_act gelu is not implemented"},
           {qwen("shared_expert_intermediate_size", 5632),
            "config.json: shared_expert_intermediate_size 5632 is not implemented"},
           {qwen("decoder_sparse_step", 0), "config.json: decoder_sparse_step must be a positive integer"},
           {qwen("mlp_only_layers", {0, 48}),
            "config.json: mlp_only_layers [0,48]: 48 is not a block index below 48 (num_hidden_layers)"},
           {qwen("mlp_only_layers", 3), "config.json: mlp_only_layers must be a list of block indices, got 3"},
           {qwen("use_sliding_window", true), "config.json: use_sliding_window true is not implemented"},
           {qwen("layer_types", {"full_attention", "sliding_attention"}),
            "config.json: layer_types[1] \"sliding_attention\" is not implemented"},
           {qwen("attention_bias", true), "config.json: attention_bias true is not implemented"},
       }) {
    const std::string error = MoeConfigError(b.config);
    EXPECT_NE(error.find(b.want), std::string::npos) << "want \"" << b.want << "\", got \"" << error << "\"";
  }
  Json qwen2_moe = Qwen3_30bA3b();  // shared experts: not a family here
  qwen2_moe["architectures"] = {"Qwen2MoeForCausalLM"};
  EXPECT_NE(MoeConfigError(qwen2_moe).find("architecture Qwen2MoeForCausalLM is not one meshtrain trains"),
            std::string::npos);
}

// Each expert's tensors by the names of published checkpoints; the router and the
// experts decay; a block's experts' gate and up make one (E,2I,C) stack, their downs one
// (E,C,I).
TEST(MoeFamilies, TensorsHaveThePerExpertNamesOfPublishedCheckpoints) {
  const FamilyTensors mixtral = TensorsOf(*FindPreset("moe-tiny"));
  std::vector<std::string> names;
  for (const TensorInfo& t : mixtral.block) names.push_back(HuggingFaceName(t, 1));
  const std::vector<std::string> want = {
      "model.layers.1.input_layernorm.weight",
      "model.layers.1.self_attn.q_proj.weight",
      "model.layers.1.self_attn.k_proj.weight",
      "model.layers.1.self_attn.v_proj.weight",
      "model.layers.1.self_attn.o_proj.weight",
      "model.layers.1.post_attention_layernorm.weight",
      "model.layers.1.block_sparse_moe.gate.weight",
      "model.layers.1.block_sparse_moe.experts.0.w1.weight",
      "model.layers.1.block_sparse_moe.experts.0.w3.weight",
      "model.layers.1.block_sparse_moe.experts.1.w1.weight",
      "model.layers.1.block_sparse_moe.experts.1.w3.weight",
      "model.layers.1.block_sparse_moe.experts.2.w1.weight",
      "model.layers.1.block_sparse_moe.experts.2.w3.weight",
      "model.layers.1.block_sparse_moe.experts.3.w1.weight",
      "model.layers.1.block_sparse_moe.experts.3.w3.weight",
      "model.layers.1.block_sparse_moe.experts.0.w2.weight",
      "model.layers.1.block_sparse_moe.experts.1.w2.weight",
      "model.layers.1.block_sparse_moe.experts.2.w2.weight",
      "model.layers.1.block_sparse_moe.experts.3.w2.weight",
  };
  EXPECT_EQ(names, want);
  for (const TensorInfo& t : mixtral.block) {
    EXPECT_EQ(t.decay, t.shape.size() == 2) << t.name << ": every matrix decays, the router's too";
    if (t.kind == Param::kRouter) {
      EXPECT_EQ(t.shape, (std::vector<int64_t>{4, 64}));
    } else if (t.kind == Param::kExpertGate || t.kind == Param::kExpertUp) {
      EXPECT_EQ(t.shape, (std::vector<int64_t>{48, 64}));
    } else if (t.kind == Param::kExpertDown) {
      EXPECT_EQ(t.shape, (std::vector<int64_t>{64, 48}));
    }
  }
  std::set<std::string> ours;
  const FamilyTensors qwen = TensorsOf(*FindPreset("qwen3-moe-tiny"));
  for (const TensorInfo& t : qwen.block) EXPECT_TRUE(ours.insert(t.name).second) << t.name << " twice";
  auto named = [&](const std::string& hf) {
    for (const TensorInfo& t : qwen.block) {
      if (HuggingFaceName(t, 0) == hf) return t.shape;
    }
    return std::vector<int64_t>{};
  };
  EXPECT_EQ(named("model.layers.0.self_attn.q_norm.weight"), (std::vector<int64_t>{16}));
  EXPECT_EQ(named("model.layers.0.self_attn.k_norm.weight"), (std::vector<int64_t>{16}));
  EXPECT_EQ(named("model.layers.0.mlp.gate.weight"), (std::vector<int64_t>{4, 64}));
  EXPECT_EQ(named("model.layers.0.mlp.experts.3.gate_proj.weight"), (std::vector<int64_t>{32, 64}));
  EXPECT_EQ(named("model.layers.0.mlp.experts.3.up_proj.weight"), (std::vector<int64_t>{32, 64}));
  EXPECT_EQ(named("model.layers.0.mlp.experts.3.down_proj.weight"), (std::vector<int64_t>{64, 32}));
  EXPECT_EQ(named("model.layers.0.mlp.gate_proj.weight"), std::vector<int64_t>{}) << "no dense MLP";
}

// A job of 2 ranks on one node with `model`, `parallelism` and `training` (over a batch of
// 1,024 tokens in micro-batches of 2), checked.
CheckedJob CheckMoeJob(const Json& model, const Json& parallelism, const Json& training,
                       ModelDirectory directory = ModelDirectory::kNotRead) {
  Json manifest = {{"apiVersion", "meshtrain.dev/v1alpha1"},
                   {"kind", "TrainingJob"},
                   {"metadata", {{"name", "moe"}}},
                   {"spec",
                    {{"image", "meshtrain"},
                     {"nodes", 1},
                     {"gpusPerNode", 2},
                     {"model", model},
                     {"data", {{"train", "/data/*.bin"}}},
                     {"parallelism", parallelism},
                     {"training", {{"globalBatchTokens", 1024}, {"microBatchSize", 2}}}}}};
  manifest["spec"]["training"].update(training);
  return CheckTrainingJob(manifest, "moe.yaml", 0, directory);
}

// A Hugging Face directory whose config.json turns the load-balancing loss on gives the job
// its coefficient, with a note; spec.training.routerAuxLossCoef, where set, is the one used.
TEST(MoeFamilies, TheJobsAuxLossCoefficientTakesPrecedenceOverConfigJsons) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("meshtrain-moe-coef-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  Json config = Mixtral8x7b();
  config["output_router_logits"] = true;
  config["router_aux_loss_coef"] = 0.02;
  std::ofstream(dir / "config.json") << config.dump();
  auto check = [&](const Json& training) {
    return CheckMoeJob({{"init", {{"from", dir.string()}}}, {"seqLen", 256}}, Json::object(), training,
                       ModelDirectory::kIfPresent);
  };
  const CheckedJob from_config = check(Json::object());
  ASSERT_TRUE(from_config.ok()) << from_config.errors.front().ToString();
  EXPECT_EQ(from_config.job.spec.training.router_aux_loss_coef, std::optional<double>(0.02));
  const CheckedJob own = check({{"routerAuxLossCoef", 0.5}});
  ASSERT_TRUE(own.ok()) << own.errors.front().ToString();
  EXPECT_EQ(own.job.spec.training.router_aux_loss_coef, std::optional<double>(0.5));
  std::filesystem::remove_all(dir);
}

// spec.model's expert fields, checked by field.
TEST(MoeFamilies, ExpertFieldsAreCheckedByField) {
  auto check = [](const Json& model, const Json& parallelism = Json::object(), const Json& training = Json::object()) {
    return CheckMoeJob(model, parallelism, training);
  };
  auto paths = [](const CheckedJob& job) {
    std::set<std::string> p;
    for (const FieldError& e : job.errors) p.insert(e.path);
    return p;
  };
  auto message = [](const CheckedJob& job) { return job.errors.empty() ? std::string() : job.errors[0].ToString(); };
  const CheckedJob tiny = check({{"preset", "moe-tiny"}});
  ASSERT_TRUE(tiny.ok()) << message(tiny);
  EXPECT_EQ(ShapeOf(tiny.job.spec.model), *FindPreset("moe-tiny"));
  EXPECT_EQ(tiny.job.spec.model.experts, 4);
  const CheckedJob qwen = check({{"preset", "qwen3-moe-tiny"}, {"expertsPerToken", 3}, {"normTopkProb", false}});
  ASSERT_TRUE(qwen.ok()) << message(qwen);
  EXPECT_EQ(ShapeOf(qwen.job.spec.model).experts_per_token, 3);
  EXPECT_FALSE(ShapeOf(qwen.job.spec.model).norm_topk_prob);
  // A whole shape without a preset, and the JSON codec's round trip of it.
  const Json explicit_model = {{"family", "qwen3_moe"}, {"layers", 2},  {"heads", 4},  {"hidden", 64},
                               {"vocabSize", 256},      {"seqLen", 64}, {"kvHeads", 2}, {"headDim", 16},
                               {"experts", 4},          {"expertsPerToken", 2}, {"moeIntermediateSize", 32},
                               {"normTopkProb", true},  {"decoderSparseStep", 1}};
  const CheckedJob whole = check(explicit_model);
  ASSERT_TRUE(whole.ok()) << message(whole);
  EXPECT_EQ(ToJson(whole.job)["spec"]["model"]["moeIntermediateSize"], 32);
  EXPECT_EQ(ToJson(whole.job)["spec"]["model"]["expertsPerToken"], 2);
  EXPECT_EQ(ToJson(whole.job)["spec"]["model"]["normTopkProb"], true);

  // top-k > E, named by field.
  const CheckedJob too_many = check({{"preset", "moe-tiny"}, {"expertsPerToken", 5}});
  EXPECT_EQ(paths(too_many), std::set<std::string>{"spec.model.expertsPerToken"});
  EXPECT_NE(message(too_many).find("must not exceed spec.model.experts (4), got 5"), std::string::npos)
      << message(too_many);
  Json missing = explicit_model;
  missing.erase("experts");
  missing.erase("moeIntermediateSize");
  EXPECT_EQ(paths(check(missing)), (std::set<std::string>{"spec.model.experts", "spec.model.moeIntermediateSize"}));
  EXPECT_EQ(paths(check({{"preset", "moe-tiny"}, {"experts", 0}})), std::set<std::string>{"spec.model.experts"});
  EXPECT_EQ(paths(check({{"preset", "moe-tiny"}, {"normTopkProb", false}})),
            std::set<std::string>{"spec.model.normTopkProb"});
  EXPECT_EQ(paths(check({{"preset", "moe-tiny"}, {"moeIntermediateSize", 64}})),
            std::set<std::string>{"spec.model.moeIntermediateSize"});
  const CheckedJob wider = check({{"preset", "moe-tiny"}, {"intermediateSize", 64}});  // Mixtral's experts follow it
  ASSERT_TRUE(wider.ok()) << message(wider);
  EXPECT_EQ(ShapeOf(wider.job.spec.model).moe_intermediate, 64);
  // Qwen3-MoE's dense blocks: block 0 of 2 at step 2, block 1 where mlpOnlyLayers names it.
  const CheckedJob step2 = check({{"preset", "qwen3-moe-tiny"}, {"decoderSparseStep", 2}});
  ASSERT_TRUE(step2.ok()) << message(step2);
  EXPECT_TRUE(ShapeOf(step2.job.spec.model).DenseBlock(0));
  EXPECT_FALSE(ShapeOf(step2.job.spec.model).DenseBlock(1));
  const CheckedJob only1 = check({{"preset", "qwen3-moe-tiny"}, {"mlpOnlyLayers", {1}}});
  ASSERT_TRUE(only1.ok()) << message(only1);
  EXPECT_EQ(ShapeOf(only1.job.spec.model).DenseBlocks(), 1);
  EXPECT_EQ(ToJson(only1.job)["spec"]["model"]["mlpOnlyLayers"], Json({1}));
  EXPECT_EQ(paths(check({{"preset", "qwen3-moe-tiny"}, {"mlpOnlyLayers", {2}}})),
            std::set<std::string>{"spec.model.mlpOnlyLayers[0]"});  // 2 blocks: 0 and 1
  const CheckedJob none_sparse = check({{"preset", "qwen3-moe-tiny"}, {"mlpOnlyLayers", {1, 0}}});
  EXPECT_EQ(paths(none_sparse), std::set<std::string>{"spec.model.mlpOnlyLayers"});
  EXPECT_NE(message(none_sparse).find("leaves no sparse block of the 2"), std::string::npos) << message(none_sparse);
  EXPECT_EQ(paths(check({{"preset", "qwen3-moe-tiny"}, {"decoderSparseStep", 3}})),
            std::set<std::string>{"spec.model.decoderSparseStep"});
  Json dense_without_width = explicit_model;
  dense_without_width["mlpOnlyLayers"] = {0};
  EXPECT_EQ(paths(check(dense_without_width)), std::set<std::string>{"spec.model.intermediateSize"});
  dense_without_width["intermediateSize"] = 96;
  EXPECT_TRUE(paths(check(dense_without_width)).empty());
  // Mixtral's blocks are all sparse.
  EXPECT_EQ(paths(check({{"preset", "moe-tiny"}, {"decoderSparseStep", 2}})),
            std::set<std::string>{"spec.model.decoderSparseStep"});
  EXPECT_EQ(paths(check({{"preset", "moe-tiny"}, {"mlpOnlyLayers", {0}}})),
            std::set<std::string>{"spec.model.mlpOnlyLayers[0]"});
  // A dense family takes no expert field.
  EXPECT_EQ(paths(check({{"preset", "llama-tiny"}, {"experts", 4}, {"expertsPerToken", 2}})),
            (std::set<std::string>{"spec.model.experts", "spec.model.expertsPerToken"}));
  // Tensor parallelism splits each expert's width: TP 2 on moe-tiny; a TP degree that does not divide the experts' width is named by
  // field (Mixtral's width is intermediateSize, Qwen3-MoE's moeIntermediateSize).
  const CheckedJob tp = check({{"preset", "moe-tiny"}}, {{"tensorParallelDegree", 2}});
  EXPECT_TRUE(paths(tp).empty()) << message(tp);
  const CheckedJob odd = check({{"preset", "moe-tiny"}, {"intermediateSize", 45}}, {{"tensorParallelDegree", 2}});
  EXPECT_EQ(paths(odd), std::set<std::string>{"spec.parallelism.tensorParallelDegree"});
  EXPECT_NE(message(odd).find("must divide the MLP width (spec.model.intermediateSize = 45)"), std::string::npos)
      << message(odd);
  const CheckedJob narrow = check({{"preset", "qwen3-moe-tiny"}, {"moeIntermediateSize", 45}},
                                  {{"tensorParallelDegree", 2}});
  EXPECT_EQ(paths(narrow), std::set<std::string>{"spec.parallelism.tensorParallelDegree"});
  EXPECT_NE(message(narrow).find("must divide the experts' width (spec.model.moeIntermediateSize = 45)"),
            std::string::npos)
      << message(narrow);
  // Qwen3-MoE's dense intermediateSize sizes nothing (every block is sparse): TP need not
  // divide it, as TensorParallelDivides and the engine do not ask.
  const CheckedJob unused =
      check({{"preset", "qwen3-moe-tiny"}, {"intermediateSize", 45}}, {{"tensorParallelDegree", 2}});
  EXPECT_TRUE(paths(unused).empty()) << message(unused);
  EXPECT_TRUE(TensorParallelDivides(ShapeOf(unused.job.spec.model), 2));
  // With dense blocks it sizes their MLP, which TP splits.
  const CheckedJob used = check({{"preset", "qwen3-moe-tiny"}, {"intermediateSize", 45}, {"mlpOnlyLayers", {0}}},
                                {{"tensorParallelDegree", 2}});
  EXPECT_EQ(paths(used), std::set<std::string>{"spec.parallelism.tensorParallelDegree"});
  EXPECT_NE(message(used).find("intermediateSize"), std::string::npos) << message(used);
  // A load-balancing loss takes every block's routing at once, summed over pipeline
  // stages; a dense model has none.
  const CheckedJob staged = check({{"preset", "moe-tiny"}}, {{"pipelineParallelDegree", 2}});
  EXPECT_TRUE(paths(staged).empty()) << message(staged);
  Json aux = {{"routerAuxLossCoef", 0.01}};
  EXPECT_TRUE(paths(check({{"preset", "moe-tiny"}}, Json::object(), aux)).empty());
  const CheckedJob staged_aux = check({{"preset", "moe-tiny"}}, {{"pipelineParallelDegree", 2}}, aux);
  EXPECT_TRUE(paths(staged_aux).empty()) << message(staged_aux);
  EXPECT_EQ(paths(check({{"preset", "llama-tiny"}}, {{"pipelineParallelDegree", 2}}, aux)),
            std::set<std::string>{"spec.training.routerAuxLossCoef"});
  // Expert parallelism must divide the experts (4), under either spelling.
  const CheckedJob ep = check({{"preset", "moe-tiny"}}, {{"expertParallelDegree", 3}});
  EXPECT_EQ(paths(ep), std::set<std::string>{"spec.parallelism.expertParallelDegree"});
  const bool names_experts = std::any_of(ep.errors.begin(), ep.errors.end(), [](const FieldError& e) {
    return e.ToString().find("must divide spec.model.experts (4)") != std::string::npos;
  });
  EXPECT_TRUE(names_experts) << message(ep);
  EXPECT_EQ(paths(check({{"preset", "moe-tiny"}}, {{"expert_parallel_degree", 3}})),
            std::set<std::string>{"spec.parallelism.expertParallelDegree"});
  // ... and the data-parallel ranks of a shard group: EP 4 divides the 4 experts, not the
  // 2 ranks here.
  const CheckedJob wide = check({{"preset", "moe-tiny"}}, {{"expertParallelDegree", 4}});
  EXPECT_EQ(paths(wide), std::set<std::string>{"spec.parallelism.expertParallelDegree"});
  const bool names_ranks = std::any_of(wide.errors.begin(), wide.errors.end(), [](const FieldError& e) {
    return e.ToString().find("must divide the ranks of a shard group") != std::string::npos;
  });
  EXPECT_TRUE(names_ranks) << message(wide);
  const bool not_experts = std::none_of(wide.errors.begin(), wide.errors.end(), [](const FieldError& e) {
    return e.ToString().find("must divide spec.model.experts") != std::string::npos;
  });
  EXPECT_TRUE(not_experts) << message(wide);
  // The planner offers a mixture the TP degrees that divide what the engine splits (the
  // heads, key/value heads and the experts' width: TensorParallelSplits), and no other.
  EXPECT_TRUE(TensorParallelDivides(*FindPreset("moe-tiny"), 2));
  EXPECT_TRUE(TensorParallelDivides(*FindPreset("qwen3-moe-tiny"), 2));
  EXPECT_TRUE(TensorParallelDivides(*FindPreset("qwen3-30b-a3b"), 4));
  EXPECT_TRUE(TensorParallelDivides(*FindPreset("mixtral-8x7b"), 8));
  EXPECT_FALSE(TensorParallelDivides(*FindPreset("moe-tiny"), 4));       // 2 key/value heads
  EXPECT_FALSE(TensorParallelDivides(*FindPreset("qwen3-30b-a3b"), 8));  // 4 key/value heads
  ModelShape narrow_experts = *FindPreset("qwen3-moe-tiny");
  narrow_experts.moe_intermediate = 45;  // the attention divides; the experts' width does not
  EXPECT_TRUE(TensorParallelDivides(narrow_experts, 1));
  EXPECT_FALSE(TensorParallelDivides(narrow_experts, 2));
  ModelShape odd_experts = *FindPreset("moe-tiny");
  odd_experts.intermediate = 45;  // Mixtral's experts are the MLP's width
  EXPECT_FALSE(TensorParallelDivides(odd_experts, 2));
  EXPECT_TRUE(TensorParallelDivides(*FindPreset("qwen3-8b"), 2));
}

}  // namespace
}  // namespace meshtrain::api
