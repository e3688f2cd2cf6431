// A model family is one registered description (torchtitan's model spec): its presets,
// the defaults and checks of its spec.model fields, config.json in and out, its tensors
// with their Hugging Face names and tensor-parallel splits, the buffers its layers keep
// and share, and its FLOPs. The families are api/families/: gpt2.cc (GPT-2), llama.cc
// (Llama; Mistral and Qwen2 are data on it), qwen3.cc (Qwen3); families.cc lists them.
// Nothing outside those files asks which family a model is: the engine (worker/model,
// worker/parallel), checkpoints, Hugging Face files in and out, the memory model
// (api/engine_memory.h), the operator's step and memory models and `meshtrain plan` read
// the description. The worker computes a family with the layers its description names
// (ModelFamily::layers, worker/model/model.h).
//
// A model is three kinds of FSDP unit (worker/parallel/flat_unit.h), in this order in
// the model's flat buffer:
//   the embedding unit   the token embedding; GPT-2's position table; and, when the head
//                        is tied to the embedding, the final norm too (the head's unit)
//   one unit per block   the block's tensors, the same in every block (a mixture of
//                        experts with dense blocks: the same in every block of a kind,
//                        the two kinds' attention tensors at the same offsets)
//   the head unit        the final norm and the LM head, when the head is untied
// Each tensor says how tensor parallelism splits it:
//   kVocab       rows: the vocabulary, in T slices that need not be equal (VocabBegin),
//                each padded to a multiple of the engine's vocab_multiple
//   kRows        dim 0 in T equal slices (column-parallel products: heads, MLP units)
//   kQkvRows     GPT-2's fused q, k and v: dim 0 in three parts, each in T equal slices
//   kColumns     dim 1 in T equal slices (row-parallel products)
//   kReplicated  whole on every rank (norms, the row-parallel products' biases, GPT-2's
//                position table)
// A Llama-class block keeps q, k and v (and their biases) as three tensors in a row, so
// that this rank's slices of them are one (q + 2 kv, C) matrix; gate and up likewise.
// Thread-safety: descriptions are immutable singletons; everything here is pure.

#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "api/field_checker.h"
#include "api/model_shape.h"

