#include "api/model_shape.h"

#include <array>
#include <cstdio>
#include <stdexcept>

#include "api/model_family.h"

namespace meshtrain::api {
namespace {

struct FamilyEntry {
  Family family;
  std::string_view name, title, architecture;
};
constexpr std::array<FamilyEntry, 4> kFamilies = {{
    {Family::kGpt2, "gpt2", "GPT-2", "GPT2LMHeadModel"},
    {Family::kLlama, "llama", "Llama", "LlamaForCausalLM"},
    {Family::kMistral, "mistral", "Mistral", "MistralForCausalLM"},
    {Family::kQwen2, "qwen2", "Qwen2", "Qwen2ForCausalLM"},
}};

struct Preset {
  std::string_view name;
  ModelShape shape;
};

// Llama 3.1's frequency bands for long contexts.
RopeScaling Llama3Rope(double factor) {
  return {.type = "llama3", .factor = factor, .low_freq_factor = 1, .high_freq_factor = 4,
          .original_max_positions = 8192};
}

// gpt2-tiny and llama-tiny are byte-level models small enough to train in tests on two
// cores. The others are the published shapes (the models' config.json), with a training
// window (seqLen) of GPT-2's 1024 and 2048 for the Llama class.
const std::vector<Preset>& Presets() {
  using enum Family;
  static const std::vector<Preset> presets = {
      {"gpt2-tiny", {.layers = 4, .heads = 4, .hidden = 128, .vocab_size = 256, .seq_len = 128}},
      {"gpt2-124m", {.layers = 12, .heads = 12, .hidden = 768, .vocab_size = 50257, .seq_len = 1024}},
      {"gpt2-350m", {.layers = 24, .heads = 16, .hidden = 1024, .vocab_size = 50257, .seq_len = 1024}},
      {"gpt2-774m", {.layers = 36, .heads = 20, .hidden = 1280, .vocab_size = 50257, .seq_len = 1024}},
      {"gpt2-1.5b", {.layers = 48, .heads = 25, .hidden = 1600, .vocab_size = 50257, .seq_len = 1024}},
      {"llama-tiny",
       {.layers = 4, .heads = 4, .hidden = 128, .vocab_size = 256, .seq_len = 128, .family = kLlama, .kv_heads = 2,
        .head_dim = 32, .intermediate = 352, .max_positions = 256, .rope_theta = 10000, .tied = false}},
      {"llama3.2-1b",
       {.layers = 16, .heads = 32, .hidden = 2048, .vocab_size = 128256, .seq_len = 2048, .family = kLlama,
        .kv_heads = 8, .head_dim = 64, .intermediate = 8192, .max_positions = 131072, .rope_theta = 500000,
        .rope_scaling = Llama3Rope(32), .tied = true}},
      {"llama3.2-3b",
       {.layers = 28, .heads = 24, .hidden = 3072, .vocab_size = 128256, .seq_len = 2048, .family = kLlama,
        .kv_heads = 8, .head_dim = 128, .intermediate = 8192, .max_positions = 131072, .rope_theta = 500000,
        .rope_scaling = Llama3Rope(32), .tied = true}},
      {"llama3.1-8b",
       {.layers = 32, .heads = 32, .hidden = 4096, .vocab_size = 128256, .seq_len = 2048, .family = kLlama,
        .kv_heads = 8, .head_dim = 128, .intermediate = 14336, .max_positions = 131072, .rope_theta = 500000,
        .rope_scaling = Llama3Rope(8), .tied = false}},
      {"llama3.1-70b",
       {.layers = 80, .heads = 64, .hidden = 8192, .vocab_size = 128256, .seq_len = 2048, .family = kLlama,
        .kv_heads = 8, .head_dim = 128, .intermediate = 28672, .max_positions = 131072, .rope_theta = 500000,
        .rope_scaling = Llama3Rope(8), .tied = false}},
      {"llama3.1-405b",
       {.layers = 126, .heads = 128, .hidden = 16384, .vocab_size = 128256, .seq_len = 2048, .family = kLlama,
        .kv_heads = 8, .head_dim = 128, .intermediate = 53248, .max_positions = 131072, .rope_theta = 500000,
        .rope_scaling = Llama3Rope(8), .tied = false}},
      {"mistral-7b",
       {.layers = 32, .heads = 32, .hidden = 4096, .vocab_size = 32768, .seq_len = 2048, .family = kMistral,
        .kv_heads = 8, .head_dim = 128, .intermediate = 14336, .max_positions = 32768, .rope_theta = 1000000,
        .tied = false}},
      {"qwen2.5-0.5b",
       {.layers = 24, .heads = 14, .hidden = 896, .vocab_size = 151936, .seq_len = 2048, .family = kQwen2,
        .kv_heads = 2, .head_dim = 64, .intermediate = 4864, .max_positions = 32768, .norm_eps = 1e-6,
        .rope_theta = 1000000, .tied = true}},
      {"qwen2.5-7b",
       {.layers = 28, .heads = 28, .hidden = 3584, .vocab_size = 152064, .seq_len = 2048, .family = kQwen2,
        .kv_heads = 4, .head_dim = 128, .intermediate = 18944, .max_positions = 32768, .norm_eps = 1e-6,
        .rope_theta = 1000000, .tied = false}},
      {"qwen2.5-72b",
       {.layers = 80, .heads = 64, .hidden = 8192, .vocab_size = 152064, .seq_len = 2048, .family = kQwen2,
        .kv_heads = 8, .head_dim = 128, .intermediate = 29568, .max_positions = 32768, .norm_eps = 1e-6,
        .rope_theta = 1000000, .tied = false}},
  };
  return presets;
}

std::string Number(double x) {
  char text[32];
  std::snprintf(text, sizeof text, "%g", x);
  return text;
}

}  // namespace

std::string_view FamilyName(Family family) {
  for (const FamilyEntry& f : kFamilies) {
    if (f.family == family) return f.name;
  }
  return "?";
}

std::string_view FamilyTitle(Family family) {
  for (const FamilyEntry& f : kFamilies) {
    if (f.family == family) return f.title;
  }
  return "?";
}

std::optional<Family> FamilyNamed(std::string_view name) {
  for (const FamilyEntry& f : kFamilies) {
    if (f.name == name) return f.family;
  }
  return std::nullopt;
}

std::vector<std::string_view> FamilyNames() {
  std::vector<std::string_view> names;
  for (const FamilyEntry& f : kFamilies) names.push_back(f.name);
  return names;
}

std::string_view HuggingFaceArchitecture(Family family) {
  for (const FamilyEntry& f : kFamilies) {
    if (f.family == family) return f.architecture;
  }
  return "?";
}

std::optional<Family> FamilyOfArchitecture(std::string_view architecture) {
  for (const FamilyEntry& f : kFamilies) {
    if (f.architecture == architecture) return f.family;
  }
  return std::nullopt;
}

ModelShape ModelShape::Resolved() const {
  ModelShape s = *this;
  s.kv_heads = KvHeads();
  s.head_dim = HeadDim();
  s.intermediate = Intermediate();
  s.max_positions = MaxPositions();
  if (!s.llama()) {  // what GPT-2 has none of
    s.rope_theta = 10000;
    s.rope_scaling = {};
  }
  if (s.rope_scaling.type.empty()) s.rope_scaling = {};
  return s;
}

bool ModelShape::operator==(const ModelShape& other) const {
  const ModelShape a = Resolved(), b = other.Resolved();
  return a.layers == b.layers && a.heads == b.heads && a.hidden == b.hidden && a.vocab_size == b.vocab_size &&
         a.seq_len == b.seq_len && a.family == b.family && a.kv_heads == b.kv_heads && a.head_dim == b.head_dim &&
         a.intermediate == b.intermediate && a.max_positions == b.max_positions && a.norm_eps == b.norm_eps &&
         a.rope_theta == b.rope_theta && a.rope_scaling == b.rope_scaling && a.tied == b.tied;
}

bool ModelShape::SameWeights(const ModelShape& other) const {
  ModelShape a = Resolved(), b = other.Resolved();
  a.seq_len = b.seq_len = 0;
  // RoPE's positions are no weights: only GPT-2's position table has max_positions rows.
  if (a.llama()) a.max_positions = b.max_positions;
  return a == b;
}

int64_t ModelShape::ParameterCount() const {
  const FamilyTensors f = TensorsOf(*this);
  auto count = [](const std::vector<TensorInfo>& tensors) {
    int64_t n = 0;
    for (const TensorInfo& t : tensors) {
      int64_t size = 1;
      for (int64_t d : t.shape) size *= d;
      n += size;
    }
    return n;
  };
  return count(f.embedding) + layers * count(f.block) + count(f.head);
}

double ModelShape::TrainingFlopsPerToken(int64_t seq) const {
  // GPT-2 counts every parameter, as llm.c does; the Llama class leaves out an untied
  // embedding, a lookup that multiplies nothing (its head does).
  const double n = double(ParameterCount()) - (llama() && !tied ? double(vocab_size) * double(hidden) : 0.0);
  return 6 * n + 12.0 * double(layers) * double(seq) * double(QueryWidth());
}

const ModelShape* FindPreset(std::string_view name) {
  for (const Preset& p : Presets()) {
    if (p.name == name) return &p.shape;
  }
  return nullptr;
}

std::vector<std::string_view> PresetNames() {
  std::vector<std::string_view> names;
  for (const Preset& p : Presets()) names.push_back(p.name);
  return names;
}

ModelShape ShapeOf(const ModelSpec& model) {
  if (!model.layers || !model.heads || !model.hidden || !model.vocab_size || !model.seq_len) {
    throw std::logic_error("ShapeOf: model shape is incomplete; apply defaults first");
  }
  ModelShape s{*model.layers, *model.heads, *model.hidden, *model.vocab_size, *model.seq_len};
  if (!model.family.empty()) {
    const std::optional<Family> family = FamilyNamed(model.family);
    if (!family) throw std::logic_error("ShapeOf: unknown family " + model.family + "; validate first");
    s.family = *family;
  }
  s.kv_heads = model.kv_heads.value_or(0);
  s.head_dim = model.head_dim.value_or(0);
  s.intermediate = model.intermediate_size.value_or(0);
  s.max_positions = model.max_positions.value_or(0);
  s.norm_eps = model.norm_eps.value_or(1e-5);
  s.rope_theta = model.rope_theta.value_or(10000);
  if (model.rope_scaling) {
    const RopeScalingSpec& r = *model.rope_scaling;
    s.rope_scaling.type = r.type;
    s.rope_scaling.factor = r.factor.value_or(1);
    s.rope_scaling.low_freq_factor = r.low_freq_factor.value_or(1);
    s.rope_scaling.high_freq_factor = r.high_freq_factor.value_or(4);
    s.rope_scaling.original_max_positions = r.original_max_positions.value_or(8192);
  }
  s.tied = model.tie_embeddings.value_or(true);
  return s.Resolved();
}

ModelSpec SpecOfShape(const ModelShape& shape) {
  const ModelShape s = shape.Resolved();
  ModelSpec m;
  m.family = std::string(FamilyName(s.family));
  m.layers = s.layers;
  m.heads = s.heads;
  m.hidden = s.hidden;
  m.vocab_size = s.vocab_size;
  m.seq_len = s.seq_len;
  m.max_positions = s.max_positions;
  if (!s.llama()) return m;
  m.kv_heads = s.kv_heads;
  m.head_dim = s.head_dim;
  m.intermediate_size = s.intermediate;
  m.norm_eps = s.norm_eps;
  m.rope_theta = s.rope_theta;
  if (!s.rope_scaling.type.empty()) {
    const RopeScaling& r = s.rope_scaling;
    RopeScalingSpec spec;
    spec.type = r.type;
    spec.factor = r.factor;
    if (r.type == "llama3") {
      spec.low_freq_factor = r.low_freq_factor;
      spec.high_freq_factor = r.high_freq_factor;
      spec.original_max_positions = r.original_max_positions;
    }
    m.rope_scaling = spec;
  }
  m.tie_embeddings = s.tied;
  return m;
}

std::string DescribeShape(const ModelShape& shape) {
  const ModelShape s = shape.Resolved();
  std::string text = std::string(FamilyName(s.family)) + ": layers " + std::to_string(s.layers) + ", heads " +
                     std::to_string(s.heads);
  if (s.llama()) text += " (" + std::to_string(s.kv_heads) + " key/value)";
  text += ", hidden " + std::to_string(s.hidden);
  if (s.llama()) {
    if (s.head_dim * s.heads != s.hidden) text += ", headDim " + std::to_string(s.head_dim);
    text += ", MLP " + std::to_string(s.intermediate);
  }
  text += ", vocabSize " + std::to_string(s.vocab_size) + ", seqLen " + std::to_string(s.seq_len);
  if (s.max_positions != s.seq_len) text += " of " + std::to_string(s.max_positions);
  if (s.llama()) {
    text += ", ropeTheta " + Number(s.rope_theta);
    if (!s.rope_scaling.type.empty()) {
      text += " (" + s.rope_scaling.type + " x" + Number(s.rope_scaling.factor) + ")";
    }
    text += s.tied ? ", tied head" : ", untied head";
  }
  return text;
}

}  // namespace meshtrain::api
