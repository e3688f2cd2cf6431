// The resolved shape of a ModelSpec, and the named presets with their published shapes.
// Which family a shape is of, and what that family means, is its description's
// (api/model_family.h): a shape names it, and asks it.
// Thread-safety: value types and pure functions.

#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "api/training_job.h"

namespace meshtrain::api {

class ModelFamily;

// The family of a spec or checkpoint that names none (meshtrain's first, GPT-2).
inline constexpr std::string_view kDefaultFamily = "gpt2";

// How RoPE's frequencies are rescaled for long contexts (Hugging Face's rope_scaling).
struct RopeScaling {
  std::string type;  // "": none; "linear": positions / factor; "llama3": Llama 3.1's frequency bands
  double factor = 1;
  double low_freq_factor = 1, high_freq_factor = 4;  // llama3 only
  int64_t original_max_positions = 8192;             // llama3 only
  bool operator==(const RopeScaling&) const = default;
};

struct ModelShape {
  int64_t layers = 0;
  int64_t heads = 0;  // query heads
  int64_t hidden = 0;
  int64_t vocab_size = 0;
  int64_t seq_len = 0;  // the training window
  std::string family{kDefaultFamily};  // spec.model.family: its description is Family()
  // The fields below take their family's value when 0 (Resolved): kv_heads = heads,
  // head_dim = hidden / heads (Qwen3: 128), intermediate = 4 x hidden, max_positions =
  // seq_len. The accessors below give those of every family but Qwen3's head_dim.
  int64_t kv_heads = 0;       // key and value heads (grouped-query attention)
  int64_t head_dim = 0;       // channels of each head
  int64_t intermediate = 0;   // the MLP's width
  int64_t max_positions = 0;  // GPT-2: rows of the position table; Llama: max_position_embeddings
  double norm_eps = 1e-5;     // LayerNorm's (GPT-2: always 1e-5) or RMSNorm's epsilon
  double rope_theta = 10000;  // RoPE's (GPT-2 has none)
  RopeScaling rope_scaling{};  // RoPE's (GPT-2 has none)
  bool tied = true;           // the LM head is the token embedding (GPT-2: always)
  // A mixture of experts' MLP (Mixtral, Qwen3-MoE; 0 experts: a dense MLP): `experts`
  // experts of `moe_intermediate` hidden units (Mixtral's are `intermediate` wide), each
  // token routed to `experts_per_token` of them, their weights renormalised to sum to 1
  // where norm_topk_prob (Mixtral always). Qwen3-MoE's decoder_sparse_step and
  // mlp_only_layers say which blocks are sparse (DenseBlock): the others have a dense MLP
  // of `intermediate` units.
  int64_t experts = 0;
  int64_t experts_per_token = 0;
  int64_t moe_intermediate = 0;
  bool norm_topk_prob = true;
  int64_t decoder_sparse_step = 1;
  std::vector<int64_t> mlp_only_layers{};

  // The description of `family`. Throws std::logic_error for a family there is none of
  // (validation names it to users first).
  const ModelFamily& Family() const;
  int64_t KvHeads() const { return kv_heads > 0 ? kv_heads : heads; }
  int64_t HeadDim() const { return head_dim > 0 ? head_dim : heads > 0 ? hidden / heads : 0; }
  int64_t Intermediate() const { return intermediate > 0 ? intermediate : 4 * hidden; }
  int64_t MaxPositions() const { return max_positions > 0 ? max_positions : seq_len; }
  int64_t QueryWidth() const { return heads * HeadDim(); }  // q's and attention's output channels
  // Whether block l of a mixture of experts has a dense MLP in place of its experts, as
  // transformers' Qwen3-MoE decides: l is in mlp_only_layers, or (l + 1) is not a multiple
  // of decoder_sparse_step. False for every block of a model without experts (its one kind).
  bool DenseBlock(int64_t l) const;
  // The blocks of [first, last) that DenseBlock; 0 for a model without experts.
  int64_t DenseBlocks(int64_t first, int64_t last) const;
  int64_t DenseBlocks() const { return DenseBlocks(0, layers); }
  int64_t KvWidth() const { return KvHeads() * HeadDim(); }  // k's and v's
  // This shape with every field that defaults to 0 given its value.
  ModelShape Resolved() const;

  // Trainable parameters: the sum of the family's tensors (model_family.h), a tied head
  // counted once. GPT-2 124M: 124,439,808.
  int64_t ParameterCount() const;
  // 6N + 12 L T Q: the matrix FLOPs of forward and backward per token of a sequence of
  // `seq` tokens, attention included (the numerator of MFU, as llm.c counts it), where N
  // counts every parameter that multiplies a token's activations (an untied embedding is a
  // lookup, not a product) and Q is the query width.
  double TrainingFlopsPerToken(int64_t seq) const;
  // Equal once resolved.
  bool operator==(const ModelShape& other) const;
  // The same weights, whatever the training window: equal but for seq_len, and for
  // max_positions where it sizes no weight (ModelFamily::LearnsPositions).
  bool SameWeights(const ModelShape& other) const;
};

// The preset called `name`, or nullptr if there is none.
const ModelShape* FindPreset(std::string_view name);

// The preset names, by family and size: gpt2-tiny, gpt2-124m, ..., llama-tiny, ...
// (each family's description lists its own).
std::vector<std::string_view> PresetNames();

// The shape of a spec whose defaults have been applied (every field its family needs set).
// REQUIRES: model.layers, heads, hidden, vocab_size and seq_len have values.
ModelShape ShapeOf(const ModelSpec& model);

// The spec.model fields that give `shape` (no preset): what a meshtrain command writes
// into a job for the operator, which cannot read a model directory.
ModelSpec SpecOfShape(const ModelShape& shape);

// "llama: layers 16, heads 32 (8 key/value), hidden 2048, MLP 8192, vocabSize 128256,
// seqLen 2048, ...", as spec.model names them: the fields of the shape's family.
std::string DescribeShape(const ModelShape& shape);

}  // namespace meshtrain::api
