#include "api/hf_config.h"

#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>

#include "api/json_depth.h"

namespace meshtrain::api {
namespace {

using Json = nlohmann::json;

// Sizes in config.json are below this: products of two of them fit int64.
constexpr int64_t kConfigIntegerLimit = int64_t(1) << 31;

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

// Reads keys of one config object, each error naming the file and the key.
class Keys {
 public:
  Keys(const Json& j, const std::string& file) : j_(j), file_(file) {}

  [[noreturn]] void Fail(const std::string& message) const { throw HuggingFaceConfigError(file_ + ": " + message); }

  bool Has(const char* key) const { return j_.contains(key) && !j_.at(key).is_null(); }

  int64_t Int(const char* key) const {
    if (!Has(key)) Fail(std::string("has no ") + key);
    return OptionalInt(key).value();
  }
  std::optional<int64_t> OptionalInt(const char* key) const {
    if (!Has(key)) return std::nullopt;
    const Json& v = j_.at(key);
    // An unsigned value past int64's range reads as a negative one here.
    if (!v.is_number_integer() || v.get<int64_t>() < 1 || v.get<int64_t>() >= kConfigIntegerLimit) {
      Fail(std::string(key) + " must be a positive integer below 2^31, got " + v.dump());
    }
    return v.get<int64_t>();
  }
  std::optional<double> Number(const char* key) const {
    if (!Has(key)) return std::nullopt;
    const Json& v = j_.at(key);
    if (!v.is_number() || !std::isfinite(v.get<double>())) Fail(std::string(key) + " must be a number, got " + v.dump());
    return v.get<double>();
  }
  std::optional<bool> Bool(const char* key) const {
    if (!Has(key)) return std::nullopt;
    const Json& v = j_.at(key);
    if (!v.is_boolean()) Fail(std::string(key) + " must be true or false, got " + v.dump());
    return v.get<bool>();
  }
  std::optional<std::string> String(const char* key) const {
    if (!Has(key)) return std::nullopt;
    const Json& v = j_.at(key);
    if (!v.is_string()) Fail(std::string(key) + " must be a string, got " + v.dump());
    return v.get<std::string>();
  }
  // A key whose value would change the math: only `expected` (or its absence) is taken.
  template <class T>
  void Require(const char* key, const std::optional<T>& value, const T& expected, const std::string& why) const {
    if (value && *value != expected) Fail(std::string(key) + " " + Show(*value) + " is not implemented: " + why);
  }

 private:
  static std::string Show(bool b) { return b ? "true" : "false"; }
  static std::string Show(double d) { return Json(d).dump(); }
  static std::string Show(const std::string& s) { return Json(s).dump(); }

