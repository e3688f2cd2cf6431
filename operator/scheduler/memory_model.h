// The memory model of the planner: what one rank of the sharded engine holds at its
// peak, for a layout choice, added up from the sizes the engine allocates
// (api/engine_memory.h), so that the model and the engine's accounting cannot drift.
//
// Per rank, in the engine's accounting categories:
//   params, grads     every unit's shard (padded to a multiple of S), fp32
//   optimizer         AdamW m and v of the shards, fp32
//   activations       the ActivationStore: all blocks, block inputs, or inputs within the
//                     loading horizon, plus the head and the backward's scratch
//   offload           the host pool of offloaded block inputs
//   gathered          at the backward's peak: the root's parameters and gradients, and three
//                     block-sized buffers (two blocks' parameters and one block's gradients, or
//                     one block's parameters and two blocks' gradients while a reduce-scatter runs)
//   comm              the reduce-scatter's output shard (S > 1)
// each allocation rounded to the caching allocator's size classes. The peak is the sum:
// an upper bound of the engine's, reached in the backward of every micro-batch.
// Thread-safety: pure functions.

#pragma once

#include <cstdint>
#include <string>

#include "api/engine_memory.h"
#include "api/model_shape.h"

namespace meshtrain::scheduler {

// One candidate layout of a job: what the planner chooses.
struct LayoutChoice {
  int tp = 1;     // tensorParallelDegree
  int shard = 1;  // hybridShardDegree (never 0 here: the resolved S)
  int micro_batch = 1;  // microBatchSize: sequences per data-parallel rank and micro-step
  api::ActivationPolicy activations;
  bool operator==(const LayoutChoice&) const = default;
};

// "T=2, S=4, micro-batch 8, checkpointing" / "..., offload (horizon 2)"
std::string Describe(const LayoutChoice& choice);

struct MemoryPrediction {
  int64_t params = 0, grads = 0, optimizer = 0, activations = 0, offload = 0, gathered = 0, comm = 0;
  // Device memory (everything but the offload pool, which lives in host memory).
  int64_t device() const { return params + grads + optimizer + activations + gathered + comm; }
  // Everything the rank's allocator accounts (on the CPU, device and host are one memory).
  int64_t total() const { return device() + offload; }
};

// The peak of the rank that holds the most (the largest vocabulary slice), for
// sequences of `seq` tokens, gathered parameters and activations of `compute_bytes`
// each (4: fp32 on the CPU; 2: bf16).
MemoryPrediction PredictMemory(const api::ModelShape& shape, int seq, const LayoutChoice& choice, int compute_bytes);

}  // namespace meshtrain::scheduler
