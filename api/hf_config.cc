#include "api/hf_config.h"

#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>

#include "api/hf_config_keys.h"
#include "api/json_depth.h"
#include "api/model_family.h"

namespace meshtrain::api {
namespace {

using Json = nlohmann::json;


// " at byte B (line L, column C)" of `offset` in `text`.
std::string PlaceIn(std::string_view text, size_t offset) {
  size_t line = 1, line_start = 0;
  for (size_t i = 0; i < offset && i < text.size(); ++i) {
    if (text[i] == '\n') ++line, line_start = i + 1;
  }
  return " at byte " + std::to_string(offset) + " (line " + std::to_string(line) + ", column " +
         std::to_string(offset - line_start + 1) + ")";
}

// nlohmann's message without its "[json.exception.parse_error.101] parse error at line 1,
// column 2: " prefix (or "[json.exception.out_of_range.406] ").
std::string JsonReason(const Json::exception& e) {
  const std::string what = e.what();
  const size_t parse = what.find("parse error");
  const size_t colon = what.find(": ", parse == std::string::npos ? 0 : parse);
  if (parse != std::string::npos && colon != std::string::npos) return what.substr(colon + 2);
  const size_t bracket = what.find("] ");
  return bracket == std::string::npos ? what : what.substr(bracket + 2);
}

const ModelFamily& FamilyOf(const Json& j, const ConfigKeys& keys) {
  std::string architecture;
  if (j.contains("architectures") && j.at("architectures").is_array() && !j.at("architectures").empty()) {
    if (!j.at("architectures")[0].is_string()) keys.Fail("architectures must list names");
    architecture = j.at("architectures")[0].get<std::string>();
  }
  const std::optional<std::string> model_type = keys.String("model_type");
  if (architecture.empty() && model_type) {
    if (const ModelFamily* family = FindFamily(*model_type)) return *family;
  }
  if (const ModelFamily* family = FindFamilyOfArchitecture(architecture)) return *family;
  keys.Fail("architecture " + (architecture.empty() ? "(none; model_type " + model_type.value_or("none") + ")"
                                                     : architecture) +
            " is not one meshtrain trains; it trains " + FamilyList(/*architectures=*/true));
}

// RoPE's scaling from an object of rope_scaling's form (transformers 4) or of
// rope_parameters' (transformers 5, which also holds rope_theta); nullopt for none.
std::optional<RopeScalingSpec> ScalingOf(const Json& r, const std::string& file, const char* key) {
  if (!r.is_object()) throw HuggingFaceConfigError(file + ": " + key + " must be an object, got " + r.dump());
  const ConfigKeys k(r, file);
  std::optional<std::string> type = k.String("rope_type");
  if (!type) type = k.String("type");
  if (!type) k.Fail(std::string(key) + " has neither rope_type nor type");
  k.Require("partial_rotary_factor", k.Number("partial_rotary_factor"), 1.0, "RoPE rotates every channel of a head");
  if (*type == "default") return std::nullopt;
  if (*type != "linear" && *type != "llama3") {
    k.Fail(std::string(key) + " type \"" + *type + "\" is not implemented: meshtrain takes default, linear and llama3");
  }
  RopeScalingSpec s;
  s.type = *type;
  s.factor = k.Number("factor");
  if (!s.factor || *s.factor <= 0) k.Fail(std::string(key) + " has no positive factor");
  if (*type == "llama3") {
    s.low_freq_factor = k.Number("low_freq_factor");
    s.high_freq_factor = k.Number("high_freq_factor");
    s.original_max_positions = k.OptionalInt("original_max_position_embeddings");
    if (!s.low_freq_factor || !s.high_freq_factor || !s.original_max_positions) {
      k.Fail(std::string(key) +
             " of type llama3 needs low_freq_factor, high_freq_factor and original_max_position_embeddings");
    }
  }
  return s;
}

}  // namespace

void ReadRopeConfig(const Json& j, const std::string& file, HuggingFaceConfig* c) {
  const bool legacy = j.contains("rope_scaling") && !j.at("rope_scaling").is_null();
  const bool parameters = j.contains("rope_parameters") && !j.at("rope_parameters").is_null();
  const std::optional<RopeScalingSpec> scaling =
      legacy ? ScalingOf(j.at("rope_scaling"), file, "rope_scaling") : std::nullopt;
  if (!parameters) {
    c->model.rope_scaling = scaling;
    return;
  }
  const Json& r = j.at("rope_parameters");
  const std::optional<RopeScalingSpec> from_parameters = ScalingOf(r, file, "rope_parameters");
  if (legacy && scaling != from_parameters) {
    throw HuggingFaceConfigError(file + ": rope_scaling and rope_parameters disagree");
  }
  c->model.rope_scaling = from_parameters;
  if (const std::optional<double> theta = ConfigKeys(r, file).Number("rope_theta")) {
    if (j.contains("rope_theta") && !j.at("rope_theta").is_null() && *c->model.rope_theta != *theta) {
      throw HuggingFaceConfigError(file + ": rope_theta " + Json(*c->model.rope_theta).dump() +
                                   " disagrees with rope_parameters' " + Json(*theta).dump());
    }
    c->model.rope_theta = theta;
  }
}

namespace {

std::string Show(const std::optional<int64_t>& v) { return v ? std::to_string(*v) : "unset"; }
std::string Show(const std::optional<double>& v) { return v ? Json(*v).dump() : "unset"; }
std::string Show(const std::optional<bool>& v) { return v ? (*v ? "true" : "false") : "unset"; }

bool FileExists(const std::string& path, bool directory) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && (directory ? S_ISDIR(st.st_mode) : S_ISREG(st.st_mode));
}

}  // namespace

