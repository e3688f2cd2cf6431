// What the sharded engine allocates, as pure functions of the model's shape, the layout
// and the engine's element types. The engine sizes its buffers with these functions (its
// carvers check themselves against them), and the planner's memory model
// (operator/scheduler/memory_model.h) adds them up, so that the two cannot drift.
//
// Every buffer of a step is allocated when the engine is built, each as one allocation of
// the caching allocator (rounded by AllocatorBlockBytes); buffers carved out of one
// allocation start at multiples of kCarveAlignment bytes. Counts are in elements unless a
// name says bytes. Thread-safety: pure functions.

#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "api/model_family.h"
#include "api/model_shape.h"

namespace meshtrain::api {

// How the engine keeps what a block's forward leaves for its backward
// (spec.parallelism.activationCheckpointing, activationOffloading, activationLoadingHorizon).
struct ActivationPolicy {
  bool checkpointing = false;
  bool offload = false;  // requires checkpointing
  int horizon = 2;       // blocks loaded ahead of the backward; at least 1
  bool operator==(const ActivationPolicy&) const = default;
};

// Every buffer carved out of one allocation starts at a multiple of this many bytes (the
// alignment GPU libraries want of their operands).
inline constexpr int64_t kCarveAlignment = 256;
inline int64_t Aligned(int64_t bytes) { return (bytes + kCarveAlignment - 1) / kCarveAlignment * kCarveAlignment; }

// Rows [V*t/T, V*(t+1)/T) of the vocabulary on TP rank t of T: T need not divide V.
inline int64_t VocabBegin(int64_t vocab, int tp_rank, int tp_size) { return vocab * tp_rank / tp_size; }
inline int64_t VocabSlice(int64_t vocab, int tp_rank, int tp_size) {
  return VocabBegin(vocab, tp_rank + 1, tp_size) - VocabBegin(vocab, tp_rank, tp_size);
}
// The engine pads each TP slice of the embedding and LM head with zero rows to a multiple
// of this (GPT-2's 50257 becomes 50304): products of odd widths run on slow kernels. The
// padding never trains and never reaches a file.
inline constexpr int kVocabMultiple = 128;
inline int64_t PaddedVocabRows(int64_t rows, int multiple = kVocabMultiple) {
  return (rows + multiple - 1) / multiple * multiple;
}

// The FSDP units of TP rank `tp_rank` of `tp_size` (api/model_family.h): the embedding
// unit (its padded vocabulary slice and whatever else the family puts there), each block
// (its TP slice and the replicated norms and biases), and the head unit (0 when the head
// is tied). model::ParameterLayout lays them out; a test holds the two equal.
//
// With expert parallelism (`expert_size` EP > 1, api/layout.h) a mixture of experts'
// block holds its tensors before the experts (attention, norms, the router: every expert
// group member's alike) and E/EP of its experts; `block_experts` says how many of the
// block's elements are those experts' (0 for a dense block).
// A mixture with dense blocks among its sparse ones (ModelShape::DenseBlock) has block
// units of two sizes: `block` a sparse one's, `dense_block` a dense one's (0: none).
struct UnitElements {
  int64_t embedding = 0, block = 0, head = 0;
  int64_t block_experts = 0;  // of `block`: this rank's experts' elements
  int64_t dense_block = 0;    // a mixture's dense block (FamilyTensors::dense_block); 0 where none
  // The elements of `blocks` blocks of which `dense` are a mixture's dense ones.
  int64_t Blocks(int64_t blocks, int64_t dense) const { return (blocks - dense) * block + dense * dense_block; }
  int64_t edge() const { return embedding > head ? embedding : head; }  // the slot they share
  int64_t block_shared() const { return block - block_experts; }  // alike on every member of an expert group
};
UnitElements UnitElementsOf(const ModelShape& shape, int tp_rank, int tp_size, int vocab_multiple = kVocabMultiple,
                            int expert_size = 1);
// Whether `t` is one expert's tensor (a mixture of experts' gate, up or down).
bool IsExpertTensor(const TensorInfo& t);
// The ranks a block unit's shard is split over, of a shard group of `shard_size` (S x C):
// S x C / EP for a unit holding experts that EP > 1 splits (the ranks holding the same
// experts), else all of them.
inline int BlockShards(const UnitElements& units, int shard_size, int expert_size) {
  return expert_size > 1 && units.block_experts > 0 ? shard_size / expert_size : shard_size;
}
// The elements of `t` on TP rank `tp_rank` of `tp_size`, its vocabulary slice padded.
int64_t LocalElements(const TensorInfo& t, int64_t vocab, int tp_rank, int tp_size, int vocab_multiple);

// Every shard's size when a unit of `numel` elements is split over `shard_size` ranks:
// the unit is padded to a multiple of shard_size.
inline int64_t ShardElements(int64_t numel, int shard_size) { return (numel + shard_size - 1) / shard_size; }

// The fused (cuDNN) attention backward's scratch for micro-batches of batch x seq on
// `heads` query heads of `head_dim` channels: an fp32 softmax sum and dQ accumulator per
// row and head, cuDNN's `workspace` (its plan reports it; the planner, which has no plan,
// counts none), each aligned, and room to align the start.
int64_t FusedAttentionScratchBytes(int batch, int seq, int heads, int head_dim, int64_t workspace);

// Bytes of a carving of `buffers` out of one allocation, each starting aligned.
int64_t CarvedBytes(const std::vector<Buffer>& buffers);

// Bytes of what one block's forward keeps, of the backward's working set, and of the
// head's (api/model_family.h lists them).
int64_t BlockActivationBytes(int batch, int seq, const ModelShape& shape, int tp_size, const EngineTypes& types);
int64_t HeadActivationBytes(int batch, int seq, const ModelShape& shape, int tp_rank, int tp_size,
                            const EngineTypes& types);
int64_t BlockScratchBytes(int batch, int seq, const ModelShape& shape, int tp_size, const EngineTypes& types,
                          bool dropout);

// The part of the model one rank holds: all of it (the default), or a pipeline stage's
// (api/pipeline.h, StageShapeOf).
struct StageShape {
  bool embedding_unit = true;  // the embedding's unit: the first stage's, and the last's for a tied head
  bool head = true;            // the head: its activations, and its unit when untied
  int blocks = -1;             // blocks held; -1: every block
  int dense_blocks = 0;        // of those, a mixture's dense blocks (ModelShape::DenseBlock); with -1, the model's
  // What the ActivationStore keeps activations for: a lane per micro-batch a chunk of
  // blocks may hold between its forward and its backward, each lane the chunk's blocks.
  // Empty: one lane of every block.
  std::vector<int> lanes;
  // Each lane has its own buffer for the gradient of its chunk's output (received from
  // the next stage, or the head's), which its backward runs on in place.
  bool pipelined = false;
  bool operator==(const StageShape&) const = default;
};

// The ActivationStore's two buffers: `kept` in activation memory (per lane: block inputs
// or whole blocks as the policy says, the chunk's output and, pipelined, its gradient;
// shared: the head, the backward's working set) and `offloaded` in the host pool.
struct ActivationBytes {
  int64_t kept = 0, offloaded = 0;
  int inputs = 0;  // block inputs held in activation memory (slots), of all lanes
};
ActivationBytes ActivationStoreBytes(const ModelShape& shape, int batch, int seq, const ActivationPolicy& policy,
                                     int tp_rank, int tp_size, const EngineTypes& types, bool dropout,
                                     const StageShape& stage = {});

// The engine's small per-step buffer: a micro-batch's tokens and targets, the loss and
// norm scalars, every unit's table of shard segments (kernels::ShardSegment, 24 bytes, one
// per tensor), and for RoPE the cos and sin of each position and frequency (Acc).
inline constexpr int64_t kShardSegmentBytes = 24;
// Float8 training's scratch (model::Float8Linear), for micro-batches of batch x seq rows on
// a TP rank of tp: two operands' amaxes, the TP group's gathered copies of them, and their
// scales, (tp + 2) x 2 x Float8ScaleWidth floats.
int64_t Float8ScratchElements(int batch, int seq, const ModelShape& shape, int tp, bool rowwise);
// The most scales one operand of a block's linear layer takes: 1 for a tensor's scale;
// rowwise, the largest of the rows and this TP rank's K and OC of the float8 layers
// (BlockProduct::float8).
int64_t Float8ScaleWidth(int batch, int seq, const ModelShape& shape, int tp, bool rowwise);

// A float8 product D (m,n) = A^T B over k, as a GPU's kernel table runs it; `sums`: through
// fp32 sums (Float8KeepsSums).
struct Float8Product {
  int64_t m = 0, n = 0, k = 0;
  bool sums = false;
};
// How a float8 run multiplies: its recipe's scaling (kernels::Float8Recipe), and the TP
// rank, which sets whether a row-parallel layer's products take its bias (LinearEpilogue).
// The default: tensorwise, on TP rank 0.
struct Float8Run {
  bool rowwise = false;
  int tp_rank = 0;
};
// Whether a GPU table runs a float8 product through fp32 sums, Float8SumRows of its rows
// at a time, rather than straight into its output: a rowwise product always (its scales
// apply to the sums); a tensorwise one where its `epilogue` works on the product (the
// forward's bias, residual or GELU; the input gradient's GELU backward). A tensorwise
// weight gradient has none: it accumulates straight into fp32.
inline bool Float8KeepsSums(bool rowwise, bool epilogue) { return rowwise || epilogue; }
// The float8 products of one block's linear layers (BlockProduct::float8) on TP rank
// run.tp_rank of tp, for micro-batches of batch x seq rows (N): each layer's forward
// (OC, N, K), input gradient (K, N, OC) and weight gradient (K, OC, N), with K and OC its
// TP slice (a column-parallel layer's OC, a row-parallel one's K), each with the sums its
// epilogue and run.rowwise make the table keep.
std::vector<Float8Product> Float8LinearProducts(int batch, int seq, const ModelShape& shape, int tp,
                                                const Float8Run& run = {});
// The fp32 sums a float8 product keeps at once when it keeps them (Float8KeepsSums): rows
// of m floats, at most kFloat8SumBytes of them, in multiples of 16 rows, at least 16 and
// at most n.
inline constexpr int64_t kFloat8SumBytes = int64_t{64} << 20;
int64_t Float8SumRows(int64_t m, int64_t n);
// The bytes of a GPU table's float8 scratch for one product: both operands' codes (m x k
// and n x k bytes), the two descales, and with `with_sums` Float8SumRows x m floats, each
// aligned to 256 bytes, and room to align the start. The table holds one scratch, as large
// as the largest product it has run.
int64_t Float8ProductBytes(const Float8Product& p, bool with_sums);
// The bytes of a GPU table's float8 scratch once it has run every product of a run's
// steps and evaluations: the largest Float8ProductBytes of Float8LinearProducts, each
// with its own sums.
int64_t Float8KernelScratchBytes(int batch, int seq, const ModelShape& shape, int tp, const Float8Run& run);

std::vector<Buffer> StepBuffers(int batch, int seq, const ModelShape& shape, const EngineTypes& types);
int64_t StepBufferBytes(int batch, int seq, const ModelShape& shape, const EngineTypes& types);

// One rank's peak, by the engine's accounting categories, in bytes held (each allocation
// rounded to the allocator's size classes):
//   params, grads, optimizer  every unit's shard of master weights, gradients, AdamW m and v
//   gathered   the units' compute copies while in use: the embedding's or the head's (one
//              slot, as large as the larger) and two blocks' (and with S > 1 their
//              gradients before the reduce-scatter)
//   comm       the reduce-scatter's output shard (S > 1)
//   activations, offload  the ActivationStore's two buffers, and the step buffer
struct EngineMemory {
  int64_t params = 0, grads = 0, optimizer = 0, activations = 0, offload = 0, gathered = 0, comm = 0;
  int64_t device() const { return params + grads + optimizer + activations + gathered + comm; }
  int64_t total() const { return device() + offload; }
};
// `keep_units_gathered`: every unit's compute copy is kept (replicated, S = 1), not slots.
// `stage`: the units and activations of a pipeline stage only. With expert parallelism
// (types.experts = EP > 1, dividing shard_size) a block holds E/EP experts
// (UnitElementsOf), sharded over shard_size / EP ranks, always reduces from unsharded
// gradients, and its activations are sized for EP x the local tokens' copies.
EngineMemory EngineMemoryOf(const ModelShape& shape, int batch, int seq, int tp_rank, int tp_size, int shard_size,
                            const ActivationPolicy& policy, const EngineTypes& types, bool dropout,
                            bool keep_units_gathered = false, const StageShape& stage = {});

// The bytes the caching allocator holds for a request of `bytes`
// (common::AllocatorBlockBytes: 512-byte blocks below 1 MiB, 2 MiB ones from there).
size_t AllocatorBlockBytes(size_t bytes);

}  // namespace meshtrain::api
