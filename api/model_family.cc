#include "api/model_family.h"

#include <algorithm>
#include <regex>

#include "api/engine_memory.h"

namespace meshtrain::api {
namespace {

using enum TpSplit;

FamilyTensors Gpt2Tensors(const ModelShape& s) {
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

FamilyTensors LlamaTensors(const ModelShape& s) {
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
  if (s.QkvBias()) {
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
  return f;
}

// Adds up buffers in carving order.
struct Buffers {
  std::vector<Buffer> list;
  void Add(std::string_view name, int64_t elements, int element_bytes) {
    list.push_back({name, elements, element_bytes});
  }
};

}  // namespace

FamilyTensors TensorsOf(const ModelShape& shape) {
  return shape.llama() ? LlamaTensors(shape) : Gpt2Tensors(shape);
}

std::string HuggingFaceName(const TensorInfo& t, int layer) {
  std::string name = t.hf_name;
  if (const size_t at = name.find("{l}"); at != std::string::npos) name.replace(at, 3, std::to_string(layer));
  return name;
}

bool IgnoredOnImport(const ModelShape& shape, std::string_view hf_name) {
  static const std::regex gpt2(R"((transformer\.)?h\.\d+\.attn\.(masked_)?bias)");
  static const std::regex llama(R"(model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq)");
  const std::string name(hf_name);
  if (shape.tied && name == "lm_head.weight") return true;
  return std::regex_match(name, shape.llama() ? llama : gpt2);
}

int64_t HeadChunkRows(int64_t rows, int64_t padded_vocab) {
  constexpr int64_t kChunkElements = int64_t(1) << 27;
  if (padded_vocab <= 0) return rows;
  return std::min(rows, std::max<int64_t>(1, kChunkElements / padded_vocab));
}

std::vector<Buffer> BlockActivationBuffers(int batch, int seq, const ModelShape& s, int tp_size,
                                           const EngineTypes& t) {
  const int64_t N = int64_t(batch) * seq, C = s.hidden, heads = s.heads / tp_size;
  const int64_t Q = s.QueryWidth() / tp_size, KV = s.KvWidth() / tp_size, H = s.Intermediate() / tp_size;
  const int A = t.act_bytes, G = t.acc_bytes;
  const int64_t state = t.attention_keeps_scores ? int64_t(batch) * heads * seq * seq : int64_t(batch) * heads * seq;
  Buffers b;
  if (!s.llama()) {
    b.Add("ln1", N * C, A);
    b.Add("ln1_mean", N, G);
    b.Add("ln1_rstd", N, G);
    b.Add("qkv", N * 3 * Q, A);
    b.Add("atty", N * Q, A);
    b.Add("att_state", state, G);
    b.Add("residual2", N * C, A);
    b.Add("ln2", N * C, A);
    b.Add("ln2_mean", N, G);
    b.Add("ln2_rstd", N, G);
    b.Add("fch", N * H, A);       // the MLP's pre-activation
    b.Add("fch_gelu", N * H, A);  // its GELU
  } else {
    b.Add("attn_norm", N * C, A);
    b.Add("attn_rstd", N, G);
    b.Add("qkv", N * (Q + 2 * KV), A);  // q and k after RoPE
    b.Add("atty", N * Q, A);
    b.Add("att_state", state, G);
    b.Add("residual2", N * C, A);
    b.Add("mlp_norm", N * C, A);
    b.Add("mlp_rstd", N, G);
    b.Add("gate_up", N * 2 * H, A);  // this rank's gate, then its up
    b.Add("swiglu", N * H, A);       // silu(gate) * up
  }
  b.Add("output", N * C, A);
  return b.list;
}

std::vector<Buffer> BlockScratchBuffers(int batch, int seq, const ModelShape& s, int tp_size, const EngineTypes& t,
                                        bool dropout) {
  const int64_t N = int64_t(batch) * seq, C = s.hidden;
  const int64_t Q = s.QueryWidth() / tp_size, KV = s.KvWidth() / tp_size, H = s.Intermediate() / tp_size;
  const int A = t.act_bytes;
  Buffers b;
  b.Add("dresidual", N * C, A);  // the residual stream's gradient
  b.Add("proj", N * C, A);       // a projection's output, before its residual add
  b.Add("dln", N * C, A);        // a norm's output gradient
  if (!s.llama()) {
    b.Add("dfch", N * H, A);  // the MLP's
  } else {
    b.Add("dswiglu", N * H, A);      // the SwiGLU output's
    b.Add("dgate_up", N * 2 * H, A);  // gate's and up's
  }
  b.Add("datty", N * Q, A);  // attention's output gradient
  b.Add("dqkv", N * (Q + 2 * KV), A);
  if (dropout) {
    b.Add("dmasked", N * C, A);  // a masked residual gradient
    b.Add("dropped", N * Q, A);  // attention's output after dropout (the forward keeps it before)
  }
  b.Add("attention", t.attention_scratch_bytes, 1);
  return b.list;
}

std::vector<Buffer> HeadBuffers(int batch, int seq, const ModelShape& s, int tp_rank, int tp_size,
                                const EngineTypes& t) {
  const int64_t N = int64_t(batch) * seq, C = s.hidden;
  const int64_t Vp = PaddedVocabRows(VocabSlice(s.vocab_size, tp_rank, tp_size), t.vocab_multiple);
  const int64_t R = HeadChunkRows(N, Vp);
  const int A = t.act_bytes, G = t.acc_bytes;
  Buffers b;
  b.Add("lnf", N * C, A);
  if (!s.llama()) b.Add("lnf_mean", N, G);  // RMSNorm keeps no mean
  b.Add("lnf_rstd", N, G);
  b.Add("losses", N, G);
  b.Add("logits", R * Vp, A);  // a chunk of logits (and, in place, their gradient)
  b.Add("dlnf", R * C, A);     // the chunk's gradient of the final norm's output
  if (tp_size > 1) {
    b.Add("stats", R * 3, G);              // this slice's softmax statistics
    b.Add("all_stats", tp_size * R * 3, G);  // every slice's
  }
  return b.list;
}

std::vector<BlockProduct> BlockProducts(const ModelShape& shape) {
  const ModelShape s = shape.Resolved();
  const int64_t C = s.hidden, Q = s.QueryWidth(), KV = s.KvWidth(), I = s.intermediate;
  if (!s.llama()) return {{C, 3 * C}, {C, C}, {C, I}, {I, C}};
  return {{C, Q + 2 * KV}, {Q, C}, {C, 2 * I}, {I, C}};
}

double BlockForwardFlopsPerToken(const ModelShape& s, int64_t seq, int tp_size) {
  double weights = 0;
  for (const TensorInfo& t : TensorsOf(s).block) {
    if (t.shape.size() == 2) weights += double(t.shape[0]) * double(t.shape[1]);
  }
  return (2 * weights + 4.0 * double(seq) * double(s.QueryWidth())) / tp_size;
}

}  // namespace meshtrain::api
