#include "api/families/llama.h"

#include <algorithm>
#include <cstdio>
#include <regex>

#include "api/hf_config_keys.h"

namespace meshtrain::api {
namespace {

using Json = nlohmann::json;
using enum TpSplit;

std::string Number(double x) {
  char text[32];
  std::snprintf(text, sizeof text, "%g", x);
  return text;
}

}  // namespace

const ModelFamily::ConfigNames kLlamaConfigNames = {"num_hidden_layers", "num_attention_heads", "hidden_size",
                                                    "max_position_embeddings"};

namespace {

// Llama 3.1's frequency bands for long contexts.
RopeScaling Llama3Rope(double factor) {
  return {.type = "llama3", .factor = factor, .low_freq_factor = 1, .high_freq_factor = 4,
          .original_max_positions = 8192};
}

}  // namespace

void LlamaFamily::Resolve(ModelShape* s) const {
  if (s->head_dim == 0) {
    if (const std::optional<int64_t> hd = DefaultHeadDim(s->hidden, s->heads)) s->head_dim = *hd;
  }
}

std::optional<int64_t> LlamaFamily::DefaultHeadDim(std::optional<int64_t> hidden, std::optional<int64_t> heads) const {
  if (!hidden || !heads || *heads <= 0 || *hidden % *heads != 0) return std::nullopt;
  return *hidden / *heads;
}

void LlamaFamily::DefaultFromPreset(const ModelShape& preset, ModelSpec* m) const {
  const ModelShape p = preset.Resolved();
  if (!m->kv_heads) m->kv_heads = p.kv_heads;
  if (!m->head_dim) m->head_dim = p.head_dim;
  if (!m->intermediate_size) m->intermediate_size = p.intermediate;
  if (!m->max_positions) m->max_positions = p.max_positions;
  if (!m->norm_eps) m->norm_eps = p.norm_eps;
  if (!m->rope_theta) m->rope_theta = p.rope_theta;
  if (!m->rope_scaling && !p.rope_scaling.type.empty()) m->rope_scaling = SpecOfShape(p).rope_scaling;
  if (!m->tie_embeddings) m->tie_embeddings = p.tied;
}

// Every field, so that workers see the whole shape.
void LlamaFamily::Default(ModelSpec* m) const {
  if (!m->kv_heads && m->heads) m->kv_heads = m->heads;
  if (!m->head_dim && m->heads && m->hidden && *m->heads > 0) m->head_dim = DefaultHeadDim(m->hidden, m->heads);
  if (!m->max_positions && m->seq_len) m->max_positions = m->seq_len;
  if (!m->norm_eps) m->norm_eps = 1e-5;
  if (!m->rope_theta) m->rope_theta = 10000.0;
  if (!m->tie_embeddings) m->tie_embeddings = false;
  if (m->rope_scaling && m->rope_scaling->type == "llama3") {
    RopeScalingSpec& r = *m->rope_scaling;
    if (!r.low_freq_factor) r.low_freq_factor = 1.0;
    if (!r.high_freq_factor) r.high_freq_factor = 4.0;
    if (!r.original_max_positions) r.original_max_positions = 8192;
  }
}

void LlamaFamily::Check(const ModelSpec& m, FieldChecker& c) const {
  if (!m.intermediate_size) c.Fail("spec.model.intermediateSize", "is required when spec.model.preset is not set");
  else c.Range("spec.model.intermediateSize", *m.intermediate_size, 1, int64_t(1) << 20);
  if (m.kv_heads && c.Range("spec.model.kvHeads", *m.kv_heads, 1, 1024) && m.heads && *m.heads >= 1 &&
      *m.heads % *m.kv_heads != 0) {
    c.Fail("spec.model.kvHeads", "must divide spec.model.heads (" + std::to_string(*m.heads) + "), got " +
                                     std::to_string(*m.kv_heads));
  }
  if (!m.head_dim) {
    if (m.heads && m.hidden && *m.heads > 0 && *m.hidden > 0 && !DefaultHeadDim(m.hidden, m.heads)) {
      c.Fail("spec.model.headDim", "is required when spec.model.hidden (" + std::to_string(*m.hidden) +
                                       ") is not a multiple of spec.model.heads (" + std::to_string(*m.heads) + ")");
    }
  } else if (c.Range("spec.model.headDim", *m.head_dim, 2, 1024) && *m.head_dim % 2 != 0) {
    c.Fail("spec.model.headDim", "must be even (RoPE rotates pairs of channels), got " + std::to_string(*m.head_dim));
  }
  if (m.norm_eps) c.Finite("spec.model.normEps", *m.norm_eps, 0, /*min_exclusive=*/true);
  if (m.rope_theta) c.Finite("spec.model.ropeTheta", *m.rope_theta, 0, /*min_exclusive=*/true);
  if (m.rope_scaling) {
    const RopeScalingSpec& r = *m.rope_scaling;
    c.OneOf("spec.model.ropeScaling.type", r.type, {"linear", "llama3"});
    if (!r.factor) c.Fail("spec.model.ropeScaling.factor", "is required");
    else c.Finite("spec.model.ropeScaling.factor", *r.factor, 0, /*min_exclusive=*/true);
    if (r.type == "llama3") {
      if (r.low_freq_factor) c.Finite("spec.model.ropeScaling.lowFreqFactor", *r.low_freq_factor, 0, true);
      if (r.high_freq_factor) c.Finite("spec.model.ropeScaling.highFreqFactor", *r.high_freq_factor, 0, true);
      if (r.low_freq_factor && r.high_freq_factor && *r.high_freq_factor <= *r.low_freq_factor) {
        c.Fail("spec.model.ropeScaling.highFreqFactor", "must be greater than lowFreqFactor (" +
                                                            FieldChecker::Show(*r.low_freq_factor) + "), got " +
                                                            FieldChecker::Show(*r.high_freq_factor));
      }
      if (r.original_max_positions) {
        c.Range("spec.model.ropeScaling.originalMaxPositions", *r.original_max_positions, 1, int64_t(1) << 24);
      }
    } else {
      for (const auto& [name, set] : {std::pair{"lowFreqFactor", r.low_freq_factor.has_value()},
                                      std::pair{"highFreqFactor", r.high_freq_factor.has_value()},
                                      std::pair{"originalMaxPositions", r.original_max_positions.has_value()}}) {
        if (set) c.Fail(std::string("spec.model.ropeScaling.") + name, "only type llama3 takes it");
      }
    }
  }
}

void LlamaFamily::SpecOf(const ModelShape& s, ModelSpec* m) const {
  m->kv_heads = s.kv_heads;
  m->head_dim = s.head_dim;
  m->intermediate_size = s.intermediate;
  m->norm_eps = s.norm_eps;
  m->rope_theta = s.rope_theta;
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
    m->rope_scaling = spec;
  }
  m->tie_embeddings = s.tied;
}