Json ParseModelJson(std::string_view text, const std::string& file, const Json::parser_callback_t& callback) {
  if (const size_t at = FirstJsonLevelDeeperThan(text, kMaxModelJsonDepth); at != std::string_view::npos) {
    throw ModelJsonError(file, "JSON nested deeper than " + std::to_string(kMaxModelJsonDepth) + PlaceIn(text, at));
  }
  try {
    return Json::parse(text, callback);
  } catch (const Json::parse_error& e) {
    // e.byte counts from 1 and may be one past the end (the input ended).
    const size_t at = std::min(e.byte == 0 ? 0 : e.byte - 1, text.size());
    throw ModelJsonError(file, "not valid JSON" + PlaceIn(text, at) + ": " + JsonReason(e));
  } catch (const Json::out_of_range& e) {  // a number past a double's range
    throw ModelJsonError(file, "not valid JSON: " + JsonReason(e));
  }
}

HuggingFaceConfig ParseHuggingFaceConfig(std::string_view text, const std::string& file) {
  Json j;
  try {
    j = ParseModelJson(text, file);
  } catch (const ModelJsonError& e) {
    throw HuggingFaceConfigError(e.what());
  }
  if (!j.is_object()) throw HuggingFaceConfigError(file + ": not a JSON object");
  HuggingFaceConfig c;
  c.file = file;
  const ConfigKeys keys(j, file);
  const ModelFamily& family = FamilyOf(j, keys);
  c.model.family = std::string(family.name());
  family.ReadConfig(j, keys, &c);
  return c;
}