  const Json& j_;
  const std::string& file_;
};

Family FamilyOf(const Json& j, const Keys& keys) {
  std::string architecture;
  if (j.contains("architectures") && j.at("architectures").is_array() && !j.at("architectures").empty()) {
    if (!j.at("architectures")[0].is_string()) keys.Fail("architectures must list names");
    architecture = j.at("architectures")[0].get<std::string>();
  }
  const std::optional<std::string> model_type = keys.String("model_type");
  if (architecture.empty() && model_type) {
    if (const std::optional<Family> family = FamilyNamed(*model_type)) return *family;
  }
  if (const std::optional<Family> family = FamilyOfArchitecture(architecture)) return *family;
  std::string known;
  for (std::string_view name : FamilyNames()) {
    known += (known.empty() ? "" : ", ") + std::string(HuggingFaceArchitecture(*FamilyNamed(name)));
  }
  keys.Fail("architecture " + (architecture.empty() ? "(none; model_type " + model_type.value_or("none") + ")"
                                                     : architecture) +
            " is not one meshtrain trains; it trains " + known);
}

void ReadGpt2(const Keys& k, HuggingFaceConfig* c) {
  ModelSpec& m = c->model;
  m.layers = k.Int("n_layer");
  m.heads = k.Int("n_head");
  m.hidden = k.Int("n_embd");
  m.vocab_size = k.Int("vocab_size");
  m.max_positions = k.OptionalInt("n_positions");
  if (!m.max_positions) m.max_positions = k.OptionalInt("n_ctx");
  if (!m.max_positions) k.Fail("has neither n_positions nor n_ctx");
  if (const std::optional<std::string> act = k.String("activation_function");
      act && *act != "gelu_new" && *act != "gelu_pytorch_tanh") {
    k.Fail("activation_function " + *act + " is not implemented: GPT-2's MLP here is the tanh GELU (gelu_new)");
  }
  if (const std::optional<int64_t> inner = k.OptionalInt("n_inner"); inner && *inner != 4 * *m.hidden) {
    k.Fail("n_inner " + std::to_string(*inner) + " is not implemented: GPT-2's MLP here is 4 x n_embd (" +
           std::to_string(4 * *m.hidden) + ")");
  }
  k.Require("layer_norm_epsilon", k.Number("layer_norm_epsilon"), 1e-5, "GPT-2's LayerNorm here has epsilon 1e-5");
  k.Require("scale_attn_weights", k.Bool("scale_attn_weights"), true, "attention is scaled by 1/sqrt(head size)");
  k.Require("scale_attn_by_inverse_layer_idx", k.Bool("scale_attn_by_inverse_layer_idx"), false,
            "attention is not scaled by layer");
  k.Require("add_cross_attention", k.Bool("add_cross_attention"), false, "GPT-2 here has no cross-attention");
  k.Require("tie_word_embeddings", k.Bool("tie_word_embeddings"), true, "GPT-2's LM head is its token embedding");
  for (const char* key : {"resid_pdrop", "embd_pdrop", "attn_pdrop"}) {
    if (const std::optional<double> p = k.Number(key); p && *p != 0) {
      c->notes.push_back(std::string(key) + " " + Json(*p).dump() +
                         " is not applied: spec.model.dropout sets the dropout of training");
    }
  }
}

void ReadLlama(Family family, const Keys& k, HuggingFaceConfig* c) {
  ModelSpec& m = c->model;
  m.layers = k.Int("num_hidden_layers");
  m.heads = k.Int("num_attention_heads");
  m.kv_heads = k.OptionalInt("num_key_value_heads").value_or(*m.heads);
  m.hidden = k.Int("hidden_size");
  m.intermediate_size = k.Int("intermediate_size");
  m.vocab_size = k.Int("vocab_size");
  m.max_positions = k.Int("max_position_embeddings");
  m.head_dim = k.OptionalInt("head_dim");
  if (!m.head_dim) {
    if (*m.hidden % *m.heads != 0) k.Fail("has no head_dim, and hidden_size is not a multiple of num_attention_heads");
    m.head_dim = *m.hidden / *m.heads;
  }
  m.norm_eps = k.Number("rms_norm_eps").value_or(1e-6);
  m.rope_theta = k.Number("rope_theta").value_or(10000.0);
  m.tie_embeddings = k.Bool("tie_word_embeddings").value_or(false);
  if (const std::optional<std::string> act = k.String("hidden_act"); act && *act != "silu") {
    k.Fail("hidden_act " + *act + " is not implemented: the MLP here is SwiGLU (silu)");
  }
  if (family == Family::kLlama || family == Family::kMistral) {
    k.Require("attention_bias", k.Bool("attention_bias"), false, "q, k, v and o have no biases here");
  }
  k.Require("mlp_bias", k.Bool("mlp_bias"), false, "the MLP has no biases here");
  k.Require("partial_rotary_factor", k.Number("partial_rotary_factor"), 1.0, "RoPE rotates every channel of a head");
  if (family == Family::kQwen2) {
    k.Require("use_sliding_window", k.Bool("use_sliding_window"), false, "attention here is over the whole window");
  } else {
    c->sliding_window = k.OptionalInt("sliding_window");
  }
  if (const std::optional<double> p = k.Number("attention_dropout"); p && *p != 0) {
    c->notes.push_back("attention_dropout " + Json(*p).dump() +
                       " is not applied: spec.model.dropout sets the dropout of training");
  }
}

// RoPE's scaling from an object of rope_scaling's form (transformers 4) or of
// rope_parameters' (transformers 5, which also holds rope_theta); nullopt for none.
std::optional<RopeScalingSpec> ScalingOf(const Json& r, const std::string& file, const char* key) {
  if (!r.is_object()) throw HuggingFaceConfigError(file + ": " + key + " must be an object, got " + r.dump());
  const Keys k(r, file);
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

// rope_scaling (transformers 4) and rope_parameters (transformers 5): where both are
// given they must agree, as must rope_parameters' rope_theta with the top-level one.
void ReadRope(const Json& j, const std::string& file, HuggingFaceConfig* c) {
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
  if (const std::optional<double> theta = Keys(r, file).Number("rope_theta")) {
    if (j.contains("rope_theta") && !j.at("rope_theta").is_null() && *c->model.rope_theta != *theta) {
      throw HuggingFaceConfigError(file + ": rope_theta " + Json(*c->model.rope_theta).dump() +
                                   " disagrees with rope_parameters' " + Json(*theta).dump());
    }
    c->model.rope_theta = theta;
  }
}

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
  const Keys keys(j, file);
  const Family family = FamilyOf(j, keys);
  c.model.family = std::string(FamilyName(family));
  if (family == Family::kGpt2) {
    ReadGpt2(keys, &c);
  } else {
    ReadLlama(family, keys, &c);
    ReadRope(j, file, &c);
  }
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
  j["architectures"] = {std::string(HuggingFaceArchitecture(s.family))};
  j["model_type"] = std::string(FamilyName(s.family));
  j["vocab_size"] = s.vocab_size;
  j["torch_dtype"] = std::string(torch_dtype);
  j["initializer_range"] = 0.02;
  j["use_cache"] = true;
  if (!s.llama()) {
    j["n_layer"] = s.layers;
    j["n_head"] = s.heads;
    j["n_embd"] = s.hidden;
    j["n_positions"] = s.max_positions;
    j["n_ctx"] = s.max_positions;
    j["n_inner"] = nullptr;
    j["activation_function"] = "gelu_new";
    j["layer_norm_epsilon"] = 1e-5;
    j["resid_pdrop"] = 0.0;
    j["embd_pdrop"] = 0.0;
    j["attn_pdrop"] = 0.0;
    j["tie_word_embeddings"] = true;
    return j;
  }
  j["num_hidden_layers"] = s.layers;
  j["num_attention_heads"] = s.heads;
  j["num_key_value_heads"] = s.kv_heads;
  j["hidden_size"] = s.hidden;
  j["head_dim"] = s.head_dim;
  j["intermediate_size"] = s.intermediate;
  j["max_position_embeddings"] = s.max_positions;
  j["rms_norm_eps"] = s.norm_eps;
  j["rope_theta"] = s.rope_theta;
  j["hidden_act"] = "silu";
  j["tie_word_embeddings"] = s.tied;
  j["attention_dropout"] = 0.0;
  if (s.family == Family::kLlama) {
    j["attention_bias"] = false;
    j["mlp_bias"] = false;
  }
  if (s.family == Family::kQwen2) j["use_sliding_window"] = false;
  if (s.family == Family::kMistral) j["sliding_window"] = nullptr;
  if (s.rope_scaling.type.empty()) {
    j["rope_scaling"] = nullptr;
  } else {
    Json r{{"rope_type", s.rope_scaling.type}, {"factor", s.rope_scaling.factor}};
    if (s.rope_scaling.type == "llama3") {
      r["low_freq_factor"] = s.rope_scaling.low_freq_factor;
      r["high_freq_factor"] = s.rope_scaling.high_freq_factor;
      r["original_max_position_embeddings"] = s.rope_scaling.original_max_positions;
    }
    j["rope_scaling"] = r;
  }
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
  const bool gpt2 = c.family == "gpt2";
  if (model->family.empty()) {
    model->family = c.family;
  } else if (model->family != c.family) {
    errors.push_back({"spec.model.family", model->family + " disagrees with " + from + ", whose architecture is " +
                                               std::string(HuggingFaceArchitecture(*FamilyNamed(c.family)))});
  }
  merge("layers", model->layers, c.layers, gpt2 ? "n_layer" : "num_hidden_layers");
  merge("heads", model->heads, c.heads, gpt2 ? "n_head" : "num_attention_heads");
  merge("hidden", model->hidden, c.hidden, gpt2 ? "n_embd" : "hidden_size");
  merge("vocabSize", model->vocab_size, c.vocab_size, "vocab_size");
  merge("maxPositions", model->max_positions, c.max_positions, gpt2 ? "n_positions" : "max_position_embeddings");
  merge("kvHeads", model->kv_heads, c.kv_heads, "num_key_value_heads");
  merge("headDim", model->head_dim, c.head_dim, "head_dim");
  merge("intermediateSize", model->intermediate_size, c.intermediate_size, "intermediate_size");
  merge("normEps", model->norm_eps, c.norm_eps, "rms_norm_eps");
  merge("ropeTheta", model->rope_theta, c.rope_theta, "rope_theta");
  merge("tieEmbeddings", model->tie_embeddings, c.tie_embeddings, "tie_word_embeddings");
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
  if (preset != nullptr && FamilyNamed(model->family)) {  // an unknown family is validation's to name
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
  if (!model->seq_len) model->seq_len = gpt2 ? positions : std::min<int64_t>(positions, 2048);
  if (*model->seq_len > positions) {
    errors.push_back({"spec.model.seqLen", std::to_string(*model->seq_len) + " exceeds " + from + "'s " +
                                               (gpt2 ? "n_positions" : "max_position_embeddings") + " (" +
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
