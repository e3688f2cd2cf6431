// Qwen3 (Qwen3ForCausalLM, dense): the Llama class with an RMSNorm over each head of q
// and of k (q_norm and k_norm, of head_dim channels, shared by the heads) before RoPE,
// and head_dim given explicitly, 128 where config.json or spec.model leaves it out, so
// that heads x head_dim may differ from hidden. Its layers are the Llama class's, which
// norm the heads where a block holds q_norm and k_norm (worker/model/llama.cc).

#include "api/families/llama.h"
#include "api/hf_config_keys.h"

namespace meshtrain::api {
namespace {

using Json = nlohmann::json;

constexpr int64_t kQwen3HeadDim = 128;

class Qwen3Family final : public LlamaFamily {
 public:
  Qwen3Family()
      : LlamaFamily({
            .id = {"qwen3", "Qwen3", "Qwen3ForCausalLM", "llama",
                   kLlamaConfigNames},
            // The published shapes (Qwen/Qwen3-*'s config.json), with a window of 2048.
            .presets =
                {
                    {"qwen3-0.6b",
                     {.layers = 28, .heads = 16, .hidden = 1024, .vocab_size = 151936, .seq_len = 2048,
                      .family = "qwen3", .kv_heads = 8, .head_dim = 128, .intermediate = 3072,
                      .max_positions = 40960, .norm_eps = 1e-6, .rope_theta = 1000000, .tied = true}},
                    {"qwen3-8b",
                     {.layers = 36, .heads = 32, .hidden = 4096, .vocab_size = 151936, .seq_len = 2048,
                      .family = "qwen3", .kv_heads = 8, .head_dim = 128, .intermediate = 12288,
                      .max_positions = 40960, .norm_eps = 1e-6, .rope_theta = 1000000, .tied = false}},
                    {"qwen3-32b",
                     {.layers = 64, .heads = 64, .hidden = 5120, .vocab_size = 151936, .seq_len = 2048,
                      .family = "qwen3", .kv_heads = 8, .head_dim = 128, .intermediate = 25600,
                      .max_positions = 40960, .norm_eps = 1e-6, .rope_theta = 1000000, .tied = false}},
                },
            .qkv_bias = false,
            .refuses_attention_bias = true,
            .use_sliding_window_key = true,
            .written = {{"attention_bias", false}, {"use_sliding_window", false}, {"sliding_window", nullptr}},
        }) {}

  void ReadConfig(const Json& j, const ConfigKeys& k, HuggingFaceConfig* c) const override {
    LlamaFamily::ReadConfig(j, k, c);
    RefuseSlidingLayers(j, k);
  }

  FamilyTensors Tensors(const ModelShape& s) const override {
    FamilyTensors f = LlamaFamily::Tensors(s);
    const int64_t D = s.HeadDim();
    const std::string at = "model.layers.{l}.self_attn.";
    size_t after_v = 0;
    while (f.block[after_v].kind != Param::kWv) ++after_v;
    f.block.insert(f.block.begin() + long(after_v) + 1,
                   {{Param::kQNorm, "q_norm", {D}, TpSplit::kReplicated, false, Init::kOnes, at + "q_norm.weight",
                     false, "head_dim"},
                    {Param::kKNorm, "k_norm", {D}, TpSplit::kReplicated, false, Init::kOnes, at + "k_norm.weight",
                     false, "head_dim"}});
    return f;
  }

  // Beside the class's: q and k before their norms, and each head's statistic.
  std::vector<Buffer> BlockActivationBuffers(int batch, int seq, const ModelShape& s, int tp_size,
                                             const EngineTypes& t) const override {
    std::vector<Buffer> b = LlamaFamily::BlockActivationBuffers(batch, seq, s, tp_size, t);
    const int64_t N = int64_t(batch) * seq, heads = (s.heads + s.KvHeads()) / tp_size;
    b.insert(b.end() - 1, {{"qk_raw", N * heads * s.HeadDim(), t.act_bytes}, {"qk_rstd", N * heads, t.acc_bytes}});
    return b;
  }

  // Beside the class's: q_norm's and k_norm's gradients from this rank's heads, and with TP
  // the group's, added in rank order.
  std::vector<Buffer> BlockScratchBuffers(int batch, int seq, const ModelShape& s, int tp_size, const EngineTypes& t,
                                          bool dropout) const override {
    std::vector<Buffer> b = LlamaFamily::BlockScratchBuffers(batch, seq, s, tp_size, t, dropout);
    b.push_back({"dhead_norms", 2 * s.HeadDim(), t.acc_bytes});
    if (tp_size > 1) b.push_back({"all_head_norms", tp_size * 2 * s.HeadDim(), t.acc_bytes});
    return b;
  }

 protected:
  std::optional<int64_t> DefaultHeadDim(std::optional<int64_t>, std::optional<int64_t>) const override {
    return kQwen3HeadDim;
  }
};

}  // namespace

const ModelFamily& Qwen3() {
  static const Qwen3Family family;
  return family;
}

}  // namespace meshtrain::api
