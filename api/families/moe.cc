// The mixtures of experts of the Llama class: Mixtral (MixtralForCausalLM) and Qwen3-MoE
// (Qwen3MoeForCausalLM). Attention is the Llama class's (Qwen3-MoE's with Qwen3's RMSNorm
// over each head of q and k, head_dim 128 where config.json leaves it out); the MLP is a
// sparse layer as transformers computes it: router logits x W_gate^T, a softmax in fp32
// over all E experts, the top k (equal probabilities: the lower index), their weights
// renormalised to sum to 1 (Mixtral always, Qwen3-MoE where norm_topk_prob), and the
// weighted sum of the chosen experts' SwiGLU MLPs; dropless. A block holds the router
// (E,C), then each expert's gate and up (I,C) in turn, then every expert's down (C,I), by
// the per-expert names that published checkpoints use (not transformers 5's fused
// in-memory gate_up_proj). Routers are matrices: weight decay applies to them.
//
// Qwen3-MoE's decoder_sparse_step and mlp_only_layers say which blocks are sparse
// (ModelShape::DenseBlock, as transformers decides); the others are dense blocks: Qwen3's
// attention and a dense SwiGLU MLP of intermediate_size units under Qwen3's names
// (FamilyTensors::dense_block), a unit of their own. Every published Qwen3-MoE has 1 and
// none: every block sparse. Mixtral's blocks are all sparse. Tensor parallelism splits
// each expert as the dense MLP is split (its gate's and up's rows, its down's columns) and
// keeps the router whole (worker/model/moe_block.h).
// output_router_logits true turns the load-balancing loss on with router_aux_loss_coef
// (HuggingFaceConfig; spec.training.routerAuxLossCoef overrides it).

#include <algorithm>
#include <string>

#include "api/families/llama.h"
#include "api/hf_config_keys.h"

namespace meshtrain::api {
namespace {

using Json = nlohmann::json;

// Qwen3's head_dim where config.json or spec.model leaves it out.
constexpr int64_t kQwen3MoeHeadDim = 128;
// The kernels' limits (worker/kernels/ops.h): E <= 1024 experts, k <= 32 of them a token.
constexpr int64_t kMaxExperts = 1024, kMaxExpertsPerToken = 32;

std::string MoeText(int64_t n) { return std::to_string(n); }

class MoeFamily final : public LlamaFamily {
 public:
  struct Moe {
    bool qwen = false;              // Qwen3-MoE: q/k norms, moe_intermediate_size, norm_topk_prob, sparse layers
    const char* experts_key;        // config.json's count of experts
    std::string sparse;             // the sparse layer's module under model.layers.{l}.
    const char* expert_names[3];    // each expert's gate, up and down
    const char* width_key;          // config.json's expert width
  };

  MoeFamily(Variant v, Moe m) : LlamaFamily(std::move(v)), m_(m) {}

  bool HasExperts() const override { return true; }

  // Mixtral's attention is Mistral's without its window; Qwen3-MoE's is Qwen3's.
  std::optional<ModelShape> DenseOfSameActive(const ModelShape& shape) const override {
    ModelShape d = shape.Resolved();
    if (d.DenseBlocks() > 0) return std::nullopt;  // its blocks are of two widths
    d.family = m_.qwen ? "qwen3" : "llama";
    d.intermediate = d.experts_per_token * d.moe_intermediate;
    d.experts = d.experts_per_token = d.moe_intermediate = 0;
    d.norm_topk_prob = true;
    d.decoder_sparse_step = 1;
    d.mlp_only_layers.clear();
    return d;
  }

  void Resolve(ModelShape* s) const override {
    LlamaFamily::Resolve(s);
    if (!m_.qwen) {
      s->moe_intermediate = s->Intermediate();  // Mixtral's experts are the MLP's width
      s->norm_topk_prob = true;
    } else if (s->moe_intermediate == 0) {
      s->moe_intermediate = s->Intermediate();
    }
  }

