// Where the sharded engine keeps what a block's forward leaves for its backward
// (DESIGN.md, "Activations"): everything, only each block's input (checkpointing), or
// only the inputs within a loading horizon, the rest offloaded to a host pool.
//
//   keep all      every block's activations stay until its backward.
//   checkpoint    each block's input stays; the backward recomputes the block into one
//                 working set (same kernels, same order, so the results are bitwise equal).
//   offload H     block inputs live in n = min(H+1, L) slots, block l in slot l % n.
//                 After block l's forward, its input is copied to the host pool
//                 (MemoryCategory::kOffload) on the copy stream, unless no later block
//                 overwrites its slot (the last n). The backward loads inputs back H
//                 blocks ahead, each into its slot as soon as the block that used the
//                 slot last has finished its backward, so at most n inputs are ever in
//                 activation memory and compute waits only for copies it needs now.
//
// The head's input (the last block's output), the head's activations and the backward's
// scratch (dblock, dhead, dresidual) are kept in every mode.
// Thread-safety: the host calls the methods in schedule order; the copies run on the
// store's copy stream, ordered against the compute stream by events.

#pragma once

#include <cstdint>
#include <vector>

#include "api/engine_memory.h"
#include "api/model_shape.h"
#include "worker/model/blocks.h"
#include "worker/runtime/memory.h"
#include "worker/runtime/stream.h"

namespace meshtrain::parallel {

using ActivationPolicy = api::ActivationPolicy;

class ActivationStore {
 public:
  // Throws std::invalid_argument, naming the spec field, for offload without
  // checkpointing or a horizon below 1.
  static void Check(const ActivationPolicy& policy);
  // Check()s the policy.
  ActivationStore(const api::ModelShape& shape, int max_batch, int max_seq, const ActivationPolicy& policy,
                  runtime::CachingAllocator* allocator, model::TpSlice tp = {});
  ~ActivationStore();  // drains the copy stream

  const ActivationPolicy& policy() const { return policy_; }
  // The backward must run BlockForward into Saved(l) before BlockBackward.
  bool recompute() const { return policy_.checkpointing; }

  // Block 0's input: EmbedForward writes it, EmbedBackward's gradient flows from it.
  float* embedded() const { return Input(0); }
  // Block l's input: embedded, or block l-1's output.
  float* Input(int l) const;
  // The last block's output, which the head reads.
  float* head_input() const { return head_input_; }
  // Where block l's forward (or its recompute) writes; with checkpointing, residual3 is
  // the next block's input (forward) or the working set's own (recompute).
  model::BlockActivations<float> ForwardOutputs(int l) const;
  model::BlockActivations<float> Saved(int l) const;

  // Schedule hooks around each block on `compute` (the engine's compute stream).
  void BeforeForward(int l, runtime::Stream& compute);  // its output's slot has been offloaded
  void AfterForward(int l, runtime::Stream& compute);   // offload its input
  void BeforeBackward(int l, runtime::Stream& compute);  // load ahead; wait for its input
  void AfterBackward(int l, runtime::Stream& compute);   // its slot may be loaded again
  // Blocks until the copy stream has drained; rethrows a copy's failure.
  void Synchronize() { copy_.Synchronize(); }

  model::HeadActivations<float> head, dhead;
  model::BlockActivations<float> dblock;
  float* dresidual[2];  // (B,Tn,C) each: the gradient of a block's output and of its input

  // Seconds the copy stream spent copying, and the compute stream spent waiting on it.
  double copy_seconds() const { return copy_seconds_; }
  double copy_wait_seconds() const { return copy_wait_seconds_; }
  // Inputs in slots (activation memory) and in the host pool, in blocks.
  int slots() const { return int(slots_.size()); }
  int offloaded_blocks() const { return int(pool_.size()); }

 private:
  int Slot(int l) const { return l % slots(); }
  // The block whose forward wrote input l's slot: input l+n overwrites input l.
  bool Offloaded(int l) const { return l < layers_ - slots(); }
  void Load(int l);
  // Enqueues a timed copy of one block input on the copy stream.
  void Copy(float* to, const float* from);

  ActivationPolicy policy_;
  int layers_;
  int64_t btc_;
  runtime::Buffer<float> kept_, offloaded_;
  std::vector<model::BlockActivations<float>> blocks_;  // keep all: one per block
  model::BlockActivations<float> work_{};                // checkpoint: the recompute's working set
  std::vector<float*> slots_;                            // checkpoint: block inputs (n = L without offload)
  std::vector<float*> pool_;                             // offload: inputs 0 .. L-n-1 on the host
  float* head_input_ = nullptr;

  runtime::Stream copy_{"copy"};
  std::vector<runtime::Event> offloaded_slot_, loaded_slot_, released_slot_;
  int next_load_ = -1;  // the next input the backward will load (counting down)
  double copy_seconds_ = 0, copy_wait_seconds_ = 0;
};

}  // namespace meshtrain::parallel
