// What the sharded engine allocates, as pure functions of the model's shape and the
// layout. The engine sizes its buffers with these functions (FlatUnit's shards, the
// ActivationStore, the caching allocator's size classes), and the planner's memory model
// (operator/scheduler/memory_model.h) adds them up, so that the two cannot drift.
// Counts are in elements unless a name says bytes. Thread-safety: pure functions.

#pragma once

#include <cstddef>
#include <cstdint>

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

// Rows [V*t/T, V*(t+1)/T) of the vocabulary on TP rank t of T: T need not divide V.
inline int64_t VocabBegin(int64_t vocab, int tp_rank, int tp_size) { return vocab * tp_rank / tp_size; }
inline int64_t VocabSlice(int64_t vocab, int tp_rank, int tp_size) {
  return VocabBegin(vocab, tp_rank + 1, tp_size) - VocabBegin(vocab, tp_rank, tp_size);
}

// The FSDP units of TP rank `tp_rank` of `tp_size`: the root (wte's vocabulary slice,
// wpe, the final LayerNorm) and each block (its TP slice and the replicated LayerNorms
// and row-parallel biases). model::ParameterLayout lays them out; a test holds the two equal.
struct UnitElements {
  int64_t root = 0, block = 0;
};
UnitElements UnitElementsOf(const ModelShape& shape, int tp_rank, int tp_size);

// Every shard's size when a unit of `numel` elements is split over `shard_size` ranks:
// the unit is padded to a multiple of shard_size.
inline int64_t ShardElements(int64_t numel, int shard_size) { return (numel + shard_size - 1) / shard_size; }

// What one block's forward keeps for micro-batches up to batch x seq on a TP slice of
// `tp_size` (LayerNorms, QKV, attention scores and probabilities, MLP, residuals).
int64_t BlockActivationElements(int batch, int seq, const ModelShape& shape, int tp_size);
// The head's: final LayerNorm, this slice's logits and probabilities, losses, and with
// TP the softmax statistics of the slice and of the group.
int64_t HeadActivationElements(int batch, int seq, const ModelShape& shape, int tp_rank, int tp_size);

// The ActivationStore's two buffers: `kept` in activation memory (block inputs or whole
// blocks as the policy says, the head's input, head and dhead, dblock, two residual
// gradients) and `offloaded` in the host pool.
struct ActivationElements {
  int64_t kept = 0, offloaded = 0;
  int inputs = 0;  // block inputs held in activation memory (slots)
};
ActivationElements ActivationStoreElements(const ModelShape& shape, int batch, int seq, const ActivationPolicy& policy,
                                           int tp_rank, int tp_size);

// The bytes the caching allocator holds for a request of `bytes`: rounded up to 512
// bytes below 1 MiB and to 2 MiB from there.
size_t AllocatorBlockBytes(size_t bytes);

}  // namespace meshtrain::api