  void DefaultFromPreset(const ModelShape& preset, ModelSpec* m) const override {
    LlamaFamily::DefaultFromPreset(preset, m);
    const ModelShape p = preset.Resolved();
    if (!m->experts) m->experts = p.experts;
    if (!m->experts_per_token) m->experts_per_token = p.experts_per_token;
    // Mixtral's experts are intermediateSize wide, whichever gave it (Default).
    if (m_.qwen && !m->moe_intermediate_size) m->moe_intermediate_size = p.moe_intermediate;
    if (!m->norm_topk_prob) m->norm_topk_prob = p.norm_topk_prob;
    if (!m->decoder_sparse_step) m->decoder_sparse_step = p.decoder_sparse_step;
  }

  void Default(ModelSpec* m) const override {
    if (m_.qwen) {  // the dense width sizes nothing while every block is sparse
      if (!m->intermediate_size && m->moe_intermediate_size && !m->NamesDenseBlocks()) {
        m->intermediate_size = m->moe_intermediate_size;
      }
      if (!m->norm_topk_prob) m->norm_topk_prob = false;  // Qwen3MoeConfig's default
    } else {
      if (!m->moe_intermediate_size && m->intermediate_size) m->moe_intermediate_size = m->intermediate_size;
      if (!m->norm_topk_prob) m->norm_topk_prob = true;
    }
    if (!m->decoder_sparse_step) m->decoder_sparse_step = 1;
    LlamaFamily::Default(m);
  }

  void Check(const ModelSpec& m, FieldChecker& c) const override {
    // Qwen3-MoE's dense width is unused while every block is sparse: only
    // moeIntermediateSize is required then (CheckSparseBlocks asks for it where it is used).
    ModelSpec attention = m;
    if (m_.qwen && !attention.intermediate_size) attention.intermediate_size = 1;
    LlamaFamily::Check(attention, c);
    const std::string title(this->title());
    bool experts_ok = false;
    if (!m.experts) c.Fail("spec.model.experts", "is required when spec.model.preset is not set");
    else experts_ok = c.Range("spec.model.experts", *m.experts, 1, kMaxExperts);
    if (!m.experts_per_token) {
      c.Fail("spec.model.expertsPerToken", "is required when spec.model.preset is not set");
    } else if (c.Range("spec.model.expertsPerToken", *m.experts_per_token, 1, kMaxExpertsPerToken) && experts_ok &&
               *m.experts_per_token > *m.experts) {
      c.Fail("spec.model.expertsPerToken", "must not exceed spec.model.experts (" + MoeText(*m.experts) + "), got " +
                                               MoeText(*m.experts_per_token));
    }
    if (m_.qwen) {
      if (!m.moe_intermediate_size) {
        c.Fail("spec.model.moeIntermediateSize", "is required when spec.model.preset is not set");
      } else {
        c.Range("spec.model.moeIntermediateSize", *m.moe_intermediate_size, 1, int64_t(1) << 20);
      }
    } else {
      if (m.moe_intermediate_size && m.intermediate_size && *m.moe_intermediate_size != *m.intermediate_size) {
        c.Fail("spec.model.moeIntermediateSize", title + "'s experts are spec.model.intermediateSize (" +
                                                     MoeText(*m.intermediate_size) + ") wide, got " +
                                                     MoeText(*m.moe_intermediate_size));
      }
      if (m.norm_topk_prob && !*m.norm_topk_prob) {
        c.Fail("spec.model.normTopkProb", title + " always renormalises the chosen experts' weights, got false");
      }
    }
    CheckSparseBlocks(m, c);
  }