namespace meshtrain::api {

// Every tensor kind of every family.
enum class Param {
  // GPT-2
  kWte, kWpe, kLnfW, kLnfB,
  kLn1W, kLn1B, kQkvW, kQkvB, kAttProjW, kAttProjB, kLn2W, kLn2B, kFcW, kFcB, kFcProjW, kFcProjB,
  // Llama-class
  kEmbed, kNorm, kLmHead,
  kAttnNorm, kWq, kWk, kWv, kBq, kBk, kBv, kWo, kMlpNorm, kWGate, kWUp, kWDown,
  // Per-head RMSNorm of q and k (Qwen3)
  kQNorm, kKNorm,
  // A mixture of experts' MLP (Mixtral, Qwen3-MoE): the router (E,C), and each expert's
  // gate and up (I,C) in turn, then every expert's down (C,I), so that a block holds the
  // experts' gate and up as one (E,2I,C) stack and their downs as one (E,C,I)
  kRouter, kExpertGate, kExpertUp, kExpertDown,
};

enum class TpSplit { kReplicated, kVocab, kRows, kQkvRows, kColumns };

// How the seeded initialisation fills a tensor: normal(0, 0.02); GPT-2's residual
// projections normal(0, 0.02 / sqrt(2 x layers)); norm weights 1; biases 0.
enum class Init { kNormal, kResidual, kOnes, kZeros };

struct TensorInfo {
  Param kind;
  std::string name;            // ours: "wte", "qkv.w" (a block's without its "h<l>." prefix)
  std::vector<int64_t> shape;  // the whole tensor's, the user's vocabulary
  TpSplit split = TpSplit::kReplicated;
  bool decay = false;          // AdamW's weight decay: every matrix, embeddings and heads included
  Init init = Init::kNormal;
  std::string hf_name;         // Hugging Face's name; "{l}" stands for the block's index
  bool hf_transposed = false;  // Hugging Face stores it (in, out): GPT-2's Conv1D
  std::string hf_sizes{};      // the config.json keys that size it, as Hugging Face stores it ("" unsaid)
};

struct FamilyTensors {
  std::vector<TensorInfo> embedding, block, head;  // head empty: the embedding unit holds the head
  // A mixture of experts' dense blocks (ModelShape::DenseBlock): attention as in `block`,
  // then a dense MLP in place of the router and experts. Empty where every block is `block`.
  std::vector<TensorInfo> dense_block;
  // The tensors of block l.
  const std::vector<TensorInfo>& Block(const ModelShape& shape, int64_t l) const {
    return !dense_block.empty() && shape.DenseBlock(l) ? dense_block : block;
  }
};

// The tensors of `shape`'s family, unit by unit.
FamilyTensors TensorsOf(const ModelShape& shape);

// The Hugging Face name of `t` in block `layer` (-1 outside blocks).
std::string HuggingFaceName(const TensorInfo& t, int layer);
// Whether a tensor of a Hugging Face file that this family does not train may be left
// out on import: a tied model's copy of the embedding as lm_head.weight, and what the
// family names (GPT-2's attention-mask buffers, RoPE's cached frequencies).
bool IgnoredOnImport(const ModelShape& shape, std::string_view hf_name);

// What the engine's precision and kernels make of each size.
struct EngineTypes {
  int act_bytes = 4;  // activations and compute copies of parameters: 4 fp32, 2 bf16, 8 fp64
  int acc_bytes = 4;  // gradients, master weights, AdamW state, statistics: 4, or 8 in fp64
  // The CPU's attention keeps the (B,NH,T,T) probabilities of each block for its backward;
  // fused (flash) attention keeps one statistic per row, (B,NH,T).
  bool attention_keeps_scores = true;
  int64_t attention_scratch_bytes = 0;  // the attention backward's workspace (the kernel table says)
  int vocab_multiple = 128;             // kVocabMultiple: each TP slice of the vocabulary is padded to it
  // Context parallelism (api/layout.h): the ranks that split each sequence. Ring
  // attention keeps one softmax statistic per row whatever the kernels, and works in
  // RingAttentionBuffers; all-to-all (Ulysses) attention keeps UlyssesAttentionBuffers'
  // kept part as its state and works in the rest. Either's scratch is
  // attention_scratch_bytes (ContextAttentionScratchBytes).
  int context = 1;
  bool context_all_to_all = false;  // with context > 1: Ulysses rather than the ring
  // Expert parallelism (api/layout.h): the ranks of an expert group. Dropless dispatch
  // may send every token of the group to one rank's experts, so the rows its experts work
  // on are sized for that: expert x the local tokens' copies.
  int experts = 1;
  // Float8 training (spec.training.precision fp8): the floats of its amaxes and scales in
  // the step buffer (Float8ScratchElements), and the bytes the kernel table keeps for its
  // largest float8 product (on a GPU, Float8KernelScratchBytes: Float8ProductBytes over
  // Float8LinearProducts, each with its own sums; 0 on the CPU); 0 without.
  int64_t float8_scales = 0;
  int64_t float8_product_bytes = 0;
};


// One buffer of a carving (api/engine_memory.h): its name, elements and element size.
struct Buffer {
  std::string_view name;
  int64_t elements = 0;
  int element_bytes = 0;
};

// The buffers ring attention carves out of a block's attention scratch for micro-batches
// of batch x seq rows a rank (seq: this rank's rows), in order: the forward's ("kv" and
// "kv_next": the circulating key/value blocks, (batch,seq,2 KV) Act each; "out" and
// "block_out": the merged output and one block's, (batch,seq,Q) Acc; "block_lse":
// (batch,NH,seq) Acc) or the backward's ("kv", "kv_next"; "dkv" and "dkv_next": their
// gradients, (batch,seq,2 KV) Acc each; "dq" (batch,seq,Q) Acc; "D" (batch,NH,seq) Acc;
// "cast": (batch,seq,max(Q, 2 KV)) Act). Q, KV and NH are this TP rank's.
std::vector<Buffer> RingAttentionBuffers(int batch, int seq, const ModelShape& shape, int tp_size,
                                         const EngineTypes& types, bool backward);

// The buffers all-to-all (Ulysses) attention uses for micro-batches of batch x seq rows a
// rank (seq: this rank's rows; S = seq x C, the whole sequence; W = Q + 2 KV, this TP
// rank's q, k and v widths), in order:
//   kKept, what the forward keeps for the backward (the attention state): "qkv" the
//     head-split q, k and v, (batch,S,W/C) Act; "out" the head-split output,
//     (batch,S,Q/C) Act; "state" the kernel table's AttentionForward state for
//     (batch,S,NH/C heads), Acc;
//   kForward: "send" and "recv", (batch,seq,W) Act each; "attention", the scratch of the
//     attention it runs (document attention's; the table's causal forward takes none),
//     kernel_scratch_bytes;
//   kBackward: "send", "recv"; "dout", (batch,S,Q/C) Act; "dqkv", (batch,S,W/C) Act;
//     "attention", the scratch of the attention backward it runs, kernel_scratch_bytes.
enum class UlyssesPart { kKept, kForward, kBackward };
std::vector<Buffer> UlyssesAttentionBuffers(int batch, int seq, const ModelShape& shape, int tp_size,
                                            const EngineTypes& types, UlyssesPart part,
                                            int64_t kernel_scratch_bytes = 0);
// The attention scratch of a context group (types.context > 1) for micro-batches of
// batch x seq rows a rank: the larger of its forward's and its backward's buffers, ring
// or all-to-all as types says. types.attention_scratch_bytes is read as the scratch of
// the attention the mode runs on the shape it runs it (all-to-all: the table's
// AttentionBackward, or document attention, on (batch, seq x C, NH/C, KVH/C)); the
// ring's block kernels need none.
int64_t ContextAttentionScratchBytes(int batch, int seq, const ModelShape& shape, int tp_size,
                                     const EngineTypes& types);

// What one block's forward keeps for its backward, in carving order, for micro-batches
// of up to batch x seq on a TP slice of `tp_size`; "output" (the block's output, the next
// block's input) is last.
std::vector<Buffer> BlockActivationBuffers(int batch, int seq, const ModelShape& shape, int tp_size,
                                           const EngineTypes& types);
// The backward's working set, shared by the blocks: "dresidual" (the residual stream's
// gradient) first, then the gradients inside a block, a projection's output, with dropout
// a masked gradient and attention's output after dropout, and attention's scratch.
std::vector<Buffer> BlockScratchBuffers(int batch, int seq, const ModelShape& shape, int tp_size,
                                        const EngineTypes& types, bool dropout);
// The head's: the final norm's output and statistics, the losses, one chunk of logits
// and of the norm's gradient, and with TP the chunk's softmax statistics of this slice
// and of all.
std::vector<Buffer> HeadBuffers(int batch, int seq, const ModelShape& shape, int tp_rank, int tp_size,
                                const EngineTypes& types);

// The rows of the LM head computed at once, of `rows` rows against `padded_vocab`
// columns: B x T x V logits never exist, a chunk of at most 2^27 does.
int64_t HeadChunkRows(int64_t rows, int64_t padded_vocab);

// What a block's linear layer asks of its products beyond D = A^T B (the model's
// LinearForward and LinearBackward, worker/model/layers.h): its forward adds a bias (a
// row-parallel layer's on TP rank 0 only), adds the residual stream (a projection into it,
// where one TP rank and no dropout leave nothing between the two), or writes GELU of its
// output beside it (GPT-2's fc); its input gradient applies GELU's backward (its input is
// that GELU: GPT-2's fc projection).
struct LinearEpilogue {
  bool bias = false, residual = false, gelu = false, gelu_input = false;
};
// The two rules by which a block runs an epilogue (worker/model's blocks, and
// Float8LinearProducts, which sizes for them): a projection adds the residual stream where
// one TP rank and no dropout leave nothing between the two; a product adds its bias on
// every TP rank but a row-parallel (kColumns) one's, which TP rank 0 alone adds, as the
// all-reduce after it then counts it once.
inline bool ProjectsIntoResidual(int tp_size, bool dropout) { return tp_size == 1 && !dropout; }
inline bool AddsBias(TpSplit split, int tp_rank) { return split != TpSplit::kColumns || tp_rank == 0; }

// A product of a block's forward as the engine runs it: (tokens x k) by (k x n), q, k and
// v as one product, gate and up as one, a mixture's experts as the k a token meets.
// `weight`: its weight's tensor kind (q's for q, k and v; gate's for gate and up).
// `split`: how tensor parallelism splits it: kRows, column-parallel, n in T slices (heads,
// MLP units); kColumns, row-parallel, k in T slices (the projections back to hidden);
// kReplicated, whole on every rank (a router). `float8`: float8 training (docs/design.md,
// "Float8") multiplies it in float8: a block's linear layers, not a mixture's router or
// experts; `epilogue` is what its float8 products add (Float8LinearProducts).
struct BlockProduct {
  int64_t k = 0, n = 0;
  Param weight = Param::kQkvW;
  TpSplit split = TpSplit::kReplicated;
  bool float8 = false;
  LinearEpilogue epilogue{};
};
// The products of block `layer` (a mixture's dense blocks have a dense MLP's).
std::vector<BlockProduct> BlockProducts(const ModelShape& shape, int64_t layer);
// Those of every kind of block the model has, each weight once: a mixture with dense
// blocks adds the dense MLP's to its sparse blocks' products.
std::vector<BlockProduct> EveryBlockProduct(const ModelShape& shape);

// The matrix FLOPs of block `layer`'s forward per token at a sequence of `seq` tokens on a
// TP slice of `tp_size`: 2 per weight of its products (a mixture's experts: the k a token
// meets), and 4 x seq x the query width for attention's two products (counted whole, as
// llm.c counts them). Without `layer`, the mean over the model's blocks.
double BlockForwardFlopsPerToken(const ModelShape& shape, int64_t seq, int tp_size, int64_t layer);
double BlockForwardFlopsPerToken(const ModelShape& shape, int64_t seq, int tp_size);
// The part of it that float8 training multiplies in float8 (docs/design.md, "Float8"): 2
// per weight of the block's products that are BlockProduct::float8.
double BlockFloat8FlopsPerToken(const ModelShape& shape, int tp_size, int64_t layer);
double BlockFloat8FlopsPerToken(const ModelShape& shape, int tp_size);
// The first block of a mixture's dense kind (`dense`: ModelShape::DenseBlock) or of the
// other (the sparse blocks, or a model's one kind); `shape.layers` where there is none.
int64_t FirstBlockOfKind(const ModelShape& shape, bool dense);


// The buffers the family's layers share across blocks, for sequences of up to `seq`
// tokens, in carving order (the step buffer's last, api::StepBuffers): the Llama class's
// RoPE table ("rope": cos, then sin, each (seq, head_dim / 2)); none for GPT-2. The
// worker's model fills them (model::Model::FamilyBufferValues).
std::vector<Buffer> FamilyBuffers(int seq, const ModelShape& shape, const EngineTypes& types);

struct HuggingFaceConfig;
class ConfigKeys;

// One family's description. Each is a singleton of api/families/, found by FindFamily.
class ModelFamily {
 public:
  // config.json's names for the sizes every family has, for messages.
  struct ConfigNames {
    const char* layers;
    const char* heads;
    const char* hidden;
    const char* max_positions;
  };
  struct Identity {
    std::string_view name;          // spec.model.family: "gpt2", "llama", ...
    std::string_view title;         // "GPT-2": for messages
    std::string_view architecture;  // config.json's architectures[0]: "GPT2LMHeadModel"
    std::string_view layers;        // the worker's layers that compute it (model::MakeModel)
    ConfigNames config;
  };
  struct Preset {
    std::string_view name;
    ModelShape shape;
  };