HuggingFaceConfig ReadHuggingFaceConfig(const std::string& directory) {
  const std::string file = directory + "/config.json";
  if (!FileExists(file, false)) throw HuggingFaceConfigError(file + ": missing or not a regular file");
  std::ifstream in(file, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  if (!in && !in.eof()) throw HuggingFaceConfigError(file + ": unreadable");
  return ParseHuggingFaceConfig(text.str(), file);
}

nlohmann::json HuggingFaceConfigJson(const ModelShape& shape, std::string_view torch_dtype) {
  const ModelShape s = shape.Resolved();
  Json j;
  j["architectures"] = {std::string(s.Family().architecture())};
  j["model_type"] = s.family;
  j["vocab_size"] = s.vocab_size;
  j["torch_dtype"] = std::string(torch_dtype);
  j["initializer_range"] = 0.02;
  j["use_cache"] = true;
  s.Family().WriteConfig(s, &j);
  return j;
}

FieldErrors MergeHuggingFaceConfig(const HuggingFaceConfig& config, ModelSpec* model) {
  FieldErrors errors;
  const ModelSpec& c = config.model;
  const std::string from = "spec.model.init.from's " + config.file;
  auto merge = [&](const char* field, auto& mine, const auto& theirs, const char* key) {
    if (!theirs) return;
    if (!mine) {
      mine = theirs;
    } else if (*mine != *theirs) {
      errors.push_back({std::string("spec.model.") + field,
                        Show(mine) + " disagrees with " + from + ", whose " + key + " is " + Show(theirs)});
    }
  };
  const ModelFamily& family = *FindFamily(c.family);  // ParseHuggingFaceConfig named it
  const ModelFamily::ConfigNames& key = family.config_names();
  if (model->family.empty()) {
    model->family = c.family;
  } else if (model->family != c.family) {
    errors.push_back({"spec.model.family", model->family + " disagrees with " + from + ", whose architecture is " +
                                               std::string(family.architecture())});
  }
  merge("layers", model->layers, c.layers, key.layers);
  merge("heads", model->heads, c.heads, key.heads);
  merge("hidden", model->hidden, c.hidden, key.hidden);
  merge("vocabSize", model->vocab_size, c.vocab_size, "vocab_size");
  merge("maxPositions", model->max_positions, c.max_positions, key.max_positions);
  merge("kvHeads", model->kv_heads, c.kv_heads, "num_key_value_heads");
  merge("headDim", model->head_dim, c.head_dim, "head_dim");
  merge("intermediateSize", model->intermediate_size, c.intermediate_size, "intermediate_size");
  merge("normEps", model->norm_eps, c.norm_eps, "rms_norm_eps");
  merge("ropeTheta", model->rope_theta, c.rope_theta, "rope_theta");
  merge("tieEmbeddings", model->tie_embeddings, c.tie_embeddings, "tie_word_embeddings");
  merge("experts", model->experts, c.experts, "num_local_experts (or num_experts)");
  merge("expertsPerToken", model->experts_per_token, c.experts_per_token, "num_experts_per_tok");
  merge("moeIntermediateSize", model->moe_intermediate_size, c.moe_intermediate_size,
        "moe_intermediate_size (Mixtral: intermediate_size)");
  merge("normTopkProb", model->norm_topk_prob, c.norm_topk_prob, "norm_topk_prob");
  merge("decoderSparseStep", model->decoder_sparse_step, c.decoder_sparse_step, "decoder_sparse_step");
  if (model->mlp_only_layers.empty()) {
    model->mlp_only_layers = c.mlp_only_layers;
  } else if (model->mlp_only_layers != c.mlp_only_layers) {
    errors.push_back({"spec.model.mlpOnlyLayers", "disagrees with " + from + "'s mlp_only_layers"});
  }
  if (c.rope_scaling) {
    if (!model->rope_scaling) {
      model->rope_scaling = c.rope_scaling;
    } else if (*model->rope_scaling != *c.rope_scaling) {
      errors.push_back({"spec.model.ropeScaling", "disagrees with " + from + "'s rope_scaling (type " +
                                                      c.rope_scaling->type + ", factor " +
                                                      Show(c.rope_scaling->factor) + ")"});
    }
  } else if (model->rope_scaling) {
    errors.push_back({"spec.model.ropeScaling", "is set, but " + from + " has no rope_scaling"});
  }
  const ModelShape* preset = FindPreset(model->preset);
  if (preset != nullptr && FindFamily(model->family)) {  // an unknown family is validation's to name
    // The config gave every field, so a preset would only be checked: it must agree.
    const ModelShape mine = preset->Resolved();
    ModelSpec spec = *model;
    spec.seq_len = mine.seq_len;
    const ModelShape theirs = ShapeOf(spec);
    if (!(mine == theirs)) {
      errors.push_back({"spec.model.preset", model->preset + " (" + DescribeShape(mine) + ") disagrees with " + from +
                                                 " (" + DescribeShape(theirs) + ")"});
    }
  }
  const int64_t positions = *c.max_positions;
  if (!model->seq_len) model->seq_len = family.DefaultSeqLen(positions);
  if (*model->seq_len > positions) {
    errors.push_back({"spec.model.seqLen", std::to_string(*model->seq_len) + " exceeds " + from + "'s " +
                                               key.max_positions + " (" +
                                               std::to_string(positions) + ")"});
  }
  if (config.sliding_window && *config.sliding_window < *model->seq_len) {
    errors.push_back({"spec.model.seqLen", std::to_string(*model->seq_len) + " exceeds " + from +
                                               "'s sliding_window (" + std::to_string(*config.sliding_window) +
                                               "): meshtrain has no sliding-window attention, and a window of the "
                                               "whole sequence would train another model"});
  }
  return errors;
}

}  // namespace meshtrain::api
