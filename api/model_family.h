// One description of each model family (api/model_shape.h): the only place that knows a
// family's layout. The engine (worker/model, worker/parallel), checkpoints, Hugging Face
// files in and out, the memory model (api/engine_memory.h), the operator's step and
// memory models and `meshtrain plan` all read it.
//
// A model is three kinds of FSDP unit (worker/parallel/flat_unit.h), in this order in
// the model's flat buffer:
//   the embedding unit   the token embedding; GPT-2's position table; and, when the head
//                        is tied to the embedding, the final norm too (the head's unit)
//   one unit per block   the block's tensors, the same in every block
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
// Thread-safety: pure functions.

#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

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
};

struct FamilyTensors {
  std::vector<TensorInfo> embedding, block, head;  // head empty: the embedding unit holds the head
};

// The tensors of `shape`'s family, unit by unit.
FamilyTensors TensorsOf(const ModelShape& shape);

// The Hugging Face name of `t` in block `layer` (-1 outside blocks).
std::string HuggingFaceName(const TensorInfo& t, int layer);
// Whether a tensor of a Hugging Face file that this family does not train may be left
// out on import: GPT-2's attention-mask buffers, RoPE's cached frequencies, and a tied
// model's copy of the embedding as lm_head.weight.
bool IgnoredOnImport(const ModelShape& shape, std::string_view hf_name);
// The names GPT-2 takes with a "transformer." prefix too (GPT2LMHeadModel's body).
inline constexpr std::string_view kGpt2BodyPrefix = "transformer.";

// What the engine's precision and kernels make of each size.
struct EngineTypes {
  int act_bytes = 4;  // activations and compute copies of parameters: 4 fp32, 2 bf16, 8 fp64
  int acc_bytes = 4;  // gradients, master weights, AdamW state, statistics: 4, or 8 in fp64
  // The CPU's attention keeps the (B,NH,T,T) probabilities of each block for its backward;
  // fused (flash) attention keeps one statistic per row, (B,NH,T).
  bool attention_keeps_scores = true;
  int64_t attention_scratch_bytes = 0;  // the attention backward's workspace (the kernel table says)
  int vocab_multiple = 128;             // kVocabMultiple: each TP slice of the vocabulary is padded to it
};

// One buffer of a carving (api/engine_memory.h): its name, elements and element size.
struct Buffer {
  std::string_view name;
  int64_t elements = 0;
  int element_bytes = 0;
};

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

// A product of a block's forward as the engine runs it: (tokens x k) by (k x n), q, k and
// v as one product, gate and up as one.
struct BlockProduct {
  int64_t k = 0, n = 0;
};
std::vector<BlockProduct> BlockProducts(const ModelShape& shape);

// The matrix FLOPs of one block's forward per token, at a sequence of `seq` tokens on a
// TP slice of `tp_size`: 2 per weight of its products, and 4 x seq x the query width for
// attention's two products (counted whole, as llm.c counts them).
double BlockForwardFlopsPerToken(const ModelShape& shape, int64_t seq, int tp_size);

}  // namespace meshtrain::api