std::string LlamaFamily::Describe(const ModelShape& s) const {
  std::string text = "layers " + std::to_string(s.layers) + ", heads " + std::to_string(s.heads) + " (" +
                     std::to_string(s.kv_heads) + " key/value), hidden " + std::to_string(s.hidden);
  if (s.head_dim * s.heads != s.hidden) text += ", headDim " + std::to_string(s.head_dim);
  text += ", MLP " + std::to_string(s.intermediate) + ", " + DescribeWindow(s) + ", ropeTheta " + Number(s.rope_theta);
  if (!s.rope_scaling.type.empty()) text += " (" + s.rope_scaling.type + " x" + Number(s.rope_scaling.factor) + ")";
  return text + (s.tied ? ", tied head" : ", untied head");
}

std::vector<std::pair<int64_t, std::string>> LlamaFamily::TensorParallelSplits(const ModelShape& s) const {
  return {{s.heads, "spec.model.heads"},
          {s.KvHeads(), "spec.model.kvHeads"},
          {s.Intermediate(), "the MLP width (spec.model.intermediateSize)"}};
}

void LlamaFamily::ReadConfig(const Json& j, const ConfigKeys& k, HuggingFaceConfig* c) const {
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
    m.head_dim = DefaultHeadDim(m.hidden, m.heads);
    if (!m.head_dim) k.Fail("has no head_dim, and hidden_size is not a multiple of num_attention_heads");
  }
  m.norm_eps = k.Number("rms_norm_eps").value_or(1e-6);
  m.rope_theta = k.Number("rope_theta").value_or(10000.0);
  m.tie_embeddings = k.Bool("tie_word_embeddings").value_or(false);
  if (const std::optional<std::string> act = k.String("hidden_act"); act && *act != "silu") {
    k.Fail("hidden_act " + *act + " is not implemented: the MLP here is SwiGLU (silu)");
  }
  if (v_.refuses_attention_bias) {
    k.Require("attention_bias", k.Bool("attention_bias"), false, "q, k, v and o have no biases here");
  }
  k.Require("mlp_bias", k.Bool("mlp_bias"), false, "the MLP has no biases here");
  k.Require("partial_rotary_factor", k.Number("partial_rotary_factor"), 1.0, "RoPE rotates every channel of a head");
  if (v_.use_sliding_window_key) {
    k.Require("use_sliding_window", k.Bool("use_sliding_window"), false, "attention here is over the whole window");
  } else {
    c->sliding_window = k.OptionalInt("sliding_window");
  }
  if (const std::optional<double> p = k.Number("attention_dropout"); p && *p != 0) {
    c->notes.push_back("attention_dropout " + Json(*p).dump() +
                       " is not applied: spec.model.dropout sets the dropout of training");
  }
  ReadRopeConfig(j, k.file(), c);
}

