// Hugging Face's config.json for the families meshtrain trains, in and out. Which keys a
// family reads, writes and refuses is its description's (api/model_family.h,
// api/families/): the keys that give its shape, and the ones whose values would change
// the math without meshtrain doing so, refused by name (GPT-2's activation_function other
// than gelu_new, the Llama class's hidden_act other than silu, attention_bias or
// mlp_bias true, partial_rotary_factor other than 1, use_sliding_window true, a
// rope_scaling type other than default, linear and llama3, Qwen3's layer_types other than
// full_attention, ...). Other keys (token ids, dtypes, dropout probabilities of inference
// configs, ...) are ignored on the way in. A Mistral or Llama sliding_window below the
// job's seqLen is refused when the job is checked (HuggingFaceConfig::sliding_window).
//
// Every JSON file of a model directory comes from the internet, and each is read by
// ParseModelJson: config.json here, tokenizer.json and tokenizer_config.json
// (worker/text/tokenizer.h), model.safetensors.index.json and safetensors headers
// (worker/train/safetensors.h). Arrays and objects nest at most kMaxModelJsonDepth deep
// there (real files nest fewer than 10 deep): deeper text is refused before nlohmann's
// parser builds anything, since copying or printing a deeper document recurses past the
// stack.
// Thread-safety: pure functions, but for ReadHuggingFaceConfig's file read.

#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "api/field_error.h"
#include "api/model_shape.h"
#include "api/training_job.h"

namespace meshtrain::api {

inline constexpr int kMaxModelJsonDepth = 512;

// A model directory's file whose text is not JSON, or nests deeper than
// kMaxModelJsonDepth. what() names the file as it was given and the place, byte offsets
// counted from 0, lines and columns from 1:
//   "DIR/tokenizer.json: JSON nested deeper than 512 at byte 512 (line 1, column 513)"
//   "DIR/config.json: not valid JSON at byte 14 (line 2, column 3): syntax error ..."
// reason() is what() without "FILE: ".
class ModelJsonError : public std::runtime_error {
 public:
  ModelJsonError(const std::string& file, const std::string& reason)
      : std::runtime_error(file + ": " + reason), reason_(reason) {}
  const std::string& reason() const { return reason_; }

 private:
  std::string reason_;
};

// The JSON document `text`, read from `file`. `callback`, when given, sees the parse as
// nlohmann's parser_callback_t does; what it throws propagates. Throws ModelJsonError.
nlohmann::json ParseModelJson(std::string_view text, const std::string& file,
                              const nlohmann::json::parser_callback_t& callback = nullptr);

// What a config.json says of its model.
struct HuggingFaceConfig {
  std::string file;  // the path it was read from, for messages
  ModelSpec model;   // family and shape, every field but seqLen (the job's training window)
  std::optional<int64_t> sliding_window;  // Mistral's attention window, if any
  // A mixture of experts' router_aux_loss_coef where output_router_logits is true
  // (transformers' default 0.001 where the key is absent): its load-balancing loss is on.
  std::optional<double> router_aux_loss_coef;
  std::vector<std::string> notes;         // keys that are set and have no effect here
};

// Thrown for a config.json that cannot be read, is not JSON (ModelJsonError's message),
// is of an architecture meshtrain does not train, gives a size that is not a positive
// integer below 2^31, or sets a key to a value meshtrain does not implement; the message
// names the file and the key.
class HuggingFaceConfigError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The config in `text`, read from `file`.
HuggingFaceConfig ParseHuggingFaceConfig(std::string_view text, const std::string& file);
// DIR/config.json.
HuggingFaceConfig ReadHuggingFaceConfig(const std::string& directory);

// config.json for `shape`, as transformers writes it, with `torch_dtype`.
nlohmann::json HuggingFaceConfigJson(const ModelShape& shape, std::string_view torch_dtype);

// Fills `model` from `config`: each field the job left unset takes the config's value, a
// field the job wrote that disagrees is an error naming both values, as is a preset
// whose shape disagrees, and a training window (seqLen) past max_position_embeddings or
// a sliding window. A job without seqLen gets max_position_embeddings, at most 2048 for
// the Llama class.
FieldErrors MergeHuggingFaceConfig(const HuggingFaceConfig& config, ModelSpec* model);

}  // namespace meshtrain::api