  // decoderSparseStep and mlpOnlyLayers: Qwen3-MoE's, with at least one sparse block left;
  // Mixtral's blocks are all sparse (its config.json has neither key).
  void CheckSparseBlocks(const ModelSpec& m, FieldChecker& c) const {
    const std::string title(this->title());
    const int64_t last = m.layers && *m.layers >= 1 ? *m.layers - 1 : 1023;
    bool ok = true;
    if (m.decoder_sparse_step) {
      ok = c.Range("spec.model.decoderSparseStep", *m.decoder_sparse_step, 1, 1024) && ok;
      if (ok && !m_.qwen && *m.decoder_sparse_step != 1) {
        c.Fail("spec.model.decoderSparseStep", title + "'s blocks are all sparse (1), got " +
                                                   MoeText(*m.decoder_sparse_step));
        ok = false;
      }
    }
    for (size_t i = 0; i < m.mlp_only_layers.size(); ++i) {
      const std::string path = "spec.model.mlpOnlyLayers[" + std::to_string(i) + "]";
      if (!m_.qwen) {
        c.Fail(path, title + "'s blocks are all sparse: it has no dense blocks");
        ok = false;
      } else {
        ok = c.Range(path, m.mlp_only_layers[i], 0, last) && ok;
      }
    }
    if (!ok || !m.layers || !m.experts) return;
    ModelShape blocks{.layers = *m.layers, .experts = *m.experts};
    blocks.decoder_sparse_step = m.decoder_sparse_step.value_or(1);
    blocks.mlp_only_layers = m.mlp_only_layers;
    if (blocks.DenseBlocks() == blocks.layers) {
      c.Fail(!m.mlp_only_layers.empty() ? "spec.model.mlpOnlyLayers" : "spec.model.decoderSparseStep",
             "leaves no sparse block of the " + MoeText(*m.layers) + ": such a model is " + title +
                 "'s attention with dense MLPs (family qwen3)");
    } else if (blocks.DenseBlocks() > 0 && !m.intermediate_size) {
      c.Fail("spec.model.intermediateSize", "is required where blocks are dense (spec.model.mlpOnlyLayers, "
                                            "decoderSparseStep): their MLP's width");
    }
  }

  void SpecOf(const ModelShape& s, ModelSpec* m) const override {
    LlamaFamily::SpecOf(s, m);
    m->experts = s.experts;
    m->experts_per_token = s.experts_per_token;
    m->moe_intermediate_size = s.moe_intermediate;
    m->norm_topk_prob = s.norm_topk_prob;
    m->decoder_sparse_step = s.decoder_sparse_step;
    m->mlp_only_layers = s.mlp_only_layers;
  }

  std::string Describe(const ModelShape& s) const override {
    std::string text = LlamaFamily::Describe(s);
    if (m_.qwen) {  // the dense blocks by index, or the dense width unused while every block is sparse
      std::string blocks;
      for (int64_t l = 0; l < s.layers; ++l) {
        if (s.DenseBlock(l)) blocks += " " + MoeText(l);
      }
      const std::string dense = ", MLP " + MoeText(s.intermediate);
      if (const size_t at = text.find(dense); at != std::string::npos) {
        text.replace(at, dense.size(), ", dense MLP " + MoeText(s.intermediate) +
                                           (blocks.empty() ? " (unused)" : " in blocks" + blocks));
      }
    }
    text += ", experts " + MoeText(s.experts) + " (top " + MoeText(s.experts_per_token) + ", MLP " +
            MoeText(s.moe_intermediate) + (s.norm_topk_prob ? ", renormalised" : "") + ")";
    return text;
  }

  std::vector<std::pair<int64_t, std::string>> TensorParallelSplits(const ModelShape& s) const override {
    std::vector<std::pair<int64_t, std::string>> splits = {
        {s.heads, "spec.model.heads"},
        {s.KvHeads(), "spec.model.kvHeads"},
        {s.moe_intermediate, "the experts' width (spec.model.moeIntermediateSize)"}};
    if (s.DenseBlocks() > 0) splits.push_back({s.Intermediate(), "the dense blocks' MLP width (spec.model.intermediateSize)"});
    return splits;
  }

