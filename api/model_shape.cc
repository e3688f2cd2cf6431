#include "api/model_shape.h"

#include <array>
#include <stdexcept>

namespace meshtrain::api {
namespace {

struct Preset {
  std::string_view name;
  ModelShape shape;
};

// gpt2-tiny is a byte-level model small enough to train in tests on two cores.
// The others are the published GPT-2 sizes.
constexpr std::array<Preset, 5> kPresets = {{
    {"gpt2-tiny", {.layers = 4, .heads = 4, .hidden = 128, .vocab_size = 256, .seq_len = 128}},
    {"gpt2-124m", {.layers = 12, .heads = 12, .hidden = 768, .vocab_size = 50257, .seq_len = 1024}},
    {"gpt2-350m", {.layers = 24, .heads = 16, .hidden = 1024, .vocab_size = 50257, .seq_len = 1024}},
    {"gpt2-774m", {.layers = 36, .heads = 20, .hidden = 1280, .vocab_size = 50257, .seq_len = 1024}},
    {"gpt2-1.5b", {.layers = 48, .heads = 25, .hidden = 1600, .vocab_size = 50257, .seq_len = 1024}},
}};

}  // namespace

double ModelShape::TrainingFlopsPerToken(int64_t seq) const {
  return 6 * double(ParameterCount()) + 12.0 * double(layers) * double(seq) * double(hidden);
}

int64_t ModelShape::ParameterCount() const {
  const int64_t c = hidden;
  return vocab_size * c + seq_len * c + layers * (12 * c * c + 13 * c) + 2 * c;
}

const ModelShape* FindPreset(std::string_view name) {
  for (const Preset& p : kPresets) {
    if (p.name == name) return &p.shape;
  }
  return nullptr;
}

std::vector<std::string_view> PresetNames() {
  std::vector<std::string_view> names;
  for (const Preset& p : kPresets) names.push_back(p.name);
  return names;
}

ModelShape ShapeOf(const ModelSpec& model) {
  if (!model.layers || !model.heads || !model.hidden || !model.vocab_size || !model.seq_len) {
    throw std::logic_error("ShapeOf: model shape is incomplete; apply defaults first");
  }
  return {*model.layers, *model.heads, *model.hidden, *model.vocab_size, *model.seq_len};
}

}  // namespace meshtrain::api