  explicit ModelFamily(const Identity& id) : id_(id) {}
  virtual ~ModelFamily() = default;
  ModelFamily(const ModelFamily&) = delete;
  ModelFamily& operator=(const ModelFamily&) = delete;

  std::string_view name() const { return id_.name; }
  std::string_view title() const { return id_.title; }
  std::string_view architecture() const { return id_.architecture; }
  std::string_view layers() const { return id_.layers; }
  const ConfigNames& config_names() const { return id_.config; }

  // The family's presets, with their published shapes.
  virtual std::vector<Preset> Presets() const = 0;

  // Args. Resolve gives every field of `s` that is 0 its family value and clears what the
  // family has none of (ModelShape::Resolved runs it first).
  virtual void Resolve(ModelShape* s) const = 0;
  // The spec.model fields a preset of this family gives where the job left them unset,
  // beyond layers, heads, hidden, vocabSize, seqLen and family.
  virtual void DefaultFromPreset(const ModelShape& preset, ModelSpec* m) const = 0;
  // The spec.model fields the family derives from the others.
  virtual void Default(ModelSpec* m) const = 0;
  // The family's own rules for spec.model (the sizes every family has are checked before).
  virtual void Check(const ModelSpec& m, FieldChecker& c) const = 0;
  // The spec.model fields that give `s`, beyond the ones every family has (SpecOfShape).
  virtual void SpecOf(const ModelShape& s, ModelSpec* m) const = 0;
  // DescribeShape's text after "family: ".
  virtual std::string Describe(const ModelShape& s) const = 0;
  // Whether its MLP is a mixture of experts (ModelShape::experts and the fields after it);
  // a family without takes none of spec.model's expert fields.
  virtual bool HasExperts() const { return false; }
  // For a mixture of experts, the dense model of the same active parameters (what its
  // speed is measured against: `meshtrain bench train`): the same attention and an MLP as
  // wide as the k experts a token meets, in the dense family of its class; nullopt for a
  // dense family.
  virtual std::optional<ModelShape> DenseOfSameActive(const ModelShape&) const { return std::nullopt; }
  // Whether max_positions sizes a weight (GPT-2's position table); else two shapes that
  // differ only in it have the same weights.
  virtual bool LearnsPositions() const = 0;
  // The sizes that tensor parallelism splits in equal slices, each with what the message
  // calls it: heads, key/value heads, the MLP's width.
  virtual std::vector<std::pair<int64_t, std::string>> TensorParallelSplits(const ModelShape& s) const = 0;