  void ReadConfig(const Json& j, const ConfigKeys& k, HuggingFaceConfig* c) const override {
    LlamaFamily::ReadConfig(j, k, c);
    ModelSpec& m = c->model;
    m.experts = k.Int(m_.experts_key);
    m.experts_per_token = k.Int("num_experts_per_tok");
    if (*m.experts_per_token > *m.experts) {
      k.Fail("num_experts_per_tok " + MoeText(*m.experts_per_token) + " exceeds " + m_.experts_key + " (" +
             MoeText(*m.experts) + ")");
    }
    if (const std::optional<double> noise = k.Number("router_jitter_noise"); noise && *noise != 0) {
      k.Fail("router_jitter_noise " + Json(*noise).dump() +
             " is not implemented: the router's inputs are not perturbed here (0 is taken)");
    }
    if (k.Bool("output_router_logits").value_or(false)) {  // the load-balancing loss, as transformers adds it
      c->router_aux_loss_coef = k.Number("router_aux_loss_coef").value_or(0.001);
      if (*c->router_aux_loss_coef < 0) k.Fail("router_aux_loss_coef must not be negative");
    }
    for (const char* shared : {"shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts"}) {
      if (k.Has(shared) && !(j.at(shared).is_number() && j.at(shared).get<double>() == 0)) {
        k.Fail(std::string(shared) + " " + j.at(shared).dump() + " is not implemented: " + std::string(title()) +
               " has no shared experts here");
      }
    }
    if (m_.qwen) {
      m.moe_intermediate_size = k.Int("moe_intermediate_size");
      m.norm_topk_prob = k.Bool("norm_topk_prob").value_or(false);
      m.decoder_sparse_step = k.OptionalInt("decoder_sparse_step").value_or(1);
      if (k.Has("mlp_only_layers")) {
        const Json& dense = j.at("mlp_only_layers");
        if (!dense.is_array()) k.Fail("mlp_only_layers must be a list of block indices, got " + dense.dump());
        for (const Json& l : dense) {
          if (!l.is_number_integer() || l.get<int64_t>() < 0 || l.get<int64_t>() >= *m.layers) {
            k.Fail("mlp_only_layers " + dense.dump() + ": " + l.dump() + " is not a block index below " +
                   MoeText(*m.layers) + " (num_hidden_layers)");
          }
          m.mlp_only_layers.push_back(l.get<int64_t>());
        }
      }
      RefuseSlidingLayers(j, k);
    } else {
      m.moe_intermediate_size = m.intermediate_size;
      m.norm_topk_prob = true;
    }
  }

  void WriteConfig(const ModelShape& s, Json* j) const override {
    LlamaFamily::WriteConfig(s, j);
    Json& c = *j;
    c[m_.experts_key] = s.experts;
    c["num_experts_per_tok"] = s.experts_per_token;
    c["output_router_logits"] = false;
    if (m_.qwen) {
      c["moe_intermediate_size"] = s.moe_intermediate;
      c["norm_topk_prob"] = s.norm_topk_prob;
      c["decoder_sparse_step"] = s.decoder_sparse_step;
      c["mlp_only_layers"] = s.mlp_only_layers;
      c["max_window_layers"] = s.layers;
    } else {
      c["router_jitter_noise"] = 0.0;
    }
  }