void LlamaFamily::WriteConfig(const ModelShape& s, Json* j) const {
  Json& c = *j;
  c["num_hidden_layers"] = s.layers;
  c["num_attention_heads"] = s.heads;
  c["num_key_value_heads"] = s.kv_heads;
  c["hidden_size"] = s.hidden;
  c["head_dim"] = s.head_dim;
  c["intermediate_size"] = s.intermediate;
  c["max_position_embeddings"] = s.max_positions;
  c["rms_norm_eps"] = s.norm_eps;
  c["rope_theta"] = s.rope_theta;
  c["hidden_act"] = "silu";
  c["tie_word_embeddings"] = s.tied;
  c["attention_dropout"] = 0.0;
  for (const auto& [key, value] : v_.written.items()) c[key] = value;
  if (s.rope_scaling.type.empty()) {
    c["rope_scaling"] = nullptr;
  } else {
    Json r{{"rope_type", s.rope_scaling.type}, {"factor", s.rope_scaling.factor}};
    if (s.rope_scaling.type == "llama3") {
      r["low_freq_factor"] = s.rope_scaling.low_freq_factor;
      r["high_freq_factor"] = s.rope_scaling.high_freq_factor;
      r["original_max_position_embeddings"] = s.rope_scaling.original_max_positions;
    }
    c["rope_scaling"] = r;
  }
}

int64_t LlamaFamily::DefaultSeqLen(int64_t max_positions) const { return std::min<int64_t>(max_positions, 2048); }

FamilyTensors LlamaFamily::Tensors(const ModelShape& s) const {
  const int64_t C = s.hidden, V = s.vocab_size, Q = s.QueryWidth(), KV = s.KvWidth(), I = s.Intermediate();
  FamilyTensors f;
  f.embedding = {{Param::kEmbed, "embed", {V, C}, kVocab, true, Init::kNormal, "model.embed_tokens.weight"}};
  TensorInfo norm{Param::kNorm, "norm", {C}, kReplicated, false, Init::kOnes, "model.norm.weight"};
  if (s.tied) {
    f.embedding.push_back(norm);
  } else {
    f.head = {norm, {Param::kLmHead, "lm_head", {V, C}, kVocab, true, Init::kNormal, "lm_head.weight"}};
  }
  const std::string at = "model.layers.{l}.";
  f.block = {
      {Param::kAttnNorm, "attn_norm", {C}, kReplicated, false, Init::kOnes, at + "input_layernorm.weight"},
      {Param::kWq, "q.w", {Q, C}, kRows, true, Init::kNormal, at + "self_attn.q_proj.weight"},
      {Param::kWk, "k.w", {KV, C}, kRows, true, Init::kNormal, at + "self_attn.k_proj.weight"},
      {Param::kWv, "v.w", {KV, C}, kRows, true, Init::kNormal, at + "self_attn.v_proj.weight"},
  };
  if (v_.qkv_bias) {
    f.block.push_back({Param::kBq, "q.b", {Q}, kRows, false, Init::kZeros, at + "self_attn.q_proj.bias"});
    f.block.push_back({Param::kBk, "k.b", {KV}, kRows, false, Init::kZeros, at + "self_attn.k_proj.bias"});
    f.block.push_back({Param::kBv, "v.b", {KV}, kRows, false, Init::kZeros, at + "self_attn.v_proj.bias"});
  }
  f.block.insert(f.block.end(), {
      {Param::kWo, "o.w", {C, Q}, kColumns, true, Init::kNormal, at + "self_attn.o_proj.weight"},
      {Param::kMlpNorm, "mlp_norm", {C}, kReplicated, false, Init::kOnes, at + "post_attention_layernorm.weight"},
      {Param::kWGate, "gate.w", {I, C}, kRows, true, Init::kNormal, at + "mlp.gate_proj.weight"},
      {Param::kWUp, "up.w", {I, C}, kRows, true, Init::kNormal, at + "mlp.up_proj.weight"},
      {Param::kWDown, "down.w", {C, I}, kColumns, true, Init::kNormal, at + "mlp.down_proj.weight"},
  });
  for (std::vector<TensorInfo>* unit : {&f.embedding, &f.block, &f.head}) {
    for (TensorInfo& t : *unit) t.hf_sizes = ConfigSizes(t.kind);
  }
  return f;
}