  // config.json. ReadConfig fills c->model (but its family and seqLen) from `j`, refusing a
  // key whose value would change the math without meshtrain doing so, by name; WriteConfig
  // adds the family's keys to the ones every family has (HuggingFaceConfigJson).
  virtual void ReadConfig(const nlohmann::json& j, const ConfigKeys& k, HuggingFaceConfig* c) const = 0;
  virtual void WriteConfig(const ModelShape& s, nlohmann::json* j) const = 0;
  // A job without seqLen trains windows of this many tokens.
  virtual int64_t DefaultSeqLen(int64_t max_positions) const = 0;

  // Tensors and their Hugging Face names.
  virtual FamilyTensors Tensors(const ModelShape& s) const = 0;
  // Tensors of a Hugging Face file the family does not train (IgnoredOnImport).
  virtual bool Ignored(std::string_view hf_name) const = 0;
  // A prefix of Hugging Face names that is taken off on import ("transformer." for
  // GPT2LMHeadModel's body), or "".
  virtual std::string_view BodyPrefix() const { return ""; }
  // The family's one-file form, where it has one (GPT-2's): a lone F32 safetensors file
  // without config.json, which `meshtrain export` writes to a path ending in .safetensors
  // and a path to a file reads. ShapeOfSingleFile gives the shape that such a file's
  // tensors (Hugging Face name -> sizes) imply, with heads of head_dim channels; nullopt
  // when they are not this family's; std::invalid_argument naming the tensor or size at
  // fault when they are this family's but do not make a model.
  virtual bool HasSingleFileForm() const { return false; }
  virtual std::optional<ModelShape> ShapeOfSingleFile(const std::map<std::string, std::vector<int64_t>>& tensors,
                                                      int64_t head_dim) const;

