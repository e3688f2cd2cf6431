#include "api/families/families.h"

#include <algorithm>

#include "api/hf_config_keys.h"

namespace meshtrain::api {

const std::vector<const ModelFamily*>& Families() {
  static const std::vector<const ModelFamily*> families = {&Gpt2(),  &Llama(),   &Mistral(), &Qwen2(),
                                                           &Qwen3(), &Mixtral(), &Qwen3Moe()};
  return families;
}

const ModelFamily* FindFamily(std::string_view name) {
  for (const ModelFamily* f : Families()) {
    if (f->name() == name) return f;
  }
  return nullptr;
}

const ModelFamily* FindFamilyOfArchitecture(std::string_view architecture) {
  for (const ModelFamily* f : Families()) {
    if (f->architecture() == architecture) return f;
  }
  return nullptr;
}

std::optional<ModelShape> ModelFamily::ShapeOfSingleFile(const std::map<std::string, std::vector<int64_t>>&,
                                                         int64_t) const {
  return std::nullopt;
}

ModelShape ShapeOfSingleFile(const std::map<std::string, std::vector<int64_t>>& tensors, int64_t head_dim) {
  std::string forms;
  for (const ModelFamily* f : Families()) {
    if (!f->HasSingleFileForm()) continue;
    if (std::optional<ModelShape> shape = f->ShapeOfSingleFile(tensors, head_dim)) return *shape;
    forms += (forms.empty() ? "" : ", ") + std::string(f->title()) + "'s";
  }
  throw std::invalid_argument("its tensors are not in a one-file form meshtrain reads (" + forms +
                              "); a Hugging Face model directory holds config.json beside them");
}

std::string FamilyList(bool architectures) {
  std::string list;
  for (const ModelFamily* f : Families()) {
    list += (list.empty() ? "" : ", ") + std::string(architectures ? f->architecture() : f->name());
  }
  return list;
}

void RefuseSlidingLayers(const nlohmann::json& j, const ConfigKeys& k) {
  if (!j.contains("layer_types") || j.at("layer_types").is_null()) return;
  const nlohmann::json& types = j.at("layer_types");
  if (!types.is_array()) return k.Fail("layer_types must be a list, got " + types.dump());
  for (size_t i = 0; i < types.size(); ++i) {
    if (types[i] != "full_attention") {
      k.Fail("layer_types[" + std::to_string(i) + "] " + types[i].dump() +
             " is not implemented: attention here is over the whole window (full_attention)");
    }
  }
}

std::string DescribeWindow(const ModelShape& s) {
  std::string text = "vocabSize " + std::to_string(s.vocab_size) + ", seqLen " + std::to_string(s.seq_len);
  if (s.max_positions != s.seq_len) text += " of " + std::to_string(s.max_positions);
  return text;
}

int64_t AttentionStateElements(int batch, int seq, const ModelShape& s, int tp_size, const EngineTypes& t) {
  if (t.context > 1 && t.context_all_to_all) {
    const int64_t bytes = CarvedBytes(UlyssesAttentionBuffers(batch, seq, s, tp_size, t, UlyssesPart::kKept));
    return (bytes + t.acc_bytes - 1) / t.acc_bytes;
  }
  const int64_t rows = int64_t(batch) * (s.heads / tp_size) * seq;
  return t.attention_keeps_scores && t.context == 1 ? rows * seq : rows;
}

std::vector<Buffer> UlyssesAttentionBuffers(int batch, int seq, const ModelShape& s, int tp_size, const EngineTypes& t,
                                            UlyssesPart part, int64_t kernel_scratch_bytes) {
  const int64_t C = t.context, S = int64_t(seq) * C, N = int64_t(batch) * seq;
  const int64_t Q = s.QueryWidth() / tp_size, W = Q + s.KvWidth() / tp_size * 2;
  const int A = t.act_bytes, G = t.acc_bytes;
  switch (part) {
    case UlyssesPart::kKept: {
      const int64_t rows = int64_t(batch) * (s.heads / tp_size / C) * S;
      return {{"qkv", batch * S * W / C, A},
              {"out", batch * S * Q / C, A},
              {"state", t.attention_keeps_scores ? rows * S : rows, G}};
    }
    case UlyssesPart::kForward:
      return {{"send", N * W, A}, {"recv", N * W, A}, {"attention", kernel_scratch_bytes, 1}};
    case UlyssesPart::kBackward:
      return {{"send", N * W, A},
              {"recv", N * W, A},
              {"dout", batch * S * Q / C, A},
              {"dqkv", batch * S * W / C, A},
              {"attention", kernel_scratch_bytes, 1}};
  }
  return {};
}

int64_t ContextAttentionScratchBytes(int batch, int seq, const ModelShape& s, int tp_size, const EngineTypes& t) {
  if (t.context_all_to_all) {
    return std::max(
        CarvedBytes(UlyssesAttentionBuffers(batch, seq, s, tp_size, t, UlyssesPart::kForward,
                                            t.attention_scratch_bytes)),
        CarvedBytes(UlyssesAttentionBuffers(batch, seq, s, tp_size, t, UlyssesPart::kBackward,
                                            t.attention_scratch_bytes)));
  }
  return std::max(CarvedBytes(RingAttentionBuffers(batch, seq, s, tp_size, t, /*backward=*/false)),
                  CarvedBytes(RingAttentionBuffers(batch, seq, s, tp_size, t, /*backward=*/true)));
}

std::vector<Buffer> RingAttentionBuffers(int batch, int seq, const ModelShape& s, int tp_size, const EngineTypes& t,
                                         bool backward) {
  const int64_t N = int64_t(batch) * seq, Q = s.QueryWidth() / tp_size, KV = s.KvWidth() / tp_size;
  const int64_t stats = int64_t(batch) * (s.heads / tp_size) * seq;
  const int A = t.act_bytes, G = t.acc_bytes;
  if (!backward) {
    return {{"kv", N * 2 * KV, A}, {"kv_next", N * 2 * KV, A}, {"out", N * Q, G}, {"block_out", N * Q, G},
            {"block_lse", stats, G}};
  }
  return {{"kv", N * 2 * KV, A},      {"kv_next", N * 2 * KV, A}, {"dkv", N * 2 * KV, G},
          {"dkv_next", N * 2 * KV, G}, {"dq", N * Q, G},           {"D", stats, G},
          {"cast", N * std::max(Q, 2 * KV), A}};
}

std::vector<Buffer> ScratchAround(int batch, int seq, const ModelShape& s, int tp_size, const EngineTypes& t,
                                  bool dropout, const std::vector<Buffer>& mlp) {
  const int64_t N = int64_t(batch) * seq, C = s.hidden;
  const int64_t Q = s.QueryWidth() / tp_size, KV = s.KvWidth() / tp_size;
  const int A = t.act_bytes;
  std::vector<Buffer> b = {
      {"dresidual", N * C, A},  // the residual stream's gradient
      {"proj", N * C, A},       // a projection's output, before its residual add
      {"dln", N * C, A},        // a norm's output gradient
  };
  b.insert(b.end(), mlp.begin(), mlp.end());
  b.push_back({"datty", N * Q, A});  // attention's output gradient
  b.push_back({"dqkv", N * (Q + 2 * KV), A});
  if (dropout) {
    b.push_back({"dmasked", N * C, A});  // a masked residual gradient
    b.push_back({"dropped", N * Q, A});  // attention's output after dropout (the forward keeps it before)
  }
  b.push_back({"attention", t.attention_scratch_bytes, 1});
  return b;
}

}  // namespace meshtrain::api