std::string LlamaFamily::ConfigSizes(Param kind) const {
  const std::string q = "num_attention_heads x head_dim", kv = "num_key_value_heads x head_dim";
  switch (kind) {
    case Param::kEmbed: case Param::kLmHead: return "vocab_size, hidden_size";
    case Param::kWq: return q + ", hidden_size";
    case Param::kWk: case Param::kWv: return kv + ", hidden_size";
    case Param::kBq: return q;
    case Param::kBk: case Param::kBv: return kv;
    case Param::kWo: return "hidden_size, " + q;
    case Param::kWGate: case Param::kWUp: return "intermediate_size, hidden_size";
    case Param::kWDown: return "hidden_size, intermediate_size";
    default: return "hidden_size";  // the norms
  }
}

bool LlamaFamily::Ignored(std::string_view hf_name) const {  // RoPE's cached frequencies
  static const std::regex inv_freq(R"(model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq)");
  return std::regex_match(std::string(hf_name), inv_freq);
}

std::vector<Buffer> LlamaFamily::BlockActivationBuffers(int batch, int seq, const ModelShape& s, int tp_size,
                                                        const EngineTypes& t) const {
  const int64_t N = int64_t(batch) * seq, C = s.hidden;
  const int64_t Q = s.QueryWidth() / tp_size, KV = s.KvWidth() / tp_size, H = s.Intermediate() / tp_size;
  const int A = t.act_bytes, G = t.acc_bytes;
  return {
      {"attn_norm", N * C, A},
      {"attn_rstd", N, G},
      {"qkv", N * (Q + 2 * KV), A},  // q and k after RoPE
      {"atty", N * Q, A},
      {"att_state", AttentionStateElements(batch, seq, s, tp_size, t), G},
      {"residual2", N * C, A},
      {"mlp_norm", N * C, A},
      {"mlp_rstd", N, G},
      {"gate_up", N * 2 * H, A},  // this rank's gate, then its up
      {"swiglu", N * H, A},       // silu(gate) * up
      {"output", N * C, A},
  };
}

std::vector<Buffer> LlamaFamily::BlockScratchBuffers(int batch, int seq, const ModelShape& s, int tp_size,
                                                     const EngineTypes& t, bool dropout) const {
  const int64_t N = int64_t(batch) * seq, H = s.Intermediate() / tp_size;
  return ScratchAround(batch, seq, s, tp_size, t, dropout,
                       {{"dswiglu", N * H, t.act_bytes},  // the SwiGLU output's
                        {"dgate_up", N * 2 * H, t.act_bytes}});  // gate's and up's
}

std::vector<Buffer> LlamaFamily::FamilyBuffers(int seq, const ModelShape& s, const EngineTypes& t) const {
  return {{"rope", 2 * int64_t(seq) * (s.HeadDim() / 2), t.acc_bytes}};  // cos, then sin
}

// q, k and v (with Qwen2's biases); o and down into the residual stream
// (worker/model/llama.cc).
std::vector<BlockProduct> LlamaFamily::BlockProducts(const ModelShape& s, int64_t) const {
  const int64_t C = s.hidden, Q = s.QueryWidth(), KV = s.KvWidth(), I = s.intermediate;
  return {{C, Q + 2 * KV, Param::kWq, TpSplit::kRows, true, {.bias = v_.qkv_bias}},
          {Q, C, Param::kWo, TpSplit::kColumns, true, {.residual = true}},
          {C, 2 * I, Param::kWGate, TpSplit::kRows, true, {}},
          {I, C, Param::kWDown, TpSplit::kColumns, true, {.residual = true}}};
}

