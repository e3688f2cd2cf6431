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
                                    runtime::CachingAllocator* pinned)
    : policy_(policy),
      layers_(int(shape.layers)),
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
      api::ActivationStoreBytes(shape, max_batch, max_seq, policy, tp.rank, tp.size, types, dropout);
  const int kept_blocks = policy.checkpointing ? 1 : layers_;
  const int64_t block_bytes = api::BlockActivationBytes(max_batch, max_seq, shape, tp.size, types);
  kept_ = runtime::DeviceArray<std::byte>(device, sizes.kept, runtime::MemoryCategory::kActivations);
  runtime::DeviceBytes next = kept_.get();
  auto take = [&next](int64_t bytes) {
    runtime::DeviceBytes at = next;
    next += bytes;
    return at;
  };
  for (int i = 0; i < sizes.inputs; ++i) slots_.push_back(take(input_bytes_).template As<A>());
  if (policy.checkpointing) head_input_ = take(input_bytes_).template As<A>();
  for (int b = 0; b < kept_blocks; ++b) {
    blocks_.push_back(model::BlockActivations<P>::At(take(block_bytes), max_batch, max_seq, shape, tp, types));
  }
  head = model::HeadActivations<P>::At(take(api::HeadActivationBytes(max_batch, max_seq, shape, tp.rank, tp.size, types)),
                                       max_batch, max_seq, shape, tp, types);
  scratch = model::BlockScratch<P>::At(take(api::BlockScratchBytes(max_batch, max_seq, shape, tp.size, types, dropout)),
                                       max_batch, max_seq, shape, tp, types, dropout);
  if (next - kept_.get() != sizes.kept) {
    throw std::logic_error("ActivationStore: carving disagrees with api::ActivationStoreBytes");
  }
  if (policy.checkpointing) work_ = blocks_[0];
  else head_input_ = blocks_.back().output;
  if (sizes.offloaded > 0) {
    pool_base_ = static_cast<std::byte*>(pinned_->Allocate(size_t(sizes.offloaded), runtime::MemoryCategory::kOffload));
    for (int l = 0; l < layers_ - slots(); ++l) pool_.push_back(pool_base_ + input_bytes_ * l);
  }
  for (size_t i = 0; i < slots_.size(); ++i) {
    offloaded_slot_.push_back(backend.NewEvent());
    loaded_slot_.push_back(backend.NewEvent());
    released_slot_.push_back(backend.NewEvent());
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
runtime::DevicePtr<typename P::Act> ActivationStore<P>::Input(int l) const {
  if (!policy_.checkpointing) return l == 0 ? slots_[0] : blocks_[size_t(l) - 1].output;
  return slots_[size_t(Slot(l))];
}

template <class P>
model::BlockActivations<P> ActivationStore<P>::ForwardOutputs(int l) const {
  if (!policy_.checkpointing) return blocks_[size_t(l)];
  model::BlockActivations<P> out = work_;
  out.output = l + 1 < layers_ ? Input(l + 1) : head_input_;
  return out;
}

template <class P>
model::BlockActivations<P> ActivationStore<P>::Saved(int l) const {
  return policy_.checkpointing ? work_ : blocks_[size_t(l)];
}

template <class P>
void ActivationStore<P>::WaitTimed(runtime::Stream& compute, runtime::Event& event) {
  wait_timer_->Begin(compute);
  compute.Wait(event);
  wait_timer_->End(compute);
}

template <class P>
void ActivationStore<P>::BeforeForward(int l, runtime::Stream& compute) {
  // Block l writes input l+1 over input l+1-n, which must have reached the pool.
  if (policy_.offload && l + 1 < layers_ && l + 1 >= slots()) WaitTimed(compute, *offloaded_slot_[size_t(Slot(l + 1))]);
}

template <class P>
void ActivationStore<P>::AfterForward(int l, runtime::Stream& compute) {
  if (!policy_.offload || !Offloaded(l)) return;
  forward_done_->Record(compute);
  copy_->Wait(*forward_done_);
  Copy(l, /*out=*/true);
  offloaded_slot_[size_t(Slot(l))]->Record(*copy_);
}

template <class P>
void ActivationStore<P>::Copy(int l, bool out) {
  copy_timer_->Begin(*copy_);
  if (out) {
    backend_.CopyToHost(pool_[size_t(l)], Input(l), size_t(input_bytes_), *copy_);
  } else {
    backend_.CopyFromHost(Input(l), pool_[size_t(l)], size_t(input_bytes_), *copy_);
  }
  copy_timer_->End(*copy_);
}

template <class P>
void ActivationStore<P>::Load(int l) {
  // Input l goes where input l+n was; block l+n's backward has been enqueued already.
  copy_->Wait(*released_slot_[size_t(Slot(l))]);
  Copy(l, /*out=*/false);
  loaded_slot_[size_t(Slot(l))]->Record(*copy_);
}

template <class P>
void ActivationStore<P>::BeforeBackward(int l, runtime::Stream& compute) {
  if (!policy_.offload) return;
  if (l == layers_ - 1) next_load_ = layers_ - slots() - 1;  // a new backward; the last n never left their slots
  for (; next_load_ >= 0 && next_load_ >= l - policy_.horizon; --next_load_) Load(next_load_);
  if (Offloaded(l)) WaitTimed(compute, *loaded_slot_[size_t(Slot(l))]);
}

template <class P>
void ActivationStore<P>::AfterBackward(int l, runtime::Stream& compute) {
  if (policy_.offload) released_slot_[size_t(Slot(l))]->Record(compute);
}

template class ActivationStore<kernels::Fp32>;
template class ActivationStore<kernels::Bf16>;
template class ActivationStore<kernels::Fp64>;

}  // namespace meshtrain::parallel