  // A sparse block: attention (the Llama class's, with Qwen3-MoE's q and k norms), the
  // router, then the experts. A dense block (Qwen3-MoE's, where the shape has one): the
  // same attention and the Llama class's dense MLP, intermediate wide.
  FamilyTensors Tensors(const ModelShape& s) const override {
    FamilyTensors f = LlamaFamily::Tensors(s);
    const std::string at = "model.layers.{l}.";
    const int64_t C = s.hidden, E = s.experts, I = s.moe_intermediate, D = s.HeadDim();
    if (m_.qwen) {
      size_t after_v = 0;
      while (f.block[after_v].kind != Param::kWv) ++after_v;
      f.block.insert(f.block.begin() + long(after_v) + 1,
                     {{Param::kQNorm, "q_norm", {D}, TpSplit::kReplicated, false, Init::kOnes,
                       at + "self_attn.q_norm.weight", false, "head_dim"},
                      {Param::kKNorm, "k_norm", {D}, TpSplit::kReplicated, false, Init::kOnes,
                       at + "self_attn.k_norm.weight", false, "head_dim"}});
    }
    if (s.DenseBlocks() > 0) f.dense_block = f.block;
    std::erase_if(f.block, [](const TensorInfo& t) {
      return t.kind == Param::kWGate || t.kind == Param::kWUp || t.kind == Param::kWDown;
    });
    const std::string sparse = at + m_.sparse, width = m_.width_key;
    f.block.push_back({Param::kRouter, "router.w", {E, C}, TpSplit::kReplicated, true, Init::kNormal,
                       sparse + "gate.weight", false, std::string(m_.experts_key) + ", hidden_size"});
    auto expert = [&](Param kind, int64_t e, int which, std::vector<int64_t> shape, std::string sizes) {
      static constexpr const char* kOurs[3] = {"gate", "up", "down"};
      const std::string n = MoeText(e);
      return TensorInfo{kind, "experts." + n + "." + kOurs[which] + ".w", std::move(shape),
                        which == 2 ? TpSplit::kColumns : TpSplit::kRows, true, Init::kNormal,
                        sparse + "experts." + n + "." + m_.expert_names[which] + ".weight", false, std::move(sizes)};
    };
    for (int64_t e = 0; e < E; ++e) {
      f.block.push_back(expert(Param::kExpertGate, e, 0, {I, C}, width + ", hidden_size"));
      f.block.push_back(expert(Param::kExpertUp, e, 1, {I, C}, width + ", hidden_size"));
    }
    for (int64_t e = 0; e < E; ++e) {
      f.block.push_back(expert(Param::kExpertDown, e, 2, {C, I}, "hidden_size, " + width));
    }
    return f;
  }

  // The Llama class's attention, then the sparse layer's: the router's logits (N,E), its
  // probabilities (N,E), the chosen experts and their weights (N,k), the dispatch plan
  // (each copy's row, and each expert's count), the copies grouped by expert (N*k,C), their
  // gate and up (N*k,2I), SwiGLU's output (N*k,I) and the experts' outputs (N*k,C); of I,
  // a TP rank's I / T units.
  std::vector<Buffer> BlockActivationBuffers(int batch, int seq, const ModelShape& s, int tp_size,
                                             const EngineTypes& t) const override {
    std::vector<Buffer> b = LlamaFamily::BlockActivationBuffers(batch, seq, s, tp_size, t);
    std::erase_if(b, [](const Buffer& x) { return x.name == "gate_up" || x.name == "swiglu" || x.name == "output"; });
    const int64_t N = int64_t(batch) * seq, C = s.hidden, E = s.experts, K = s.experts_per_token,
                  I = s.moe_intermediate / tp_size;  // this TP rank's units of each expert
    const int A = t.act_bytes, G = t.acc_bytes;
    const int64_t R = t.experts * N * K;  // the rows this rank's experts may get
    b.insert(b.end(), {
                          {"router_logits", N * E, A},
                          {"router_probs", N * E, G},
                          {"experts", N * K, 4},
                          {"expert_weights", N * K, G},
                          {"positions", N * K, 4},
                          {"counts", E, 4},
                          {"xs", N * K * C, A},
                          {"gate_up", R * 2 * I, A},
                          {"swiglu", R * I, A},
                          {"ys", N * K * C, A},
                      });
    if (t.experts > 1) {  // every member's counts (EP,E), and the rows that came to this rank's experts
      b.insert(b.end(), {{"group_counts", t.experts * E, 4}, {"xs_experts", R * C, A}, {"ys_experts", R * C, A}});
    }
    if (m_.qwen) {
      const int64_t heads = (s.heads + s.KvHeads()) / tp_size;
      b.push_back({"qk_raw", N * heads * s.HeadDim(), A});
      b.push_back({"qk_rstd", N * heads, G});
    }
    b.push_back({"output", N * C, A});
    WidenForDenseBlocks(s, LlamaFamily::BlockActivationBuffers(batch, seq, s, tp_size, t), &b);
    return b;
  }

