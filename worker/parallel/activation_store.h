// Where the sharded engine keeps what a block's forward leaves for its backward
// (docs/design.md, "Activations"): everything, only each block's input (checkpointing), or
// only the inputs within a loading horizon, the rest offloaded to a host pool.
//
//   keep all      every block's activations stay until its backward.
//   checkpoint    each block's input stays; the backward recomputes the block into one
//                 working set (same kernels, same order, so the results are bitwise equal).
//   offload H     block inputs live in n = min(H+1, L) slots, block l in slot l % n.
//                 After block l's forward, its input is copied to the host pool
//                 (MemoryCategory::kOffload, page-locked) on the copy stream, unless no
//                 later block overwrites its slot (the last n). The backward loads inputs
//                 back H blocks ahead, each into its slot as soon as the block that used
//                 the slot last has finished its backward, so at most n inputs are ever in
//                 device memory and compute waits only for copies it needs now.
//
// The store has lanes (api::StageShape): one of every block for a single stage, and in a
// pipeline one per micro-batch a chunk of blocks may hold between its forward and its
// backward, each of that chunk's blocks, numbered from 0 within the lane. Each lane keeps
// its blocks as the policy says, its output (the last block's: the head's input, or what
// goes to the next stage) and, pipelined, its own gradient of that output, which its
// backward carries in place (received from the next stage, or written by the head). The
// head's activations, the recompute's working set and the backward's scratch are shared.
// Every buffer is allocated here, when the engine is built: one allocation in device
// memory (api::ActivationStoreBytes), one in the pool.
// Thread-safety: the host calls the methods in schedule order; the copies run on the
// store's copy stream, ordered against the compute stream by events.

#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "api/engine_memory.h"
#include "api/model_shape.h"
#include "worker/model/model.h"
#include "worker/runtime/backend.h"
#include "worker/runtime/device_memory.h"
#include "worker/runtime/memory.h"

namespace meshtrain::parallel {

using ActivationPolicy = api::ActivationPolicy;

template <class P>
class ActivationStore {
 public:
  using A = typename P::Act;
  template <class T>
  using Ptr = runtime::DevicePtr<T>;

  // Throws std::invalid_argument, naming the spec field, for offload without
  // checkpointing or a horizon below 1.
  static void Check(const ActivationPolicy& policy);
  // Check()s the policy. Activations come from `device` and the pool from `pinned`; the
  // lanes and the head as `stage` says.
  ActivationStore(const api::ModelShape& shape, int max_batch, int max_seq, const ActivationPolicy& policy,
                  const api::EngineTypes& types, bool dropout, model::TpSlice tp, runtime::Backend& backend,
                  runtime::CachingAllocator* device, runtime::CachingAllocator* pinned,
                  const api::StageShape& stage = {});
  ~ActivationStore();  // drains the copy stream

  const ActivationPolicy& policy() const { return policy_; }
  // The backward must run BlockForward into Saved(l) before BlockBackward.
  bool recompute() const { return policy_.checkpointing; }
  int lanes() const { return int(lanes_.size()); }
  int blocks(int lane) const { return lanes_[size_t(lane)].layers; }

  // Block l's input: the lane's first input (the embedding's output, or what the previous
  // stage sent) for l = 0, else block l-1's output.
  Ptr<A> Input(int l, int lane = 0) const;
  // The lane's last block's output: the head's input, or what goes to the next stage.
  Ptr<A> Output(int lane = 0) const { return lanes_[size_t(lane)].output; }
  // The gradient of the lane's output, which the backward turns into its input's in
  // place: the lane's own when pipelined, else the scratch's.
  Ptr<A> Gradient(int lane = 0) const { return lanes_[size_t(lane)].gradient; }
  Ptr<A> head_input() const { return Output(0); }
  // Where block l's forward (or its recompute) writes; with checkpointing, the output is
  // the next block's input (forward) or the working set's own (recompute).
  model::BlockActivations<P> ForwardOutputs(int l, int lane = 0) const;
  model::BlockActivations<P> Saved(int l, int lane = 0) const;
  // The backward's scratch with dresidual at the lane's gradient.
  model::BlockScratch<P> ScratchFor(int lane) const;

  // Schedule hooks around each block on `compute` (the engine's compute stream).
  void BeforeForward(int l, runtime::Stream& compute, int lane = 0);   // its output's slot has been offloaded
  void AfterForward(int l, runtime::Stream& compute, int lane = 0);    // offload its input
  void BeforeBackward(int l, runtime::Stream& compute, int lane = 0);  // load ahead; wait for its input
  void AfterBackward(int l, runtime::Stream& compute, int lane = 0);   // its slot may be loaded again
  // Blocks until the copy stream has drained; rethrows a copy's failure.
  void Synchronize(std::chrono::milliseconds timeout) { copy_->Synchronize(timeout); }

  model::HeadActivations<P> head;  // empty on a stage without the head
  model::BlockScratch<P> scratch;

  // Seconds the copy stream spent copying, and the compute stream spent waiting on it.
  // REQUIRES: the streams have been synchronized.
  double copy_seconds() { return copy_timer_->Seconds(); }
  double copy_wait_seconds() { return wait_timer_->Seconds(); }
  // Inputs in slots (activation memory) and in the host pool, in blocks, of lane 0.
  int slots() const { return int(lanes_[0].slots.size()); }
  int offloaded_blocks() const { return int(lanes_[0].pool.size()); }

 private:
  struct Lane {
    int layers = 0;
    std::vector<model::BlockActivations<P>> blocks;  // keep all: one per block
    std::vector<Ptr<A>> slots;                       // checkpoint: block inputs (n = layers without offload)
    Ptr<A> output, gradient;
    std::vector<std::byte*> pool;  // offload: inputs 0 .. layers-n-1 in host memory
    std::vector<std::unique_ptr<runtime::Event>> offloaded_slot, loaded_slot, released_slot;
    int next_load = -1;  // the next input the backward will load (counting down)
    int Slot(int l) const { return l % int(slots.size()); }
    // Input l lives in the pool meanwhile: input l+n overwrites its slot.
    bool Offloaded(int l) const { return l < layers - int(slots.size()); }
  };

  void Load(Lane& lane, int l);
  void Copy(Lane& lane, int l, bool out);
  void WaitTimed(runtime::Stream& compute, runtime::Event& event);

  ActivationPolicy policy_;
  int64_t input_bytes_;
  runtime::Backend& backend_;
  runtime::DeviceArray<std::byte> kept_;
  std::vector<Lane> lanes_;
  model::BlockActivations<P> work_{};  // checkpoint: the recompute's working set
  runtime::CachingAllocator* pinned_;
  std::byte* pool_base_ = nullptr;

  std::unique_ptr<runtime::Stream> copy_;
  std::unique_ptr<runtime::StreamTimer> copy_timer_, wait_timer_;
  std::unique_ptr<runtime::Event> forward_done_;
};

}  // namespace meshtrain::parallel
