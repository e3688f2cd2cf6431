// The Llama class's description (LlamaForCausalLM): pre-RMSNorm blocks of grouped-query
// attention with rotate-half RoPE on q and k, a SwiGLU MLP, no position table, a tied or
// untied LM head. Mistral (no sliding window) and Qwen2 (biases on q, k and v) are data
// on it; Qwen3 (qwen3.cc) derives from it. Its layers are worker/model/llama.cc.
// Thread-safety: immutable.

#pragma once

#include <optional>
#include <string>
#include <vector>

#include "api/families/families.h"

namespace meshtrain::api {

// config.json's names of the Llama class's sizes.
extern const ModelFamily::ConfigNames kLlamaConfigNames;

class LlamaFamily : public ModelFamily {
 public:
  // What tells the Llama class's members apart.
  struct Variant {
    Identity id;
    std::vector<Preset> presets;
    bool qkv_bias = false;  // biases on q, k and v (Qwen2)
    // config.json: attention_bias may only be false (LlamaConfig, MistralConfig, Qwen3Config)
    bool refuses_attention_bias = true;
    // config.json: use_sliding_window may only be false, and sliding_window is then unused
    // (Qwen2, Qwen3); otherwise a sliding_window is read and checked against the window.
    bool use_sliding_window_key = false;
    nlohmann::json written;  // keys config.json gets beside the class's
  };

  explicit LlamaFamily(Variant v) : ModelFamily(v.id), v_(std::move(v)) {}

  std::vector<Preset> Presets() const override { return v_.presets; }
  void Resolve(ModelShape* s) const override;
  void DefaultFromPreset(const ModelShape& preset, ModelSpec* m) const override;
  void Default(ModelSpec* m) const override;
  void Check(const ModelSpec& m, FieldChecker& c) const override;
  void SpecOf(const ModelShape& s, ModelSpec* m) const override;
  std::string Describe(const ModelShape& s) const override;
  bool LearnsPositions() const override { return false; }
  std::vector<std::pair<int64_t, std::string>> TensorParallelSplits(const ModelShape& s) const override;
  void ReadConfig(const nlohmann::json& j, const ConfigKeys& k, HuggingFaceConfig* c) const override;
  void WriteConfig(const ModelShape& s, nlohmann::json* j) const override;
  int64_t DefaultSeqLen(int64_t max_positions) const override;
  FamilyTensors Tensors(const ModelShape& s) const override;
  bool Ignored(std::string_view hf_name) const override;
  std::vector<Buffer> BlockActivationBuffers(int batch, int seq, const ModelShape& s, int tp_size,
                                             const EngineTypes& t) const override;
  std::vector<Buffer> BlockScratchBuffers(int batch, int seq, const ModelShape& s, int tp_size, const EngineTypes& t,
                                          bool dropout) const override;
  bool NormKeepsMean() const override { return false; }
  std::vector<Buffer> FamilyBuffers(int seq, const ModelShape& s, const EngineTypes& t) const override;
  std::vector<BlockProduct> BlockProducts(const ModelShape& s, int64_t layer) const override;

 protected:
  // The config.json keys that size a tensor of `kind`, for messages.
  std::string ConfigSizes(Param kind) const;
  // Channels of a head where spec.model or config.json leaves head_dim out: hidden /
  // heads where it divides (nullopt where it does not, or a size is missing).
  virtual std::optional<int64_t> DefaultHeadDim(std::optional<int64_t> hidden, std::optional<int64_t> heads) const;

 private:
  Variant v_;
};

}  // namespace meshtrain::api
