// GPT-2 (GPT2LMHeadModel): pre-LayerNorm blocks, a learned position table, a tanh-GELU
// MLP of 4 x hidden, biases on every product, the LM head tied to the token embedding.
// Its layers are worker/model/gpt2.cc.

#include <regex>

#include "api/families/families.h"
#include "api/hf_config_keys.h"

namespace meshtrain::api {
namespace {

using Json = nlohmann::json;
using enum TpSplit;

class Gpt2Family final : public ModelFamily {
 public:
  Gpt2Family()
      : ModelFamily({"gpt2", "GPT-2", "GPT2LMHeadModel", "gpt2", {"n_layer", "n_head", "n_embd", "n_positions"}}) {}

  // gpt2-tiny is a byte-level model small enough to train in tests on two cores; the
  // others are the published shapes with GPT-2's window of 1024.
  std::vector<Preset> Presets() const override {
    return {
        {"gpt2-tiny", {.layers = 4, .heads = 4, .hidden = 128, .vocab_size = 256, .seq_len = 128}},
        {"gpt2-124m", {.layers = 12, .heads = 12, .hidden = 768, .vocab_size = 50257, .seq_len = 1024}},
        {"gpt2-350m", {.layers = 24, .heads = 16, .hidden = 1024, .vocab_size = 50257, .seq_len = 1024}},
        {"gpt2-774m", {.layers = 36, .heads = 20, .hidden = 1280, .vocab_size = 50257, .seq_len = 1024}},
        {"gpt2-1.5b", {.layers = 48, .heads = 25, .hidden = 1600, .vocab_size = 50257, .seq_len = 1024}},
    };
  }

  void Resolve(ModelShape* s) const override {
    s->tied = true;  // its head is always its embedding
    s->rope_theta = 10000;  // and it has no RoPE
    s->rope_scaling = {};
  }

  void DefaultFromPreset(const ModelShape&, ModelSpec*) const override {}
  void Default(ModelSpec*) const override {}

  // The Llama-class fields: each may only restate GPT-2's own value.
  void Check(const ModelSpec& m, FieldChecker& c) const override {
    auto fixed = [&](const char* name, const std::optional<int64_t>& value, std::optional<int64_t> gpt2,
                     const std::string& what) {
      if (value && gpt2 && *value != *gpt2) {
        c.Fail(std::string("spec.model.") + name, "GPT-2 has " + what + " (" + std::to_string(*gpt2) + "), got " +
                                                     std::to_string(*value) + "; set spec.model.family for another");
      }
    };
    const bool divisible = m.heads && m.hidden && *m.heads > 0 && *m.hidden % *m.heads == 0;
    fixed("kvHeads", m.kv_heads, m.heads, "as many key/value heads as heads");
    fixed("headDim", m.head_dim, divisible ? std::optional<int64_t>(*m.hidden / *m.heads) : std::nullopt,
          "heads of hidden / heads channels");
    fixed("intermediateSize", m.intermediate_size, m.hidden ? std::optional<int64_t>(4 * *m.hidden) : std::nullopt,
          "an MLP of 4 x hidden");
    if (m.norm_eps && *m.norm_eps != 1e-5) {
      c.Fail("spec.model.normEps", "GPT-2's LayerNorm has epsilon 1e-5, got " + FieldChecker::Show(*m.norm_eps));
    }
    if (m.rope_theta) c.Fail("spec.model.ropeTheta", "GPT-2 has no RoPE (it learns a position table)");
    if (m.rope_scaling) c.Fail("spec.model.ropeScaling", "GPT-2 has no RoPE (it learns a position table)");
    if (m.tie_embeddings && !*m.tie_embeddings) {
      c.Fail("spec.model.tieEmbeddings", "GPT-2's LM head is always its token embedding");
    }
    if (m.heads && m.hidden && *m.heads > 0 && *m.hidden > 0 && *m.hidden % *m.heads != 0) {
      c.Fail("spec.model.hidden", "must be divisible by spec.model.heads (" + std::to_string(*m.heads) + "), got " +
                                      std::to_string(*m.hidden));
    }
  }

  void SpecOf(const ModelShape&, ModelSpec*) const override {}

