#include "worker/parallel/activation_store.h"

#include <stdexcept>
#include <string>

namespace meshtrain::parallel {

template <class P>
void ActivationStore<P>::Check(const ActivationPolicy& policy) {
  if (policy.offload && !policy.checkpointing) {
    throw std::invalid_argument(
        "spec.parallelism.activationOffloading needs spec.parallelism.activationCheckpointing: only block inputs are "
        "offloaded");
  }
  if (policy.offload && policy.horizon < 1) {
    throw std::invalid_argument("spec.parallelism.activationLoadingHorizon must be at least 1, got " +
                                std::to_string(policy.horizon));
  }
}

template <class P>
ActivationStore<P>::ActivationStore(const api::ModelShape& shape, int max_batch, int max_seq,
                                    const ActivationPolicy& policy, const api::EngineTypes& types, bool dropout,
                                    model::TpSlice tp, runtime::Backend& backend, runtime::CachingAllocator* device,
                                    runtime::CachingAllocator* pinned, const api::StageShape& stage)
    : policy_(policy),
      input_bytes_(api::Aligned(int64_t(max_batch) * max_seq * shape.hidden * int64_t(sizeof(A)))),
      backend_(backend),
      pinned_(pinned),
      copy_(backend.NewStream("copy")),
      copy_timer_(backend.NewTimer()),
      wait_timer_(backend.NewTimer()),
      forward_done_(backend.NewEvent()) {
  Check(policy);
  // The sizes the planner's memory model counts (api/engine_memory.h); the carving below
  // takes exactly them, which the check at its end holds.
  const api::ActivationBytes sizes =
      api::ActivationStoreBytes(shape, max_batch, max_seq, policy, tp.rank, tp.size, types, dropout, stage);
  const int64_t block_bytes = api::BlockActivationBytes(max_batch, max_seq, shape, tp.size, types);
  kept_ = runtime::DeviceArray<std::byte>(device, sizes.kept, runtime::MemoryCategory::kActivations);
  runtime::DeviceBytes next = kept_.get();
  auto take = [&next](int64_t bytes) {
    runtime::DeviceBytes at = next;
    next += bytes;
    return at;
  };
  auto block = [&] { return model::BlockActivations<P>::At(take(block_bytes), max_batch, max_seq, shape, tp, types); };
  const std::vector<int> layers = stage.lanes.empty() ? std::vector<int>{int(shape.layers)} : stage.lanes;
  lanes_.resize(layers.size());
  for (size_t i = 0; i < layers.size(); ++i) {
    Lane& lane = lanes_[i];
    lane.layers = layers[i];
    const int slots = !policy.checkpointing ? 1 : policy.offload ? std::min(policy.horizon + 1, lane.layers) : lane.layers;
    for (int j = 0; j < slots; ++j) lane.slots.push_back(take(input_bytes_).template As<A>());
    if (policy.checkpointing) lane.output = take(input_bytes_).template As<A>();
    if (stage.pipelined) lane.gradient = take(input_bytes_).template As<A>();
    if (!policy.checkpointing) {
      for (int b = 0; b < lane.layers; ++b) lane.blocks.push_back(block());
      lane.output = lane.blocks.back().output;
    }
  }
  if (policy.checkpointing) work_ = block();
  if (stage.head) {
    head = model::HeadActivations<P>::At(take(api::HeadActivationBytes(max_batch, max_seq, shape, tp.rank, tp.size, types)),
                                         max_batch, max_seq, shape, tp, types);
  }
  scratch = model::BlockScratch<P>::At(take(api::BlockScratchBytes(max_batch, max_seq, shape, tp.size, types, dropout)),
                                       max_batch, max_seq, shape, tp, types, dropout);
  if (next - kept_.get() != sizes.kept) {
    throw std::logic_error("ActivationStore: carving disagrees with api::ActivationStoreBytes");
  }
  if (!stage.pipelined) {
    for (Lane& lane : lanes_) lane.gradient = scratch.dresidual;
  }
  if (sizes.offloaded > 0) {
    pool_base_ = static_cast<std::byte*>(pinned_->Allocate(size_t(sizes.offloaded), runtime::MemoryCategory::kOffload));
  }
  std::byte* pool = pool_base_;
  for (Lane& lane : lanes_) {
    if (policy.offload) {
      for (int l = 0; l < lane.layers - int(lane.slots.size()); ++l, pool += input_bytes_) lane.pool.push_back(pool);
    }
    for (size_t i = 0; i < lane.slots.size(); ++i) {
      lane.offloaded_slot.push_back(backend.NewEvent());
      lane.loaded_slot.push_back(backend.NewEvent());
      lane.released_slot.push_back(backend.NewEvent());
    }
  }
}

template <class P>
ActivationStore<P>::~ActivationStore() {
  try {
    copy_->Synchronize();
  } catch (...) {  // already reported by the step that failed
  }
  if (pool_base_ != nullptr) pinned_->Free(pool_base_);
}

template <class P>
runtime::DevicePtr<typename P::Act> ActivationStore<P>::Input(int l, int lane) const {
  const Lane& at = lanes_[size_t(lane)];
  if (!policy_.checkpointing) return l == 0 ? at.slots[0] : at.blocks[size_t(l) - 1].output;
  return at.slots[size_t(at.Slot(l))];
}

template <class P>
model::BlockActivations<P> ActivationStore<P>::ForwardOutputs(int l, int lane) const {
  const Lane& at = lanes_[size_t(lane)];
  if (!policy_.checkpointing) return at.blocks[size_t(l)];
  model::BlockActivations<P> out = work_;
  out.output = l + 1 < at.layers ? Input(l + 1, lane) : at.output;
  return out;
}

template <class P>
model::BlockActivations<P> ActivationStore<P>::Saved(int l, int lane) const {
  return policy_.checkpointing ? work_ : lanes_[size_t(lane)].blocks[size_t(l)];
}

template <class P>
model::BlockScratch<P> ActivationStore<P>::ScratchFor(int lane) const {
  model::BlockScratch<P> s = scratch;
  s.dresidual = lanes_[size_t(lane)].gradient;
  return s;
}

template <class P>
void ActivationStore<P>::WaitTimed(runtime::Stream& compute, runtime::Event& event) {
  wait_timer_->Begin(compute);
  compute.Wait(event);
  wait_timer_->End(compute);
}

template <class P>
void ActivationStore<P>::BeforeForward(int l, runtime::Stream& compute, int lane) {
  // Block l writes input l+1 over input l+1-n, which must have reached the pool.
  Lane& at = lanes_[size_t(lane)];
  if (policy_.offload && l + 1 < at.layers && l + 1 >= int(at.slots.size())) {
    WaitTimed(compute, *at.offloaded_slot[size_t(at.Slot(l + 1))]);
  }
}

template <class P>
void ActivationStore<P>::AfterForward(int l, runtime::Stream& compute, int lane) {
  Lane& at = lanes_[size_t(lane)];
  if (!policy_.offload || !at.Offloaded(l)) return;
  forward_done_->Record(compute);
  copy_->Wait(*forward_done_);
  Copy(at, l, /*out=*/true);
  at.offloaded_slot[size_t(at.Slot(l))]->Record(*copy_);
}

template <class P>
void ActivationStore<P>::Copy(Lane& lane, int l, bool out) {
  const Ptr<A> slot = lane.slots[size_t(lane.Slot(l))];
  copy_timer_->Begin(*copy_);
  if (out) {
    backend_.CopyToHost(lane.pool[size_t(l)], slot, size_t(input_bytes_), *copy_);
  } else {
    backend_.CopyFromHost(slot, lane.pool[size_t(l)], size_t(input_bytes_), *copy_);
  }
  copy_timer_->End(*copy_);
}

template <class P>
void ActivationStore<P>::Load(Lane& lane, int l) {
  // Input l goes where input l+n was; block l+n's backward has been enqueued already.
  copy_->Wait(*lane.released_slot[size_t(lane.Slot(l))]);
  Copy(lane, l, /*out=*/false);
  lane.loaded_slot[size_t(lane.Slot(l))]->Record(*copy_);
}

template <class P>
void ActivationStore<P>::BeforeBackward(int l, runtime::Stream& compute, int lane) {
  if (!policy_.offload) return;
  Lane& at = lanes_[size_t(lane)];
  const int n = int(at.slots.size());
  if (l == at.layers - 1) at.next_load = at.layers - n - 1;  // a new backward; the last n never left their slots
  for (; at.next_load >= 0 && at.next_load >= l - policy_.horizon; --at.next_load) Load(at, at.next_load);
  if (at.Offloaded(l)) WaitTimed(compute, *at.loaded_slot[size_t(at.Slot(l))]);
}

template <class P>
void ActivationStore<P>::AfterBackward(int l, runtime::Stream& compute, int lane) {
  Lane& at = lanes_[size_t(lane)];
  if (policy_.offload) at.released_slot[size_t(at.Slot(l))]->Record(compute);
}

template class ActivationStore<kernels::Fp32>;
template class ActivationStore<kernels::Bf16>;
template class ActivationStore<kernels::Fp64>;

}  // namespace meshtrain::parallel