const ModelFamily& Llama() {
  // llama-tiny is a byte-level model small enough to train in tests on two cores; the
  // others are the published shapes (their config.json) with a window of 2048.
  static const LlamaFamily family({
      .id = {"llama", "Llama", "LlamaForCausalLM", "llama",
             kLlamaConfigNames},
      .presets =
          {
              {"llama-tiny",
               {.layers = 4, .heads = 4, .hidden = 128, .vocab_size = 256, .seq_len = 128, .family = "llama",
                .kv_heads = 2, .head_dim = 32, .intermediate = 352, .max_positions = 256, .rope_theta = 10000,
                .tied = false}},
              {"llama3.2-1b",
               {.layers = 16, .heads = 32, .hidden = 2048, .vocab_size = 128256, .seq_len = 2048,
                .family = "llama", .kv_heads = 8, .head_dim = 64, .intermediate = 8192, .max_positions = 131072,
                .rope_theta = 500000, .rope_scaling = Llama3Rope(32), .tied = true}},
              {"llama3.2-3b",
               {.layers = 28, .heads = 24, .hidden = 3072, .vocab_size = 128256, .seq_len = 2048,
                .family = "llama", .kv_heads = 8, .head_dim = 128, .intermediate = 8192, .max_positions = 131072,
                .rope_theta = 500000, .rope_scaling = Llama3Rope(32), .tied = true}},
              {"llama3.1-8b",
               {.layers = 32, .heads = 32, .hidden = 4096, .vocab_size = 128256, .seq_len = 2048,
                .family = "llama", .kv_heads = 8, .head_dim = 128, .intermediate = 14336, .max_positions = 131072,
                .rope_theta = 500000, .rope_scaling = Llama3Rope(8), .tied = false}},
              {"llama3.1-70b",
               {.layers = 80, .heads = 64, .hidden = 8192, .vocab_size = 128256, .seq_len = 2048,
                .family = "llama", .kv_heads = 8, .head_dim = 128, .intermediate = 28672, .max_positions = 131072,
                .rope_theta = 500000, .rope_scaling = Llama3Rope(8), .tied = false}},
              {"llama3.1-405b",
               {.layers = 126, .heads = 128, .hidden = 16384, .vocab_size = 128256, .seq_len = 2048,
                .family = "llama", .kv_heads = 8, .head_dim = 128, .intermediate = 53248, .max_positions = 131072,
                .rope_theta = 500000, .rope_scaling = Llama3Rope(8), .tied = false}},
          },
      .written = {{"attention_bias", false}, {"mlp_bias", false}},
  });
  return family;
}

const ModelFamily& Mistral() {  // Llama's math under Mistral's names, without a sliding window
  static const LlamaFamily family({
      .id = {"mistral", "Mistral", "MistralForCausalLM", "llama",
             kLlamaConfigNames},
      .presets = {{"mistral-7b",
                   {.layers = 32, .heads = 32, .hidden = 4096, .vocab_size = 32768, .seq_len = 2048,
                    .family = "mistral", .kv_heads = 8, .head_dim = 128, .intermediate = 14336,
                    .max_positions = 32768, .rope_theta = 1000000, .tied = false}}},
      .written = {{"sliding_window", nullptr}},
  });
  return family;
}

const ModelFamily& Qwen2() {  // Llama's math with biases on q, k and v (Qwen2, Qwen2.5)
  static const LlamaFamily family({
      .id = {"qwen2", "Qwen2", "Qwen2ForCausalLM", "llama",
             kLlamaConfigNames},
      .presets =
          {
              {"qwen2.5-0.5b",
               {.layers = 24, .heads = 14, .hidden = 896, .vocab_size = 151936, .seq_len = 2048, .family = "qwen2",
                .kv_heads = 2, .head_dim = 64, .intermediate = 4864, .max_positions = 32768, .norm_eps = 1e-6,
                .rope_theta = 1000000, .tied = true}},
              {"qwen2.5-7b",
               {.layers = 28, .heads = 28, .hidden = 3584, .vocab_size = 152064, .seq_len = 2048, .family = "qwen2",
                .kv_heads = 4, .head_dim = 128, .intermediate = 18944, .max_positions = 32768, .norm_eps = 1e-6,
                .rope_theta = 1000000, .tied = false}},
              {"qwen2.5-72b",
               {.layers = 80, .heads = 64, .hidden = 8192, .vocab_size = 152064, .seq_len = 2048, .family = "qwen2",
                .kv_heads = 8, .head_dim = 128, .intermediate = 29568, .max_positions = 32768, .norm_eps = 1e-6,
                .rope_theta = 1000000, .tied = false}},
          },
      .qkv_bias = true,
      .refuses_attention_bias = false,
      .use_sliding_window_key = true,
      .written = {{"use_sliding_window", false}},
  });
  return family;
}

}  // namespace meshtrain::api