  std::string Describe(const ModelShape& s) const override {
    return "layers " + std::to_string(s.layers) + ", heads " + std::to_string(s.heads) + ", hidden " +
           std::to_string(s.hidden) + ", " + DescribeWindow(s);
  }

  bool LearnsPositions() const override { return true; }

  std::vector<std::pair<int64_t, std::string>> TensorParallelSplits(const ModelShape& s) const override {
    return {{s.heads, "spec.model.heads"}, {s.Intermediate(), "the MLP width (4 x spec.model.hidden)"}};
  }

  void ReadConfig(const Json&, const ConfigKeys& k, HuggingFaceConfig* c) const override {
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

  void WriteConfig(const ModelShape& s, Json* j) const override {
    Json& c = *j;
    c["n_layer"] = s.layers;
    c["n_head"] = s.heads;
    c["n_embd"] = s.hidden;
    c["n_positions"] = s.max_positions;
    c["n_ctx"] = s.max_positions;
    c["n_inner"] = nullptr;
    c["activation_function"] = "gelu_new";
    c["layer_norm_epsilon"] = 1e-5;
    c["resid_pdrop"] = 0.0;
    c["embd_pdrop"] = 0.0;
    c["attn_pdrop"] = 0.0;
    c["tie_word_embeddings"] = true;
  }

  int64_t DefaultSeqLen(int64_t max_positions) const override { return max_positions; }

  FamilyTensors Tensors(const ModelShape& s) const override {
    const int64_t C = s.hidden, V = s.vocab_size, P = s.MaxPositions(), H = s.Intermediate();
    FamilyTensors f;
    f.embedding = {
        {Param::kWte, "wte", {V, C}, kVocab, true, Init::kNormal, "wte.weight"},
        {Param::kWpe, "wpe", {P, C}, kReplicated, true, Init::kNormal, "wpe.weight"},
        {Param::kLnfW, "lnf.w", {C}, kReplicated, false, Init::kOnes, "ln_f.weight"},
        {Param::kLnfB, "lnf.b", {C}, kReplicated, false, Init::kZeros, "ln_f.bias"},
    };
    f.block = {
        {Param::kLn1W, "ln1.w", {C}, kReplicated, false, Init::kOnes, "h.{l}.ln_1.weight"},
        {Param::kLn1B, "ln1.b", {C}, kReplicated, false, Init::kZeros, "h.{l}.ln_1.bias"},
        {Param::kQkvW, "qkv.w", {3 * C, C}, kQkvRows, true, Init::kNormal, "h.{l}.attn.c_attn.weight", true},
        {Param::kQkvB, "qkv.b", {3 * C}, kQkvRows, false, Init::kZeros, "h.{l}.attn.c_attn.bias"},
        {Param::kAttProjW, "attproj.w", {C, C}, kColumns, true, Init::kResidual, "h.{l}.attn.c_proj.weight", true},
        {Param::kAttProjB, "attproj.b", {C}, kReplicated, false, Init::kZeros, "h.{l}.attn.c_proj.bias"},
        {Param::kLn2W, "ln2.w", {C}, kReplicated, false, Init::kOnes, "h.{l}.ln_2.weight"},
        {Param::kLn2B, "ln2.b", {C}, kReplicated, false, Init::kZeros, "h.{l}.ln_2.bias"},
        {Param::kFcW, "fc.w", {H, C}, kRows, true, Init::kNormal, "h.{l}.mlp.c_fc.weight", true},
        {Param::kFcB, "fc.b", {H}, kRows, false, Init::kZeros, "h.{l}.mlp.c_fc.bias"},
        {Param::kFcProjW, "fcproj.w", {C, H}, kColumns, true, Init::kResidual, "h.{l}.mlp.c_proj.weight", true},
        {Param::kFcProjB, "fcproj.b", {C}, kReplicated, false, Init::kZeros, "h.{l}.mlp.c_proj.bias"},
    };
    return f;
  }

  bool Ignored(std::string_view hf_name) const override {  // the attention-mask buffers
    static const std::regex masks(R"((transformer\.)?h\.\d+\.attn\.(masked_)?bias)");
    return std::regex_match(std::string(hf_name), masks);
  }
  std::string_view BodyPrefix() const override { return "transformer."; }
  bool HasSingleFileForm() const override { return true; }
  // Its names with or without the body prefix; layers from h.{l}, heads from head_dim.
  std::optional<ModelShape> ShapeOfSingleFile(const std::map<std::string, std::vector<int64_t>>& tensors,
                                              int64_t head_dim) const override {
    auto find = [&](const std::string& name) -> const std::vector<int64_t>* {
      for (const std::string_view prefix : {std::string_view(), BodyPrefix()}) {
        const auto it = tensors.find(std::string(prefix) + name);
        if (it != tensors.end()) return &it->second;
      }
      return nullptr;
    };
    const std::vector<int64_t>* wte = find("wte.weight");
    if (wte == nullptr) return std::nullopt;
    const std::vector<int64_t>* wpe = find("wpe.weight");
    for (const auto& [name, sizes] : {std::pair{"wte.weight", wte}, std::pair{"wpe.weight", wpe}}) {
      if (sizes == nullptr || sizes->size() != 2) {
        throw std::invalid_argument(std::string("no two-dimensional tensor ") + name +
                                    "; not a GPT-2 in Hugging Face's layout");
      }
    }
    ModelShape shape;
    shape.vocab_size = (*wte)[0];
    shape.hidden = (*wte)[1];
    shape.seq_len = (*wpe)[0];
    while (find("h." + std::to_string(shape.layers) + ".ln_1.weight") != nullptr) ++shape.layers;
    if (shape.layers == 0) throw std::invalid_argument("no h.0.ln_1.weight; not a GPT-2 in Hugging Face's layout");
    if (head_dim <= 0 || shape.hidden % head_dim != 0) {
      throw std::invalid_argument("hidden size " + std::to_string(shape.hidden) + " is not a multiple of heads of " +
                                  std::to_string(head_dim));
    }
    shape.heads = shape.hidden / head_dim;
    return shape;
  }

  std::vector<Buffer> BlockActivationBuffers(int batch, int seq, const ModelShape& s, int tp_size,
                                             const EngineTypes& t) const override {
    const int64_t N = int64_t(batch) * seq, C = s.hidden;
    const int64_t Q = s.QueryWidth() / tp_size, H = s.Intermediate() / tp_size;
    const int A = t.act_bytes, G = t.acc_bytes;
    return {
        {"ln1", N * C, A},
        {"ln1_mean", N, G},
        {"ln1_rstd", N, G},
        {"qkv", N * 3 * Q, A},
        {"atty", N * Q, A},
        {"att_state", AttentionStateElements(batch, seq, s, tp_size, t), G},
        {"residual2", N * C, A},
        {"ln2", N * C, A},
        {"ln2_mean", N, G},
        {"ln2_rstd", N, G},
        {"fch", N * H, A},       // the MLP's pre-activation
        {"fch_gelu", N * H, A},  // its GELU
        {"output", N * C, A},
    };
  }

  std::vector<Buffer> BlockScratchBuffers(int batch, int seq, const ModelShape& s, int tp_size, const EngineTypes& t,
                                          bool dropout) const override {
    const int64_t N = int64_t(batch) * seq, H = s.Intermediate() / tp_size;
    return ScratchAround(batch, seq, s, tp_size, t, dropout, {{"dfch", N * H, t.act_bytes}});  // the MLP's
  }

  bool NormKeepsMean() const override { return true; }
  std::vector<Buffer> FamilyBuffers(int, const ModelShape&, const EngineTypes&) const override { return {}; }

  // qkv, the attention's projection, fc and the fc projection: every one with a bias, the
  // projections into the residual stream, fc's GELU (worker/model/gpt2.cc).
  std::vector<BlockProduct> BlockProducts(const ModelShape& s, int64_t) const override {
    const int64_t C = s.hidden, I = s.intermediate;
    return {{C, 3 * C, Param::kQkvW, TpSplit::kRows, true, {.bias = true}},
            {C, C, Param::kAttProjW, TpSplit::kColumns, true, {.bias = true, .residual = true}},
            {C, I, Param::kFcW, TpSplit::kRows, true, {.bias = true, .gelu = true}},
            {I, C, Param::kFcProjW, TpSplit::kColumns, true, {.bias = true, .residual = true, .gelu_input = true}}};
  }
};

}  // namespace

const ModelFamily& Gpt2() {
  static const Gpt2Family family;
  return family;
}

}  // namespace meshtrain::api