  // Every block is carved alike: where some blocks are dense, a buffer both kinds name
  // (gate_up, swiglu and their gradients) is as large as either kind needs.
  static void WidenForDenseBlocks(const ModelShape& s, const std::vector<Buffer>& dense, std::vector<Buffer>* b) {
    if (s.DenseBlocks() == 0) return;
    for (Buffer& x : *b) {
      for (const Buffer& d : dense) {
        if (d.name == x.name) x.elements = std::max(x.elements, d.elements);
      }
    }
  }

  std::vector<Buffer> BlockScratchBuffers(int batch, int seq, const ModelShape& s, int tp_size, const EngineTypes& t,
                                          bool dropout) const override {
    const int64_t N = int64_t(batch) * seq, C = s.hidden, E = s.experts, K = s.experts_per_token,
                  I = s.moe_intermediate / tp_size;
    const int A = t.act_bytes, G = t.acc_bytes;
    const int64_t R = t.experts * N * K;  // as BlockActivationBuffers
    std::vector<Buffer> moe = {{"dswiglu", R * I, A},  {"dgate_up", R * 2 * I, A},    {"dys", N * K * C, A},
                               {"dxs", N * K * C, A}, {"dexpert_weights", N * K, G}, {"drouter_logits", N * E, A}};
    if (t.experts > 1) moe.insert(moe.end(), {{"dys_experts", R * C, A}, {"dxs_experts", R * C, A}});
    if (tp_size > 1) moe.push_back({"all_dexpert_weights", tp_size * N * K, G});  // every TP rank's dexpert_weights
    std::vector<Buffer> b = ScratchAround(batch, seq, s, tp_size, t, dropout, moe);
    WidenForDenseBlocks(s, LlamaFamily::BlockScratchBuffers(batch, seq, s, tp_size, t, dropout), &b);
    if (m_.qwen) {
      b.push_back({"dhead_norms", 2 * s.HeadDim(), G});
      if (tp_size > 1) b.push_back({"all_head_norms", tp_size * 2 * s.HeadDim(), G});
    }
    return b;
  }

  // Per token: the Llama class's q, k and v, and o; the router; and its k experts' gate and
  // up, and down. Float8 casts the attention's only. A dense block's are the Llama class's.
  std::vector<BlockProduct> BlockProducts(const ModelShape& s, int64_t layer) const override {
    if (s.DenseBlock(layer)) return LlamaFamily::BlockProducts(s, layer);
    const int64_t C = s.hidden, I = s.moe_intermediate, K = s.experts_per_token;
    std::vector<BlockProduct> products = LlamaFamily::BlockProducts(s, layer);
    std::erase_if(products,
                  [](const BlockProduct& p) { return p.weight == Param::kWGate || p.weight == Param::kWDown; });
    products.insert(products.end(), {{C, s.experts, Param::kRouter, TpSplit::kReplicated, false, {}},
                                     {C, 2 * I * K, Param::kExpertGate, TpSplit::kRows, false, {}},
                                     {I * K, C, Param::kExpertDown, TpSplit::kColumns, false, {}}});
    return products;
  }

 protected:
  std::optional<int64_t> DefaultHeadDim(std::optional<int64_t> hidden, std::optional<int64_t> heads) const override {
    if (m_.qwen) return kQwen3MoeHeadDim;
    return LlamaFamily::DefaultHeadDim(hidden, heads);
  }