  // Memory and FLOPs (the free functions above).
  virtual std::vector<Buffer> BlockActivationBuffers(int batch, int seq, const ModelShape& s, int tp_size,
                                                     const EngineTypes& t) const = 0;
  virtual std::vector<Buffer> BlockScratchBuffers(int batch, int seq, const ModelShape& s, int tp_size,
                                                  const EngineTypes& t, bool dropout) const = 0;
  // Whether the final norm keeps a mean (LayerNorm) beside its statistics (RMSNorm keeps none).
  virtual bool NormKeepsMean() const = 0;
  virtual std::vector<Buffer> FamilyBuffers(int seq, const ModelShape& s, const EngineTypes& t) const = 0;
  // The products of block `layer` (api::BlockProducts).
  virtual std::vector<BlockProduct> BlockProducts(const ModelShape& s, int64_t layer) const = 0;

 private:
  Identity id_;
};

// Whether `tp` divides every size that tensor parallelism splits in equal slices
// (ModelFamily::TensorParallelSplits: heads, key/value heads, the MLP's width, for a
// mixture of experts the experts' width), as the engine's ParameterLayout requires.
bool TensorParallelDivides(const ModelShape& shape, int64_t tp);

// The family called `name` (spec.model.family), or of config.json's `architecture`; null
// if there is none.
const ModelFamily* FindFamily(std::string_view name);
const ModelFamily* FindFamilyOfArchitecture(std::string_view architecture);
// Every family, in the order they are listed to users.
const std::vector<const ModelFamily*>& Families();
// The shape of a one-file model (ModelFamily::ShapeOfSingleFile) by the first family that
// knows its tensors; std::invalid_argument when none does, or the family's own error.
ModelShape ShapeOfSingleFile(const std::map<std::string, std::vector<int64_t>>& tensors, int64_t head_dim);
// "gpt2, llama, ..." or, with `architectures`, "GPT2LMHeadModel, ...".
std::string FamilyList(bool architectures = false);

}  // namespace meshtrain::api
