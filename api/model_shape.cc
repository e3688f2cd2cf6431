#include "api/model_shape.h"

#include <algorithm>
#include <stdexcept>

#include "api/model_family.h"

namespace meshtrain::api {

const ModelFamily& ModelShape::Family() const {
  const ModelFamily* f = FindFamily(family);
  if (f == nullptr) throw std::logic_error("ModelShape: unknown family \"" + family + "\"; validate first");
  return *f;
}

ModelShape ModelShape::Resolved() const {
  ModelShape s = *this;
  s.Family().Resolve(&s);
  s.kv_heads = s.KvHeads();
  s.head_dim = s.HeadDim();
  s.intermediate = s.Intermediate();
  s.max_positions = s.MaxPositions();
  if (s.rope_scaling.type.empty()) s.rope_scaling = {};
  return s;
}

bool ModelShape::operator==(const ModelShape& other) const {
  const ModelShape a = Resolved(), b = other.Resolved();
  return a.layers == b.layers && a.heads == b.heads && a.hidden == b.hidden && a.vocab_size == b.vocab_size &&
         a.seq_len == b.seq_len && a.family == b.family && a.kv_heads == b.kv_heads && a.head_dim == b.head_dim &&
         a.intermediate == b.intermediate && a.max_positions == b.max_positions && a.norm_eps == b.norm_eps &&
         a.rope_theta == b.rope_theta && a.rope_scaling == b.rope_scaling && a.tied == b.tied &&
         a.experts == b.experts && a.experts_per_token == b.experts_per_token &&
         a.moe_intermediate == b.moe_intermediate && a.norm_topk_prob == b.norm_topk_prob &&
         a.decoder_sparse_step == b.decoder_sparse_step && a.mlp_only_layers == b.mlp_only_layers;
}

bool ModelShape::SameWeights(const ModelShape& other) const {
  ModelShape a = Resolved(), b = other.Resolved();
  a.seq_len = b.seq_len = 0;
  if (!a.Family().LearnsPositions()) a.max_positions = b.max_positions;
  return a == b;
}

bool ModelShape::DenseBlock(int64_t l) const {
  if (experts <= 0) return false;
  if (std::find(mlp_only_layers.begin(), mlp_only_layers.end(), l) != mlp_only_layers.end()) return true;
  return decoder_sparse_step > 1 && (l + 1) % decoder_sparse_step != 0;
}

int64_t ModelShape::DenseBlocks(int64_t first, int64_t last) const {
  int64_t n = 0;
  for (int64_t l = first; l < last; ++l) n += DenseBlock(l) ? 1 : 0;
  return n;
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
  int64_t n = count(f.embedding) + count(f.head);
  for (int64_t l = 0; l < layers; ++l) n += count(f.Block(*this, l));
  return n;
}

double ModelShape::TrainingFlopsPerToken(int64_t seq) const {
  // Every parameter multiplies but an untied embedding, a lookup (its head does multiply).
  double n = double(ParameterCount()) - (tied ? 0.0 : double(vocab_size) * double(hidden));
  // A token multiplies by k of a mixture's E experts (gate, up and down, each I x C).
  const ModelShape r = Resolved();
  if (r.experts > 0) {
    n -= double(r.layers - r.DenseBlocks()) * double(r.experts - r.experts_per_token) * 3 *
         double(r.moe_intermediate) * double(r.hidden);
  }
  return 6 * n + 12.0 * double(layers) * double(seq) * double(r.QueryWidth());
}

const ModelShape* FindPreset(std::string_view name) {
  static const std::vector<ModelFamily::Preset> presets = [] {
    std::vector<ModelFamily::Preset> all;
    for (const ModelFamily* f : Families()) {
      for (ModelFamily::Preset& p : f->Presets()) all.push_back(std::move(p));
    }
    return all;
  }();
  for (const ModelFamily::Preset& p : presets) {
    if (p.name == name) return &p.shape;
  }
  return nullptr;
}

std::vector<std::string_view> PresetNames() {
  std::vector<std::string_view> names;
  for (const ModelFamily* f : Families()) {
    for (const ModelFamily::Preset& p : f->Presets()) names.push_back(p.name);
  }
  return names;
}

ModelShape ShapeOf(const ModelSpec& model) {
  if (!model.layers || !model.heads || !model.hidden || !model.vocab_size || !model.seq_len) {
    throw std::logic_error("ShapeOf: model shape is incomplete; apply defaults first");
  }
  ModelShape s{*model.layers, *model.heads, *model.hidden, *model.vocab_size, *model.seq_len};
  if (!model.family.empty()) s.family = model.family;
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
  s.experts = model.experts.value_or(0);
  s.experts_per_token = model.experts_per_token.value_or(0);
  s.moe_intermediate = model.moe_intermediate_size.value_or(0);
  s.norm_topk_prob = model.norm_topk_prob.value_or(true);
  s.decoder_sparse_step = model.decoder_sparse_step.value_or(1);
  s.mlp_only_layers = model.mlp_only_layers;
  return s.Resolved();
}

ModelSpec SpecOfShape(const ModelShape& shape) {
  const ModelShape s = shape.Resolved();
  ModelSpec m;
  m.family = s.family;
  m.layers = s.layers;
  m.heads = s.heads;
  m.hidden = s.hidden;
  m.vocab_size = s.vocab_size;
  m.seq_len = s.seq_len;
  m.max_positions = s.max_positions;
  s.Family().SpecOf(s, &m);
  return m;
}

std::string DescribeShape(const ModelShape& shape) {
  const ModelShape s = shape.Resolved();
  return s.family + ": " + s.Family().Describe(s);
}

}  // namespace meshtrain::api
