// GPT-2 model shapes: the named presets and the resolved shape of a ModelSpec.

#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "api/training_job.h"

namespace meshtrain::api {

struct ModelShape {
  int64_t layers = 0;
  int64_t heads = 0;
  int64_t hidden = 0;
  int64_t vocab_size = 0;
  int64_t seq_len = 0;

  // Trainable parameters of GPT-2 with tied embeddings:
  // wte V*C + wpe T*C + per layer (12*C^2 + 13*C) + final LayerNorm 2*C.
  int64_t ParameterCount() const;
  // 6N + 12LTC: the matrix FLOPs of forward and backward per token of a sequence of
  // `seq` tokens, attention included (the numerator of MFU, as llm.c counts it).
  double TrainingFlopsPerToken(int64_t seq) const;
  bool operator==(const ModelShape&) const = default;
};

// The preset called `name`, or nullptr if there is none.
const ModelShape* FindPreset(std::string_view name);

// The preset names, smallest first: gpt2-tiny, gpt2-124m, ...
std::vector<std::string_view> PresetNames();

// The shape of a spec whose defaults have been applied (every field set).
// REQUIRES: model.layers, heads, hidden, vocab_size and seq_len have values.
ModelShape ShapeOf(const ModelSpec& model);

}  // namespace meshtrain::api