 private:
  Moe m_;
};

ModelShape MixtralShape(int64_t layers, int64_t heads, int64_t hidden, int64_t intermediate, int64_t max_positions) {
  return {.layers = layers, .heads = heads, .hidden = hidden, .vocab_size = 32000, .seq_len = 2048,
          .family = "mixtral", .kv_heads = 8, .head_dim = 128, .intermediate = intermediate,
          .max_positions = max_positions, .norm_eps = 1e-5, .rope_theta = 1e6, .tied = false, .experts = 8,
          .experts_per_token = 2, .moe_intermediate = intermediate, .norm_topk_prob = true};
}

ModelShape Qwen3MoeShape(int64_t layers, int64_t heads, int64_t hidden, int64_t intermediate, int64_t moe) {
  return {.layers = layers, .heads = heads, .hidden = hidden, .vocab_size = 151936, .seq_len = 2048,
          .family = "qwen3_moe", .kv_heads = 4, .head_dim = 128, .intermediate = intermediate,
          .max_positions = 40960, .norm_eps = 1e-6, .rope_theta = 1e6, .tied = false, .experts = 128,
          .experts_per_token = 8, .moe_intermediate = moe, .norm_topk_prob = true};
}

}  // namespace

// moe-tiny is a byte-level model small enough to train in tests on two cores; the others
// are the published shapes (config.json of mistralai/Mixtral-8x7B-v0.1 and -8x22B-v0.1:
// 46,702,792,704 and 140,620,634,112 parameters) with a window of 2048.
const ModelFamily& Mixtral() {
  static const MoeFamily family(
      {.id = {"mixtral", "Mixtral", "MixtralForCausalLM", "llama", kLlamaConfigNames},
       .presets = {{"moe-tiny",
                    {.layers = 2, .heads = 4, .hidden = 64, .vocab_size = 256, .seq_len = 64,
                     .family = "mixtral", .kv_heads = 2, .head_dim = 16, .intermediate = 48,
                     .max_positions = 256, .rope_theta = 10000, .tied = false, .experts = 4,
                     .experts_per_token = 2, .moe_intermediate = 48, .norm_topk_prob = true}},
                   {"mixtral-8x7b", MixtralShape(32, 32, 4096, 14336, 32768)},
                   {"mixtral-8x22b", MixtralShape(56, 48, 6144, 16384, 65536)}},
       .refuses_attention_bias = true,
       .use_sliding_window_key = false,
       .written = {{"sliding_window", nullptr}}},
      {.qwen = false,
       .experts_key = "num_local_experts",
       .sparse = "block_sparse_moe.",
       .expert_names = {"w1", "w3", "w2"},
       .width_key = "intermediate_size"});
  return family;
}

// qwen3-moe-tiny is moe-tiny's Qwen3-MoE (per-head norms, experts narrower than the unused
// dense width); the others are the published shapes (config.json of Qwen/Qwen3-30B-A3B and
// Qwen3-235B-A22B: 30,532,122,624 and 235,093,634,560 parameters) with a window of 2048.
const ModelFamily& Qwen3Moe() {
  static const MoeFamily family(
      {.id = {"qwen3_moe", "Qwen3-MoE", "Qwen3MoeForCausalLM", "llama", kLlamaConfigNames},
       .presets = {{"qwen3-moe-tiny",
                    {.layers = 2, .heads = 4, .hidden = 64, .vocab_size = 256, .seq_len = 64,
                     .family = "qwen3_moe", .kv_heads = 2, .head_dim = 16, .intermediate = 96,
                     .max_positions = 256, .norm_eps = 1e-6, .rope_theta = 10000, .tied = false,
                     .experts = 4, .experts_per_token = 2, .moe_intermediate = 32, .norm_topk_prob = true}},
                   {"qwen3-30b-a3b", Qwen3MoeShape(48, 32, 2048, 6144, 768)},
                   {"qwen3-235b-a22b", Qwen3MoeShape(94, 64, 4096, 12288, 1536)}},
       .refuses_attention_bias = true,
       .use_sliding_window_key = true,
       .written = {{"attention_bias", false}, {"use_sliding_window", false}, {"sliding_window", nullptr}}},
      {.qwen = true,
       .experts_key = "num_experts",
       .sparse = "mlp.",
       .expert_names = {"gate_proj", "up_proj", "down_proj"},
       .width_key = "moe_intermediate_size"});
  return family;
}

}  // namespace meshtrain::api
