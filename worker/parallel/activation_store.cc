#include "worker/parallel/activation_store.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <string>

namespace meshtrain::parallel {

using model::BlockActivations;
using model::HeadActivations;

void ActivationStore::Check(const ActivationPolicy& policy) {
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

ActivationStore::ActivationStore(const api::ModelShape& shape, int max_batch, int max_seq, const ActivationPolicy& policy,
                                 runtime::CachingAllocator* allocator, model::TpSlice tp)
    : policy_(policy), layers_(int(shape.layers)), btc_(int64_t(max_batch) * max_seq * shape.hidden) {
  Check(policy);
  const int64_t block = BlockActivations<float>::Size(max_batch, max_seq, shape, tp);
  const int64_t head_size = HeadActivations<float>::Size(max_batch, max_seq, shape, tp);
  // The sizes the planner's memory model counts (api/engine_memory.h); the carving
  // below must use exactly them, which the check at its end holds.
  const api::ActivationElements sizes = api::ActivationStoreElements(shape, max_batch, max_seq, policy, tp.rank, tp.size);
  const int inputs = sizes.inputs;
  const int kept_blocks = policy.checkpointing ? 1 : layers_;
  const int head_inputs = policy.checkpointing ? 1 : 0;  // otherwise the last block's residual3
  kept_ = runtime::Buffer<float>(allocator, size_t(sizes.kept), runtime::MemoryCategory::kActivations);
  float* next = kept_.data();
  auto take = [&next](int64_t n) {
    float* at = next;
    next += n;
    return at;
  };
  for (int i = 0; i < inputs; ++i) slots_.push_back(take(btc_));
  head_input_ = take(btc_ * head_inputs);
  for (int b = 0; b < kept_blocks; ++b) {
    blocks_.push_back(BlockActivations<float>::At(take(block), max_batch, max_seq, shape, tp));
  }
  head = HeadActivations<float>::At(take(head_size), max_batch, max_seq, shape, tp);
  dhead = HeadActivations<float>::At(take(head_size), max_batch, max_seq, shape, tp);
  dblock = BlockActivations<float>::At(take(block), max_batch, max_seq, shape, tp);
  dresidual[0] = take(btc_);
  dresidual[1] = take(btc_);
  if (next != kept_.data() + sizes.kept) throw std::logic_error("ActivationStore: carving disagrees with api::ActivationStoreElements");
  if (policy.checkpointing) work_ = blocks_[0];
  else head_input_ = blocks_.back().residual3;
  if (sizes.offloaded > 0) {
    offloaded_ = runtime::Buffer<float>(allocator, size_t(sizes.offloaded), runtime::MemoryCategory::kOffload);
    for (int l = 0; l < layers_ - slots(); ++l) pool_.push_back(offloaded_.data() + btc_ * l);
  }
  offloaded_slot_.resize(slots_.size());
  loaded_slot_.resize(slots_.size());
  released_slot_.resize(slots_.size());
}

ActivationStore::~ActivationStore() {
  try {
    copy_.Synchronize();
  } catch (...) {  // already reported by the step that failed
  }
}

float* ActivationStore::Input(int l) const {
  if (!policy_.checkpointing) return l == 0 ? slots_[0] : blocks_[size_t(l) - 1].residual3;
  return slots_[size_t(Slot(l))];
}

BlockActivations<float> ActivationStore::ForwardOutputs(int l) const {
  if (!policy_.checkpointing) return blocks_[size_t(l)];
  BlockActivations<float> out = work_;
  out.residual3 = l + 1 < layers_ ? Input(l + 1) : head_input_;
  return out;
}

BlockActivations<float> ActivationStore::Saved(int l) const {
  return policy_.checkpointing ? work_ : blocks_[size_t(l)];
}

void ActivationStore::BeforeForward(int l, runtime::Stream& compute) {
  // Block l writes input l+1 over input l+1-n, which must have reached the pool.
  if (policy_.offload && l + 1 < layers_ && l + 1 >= slots()) {
    compute.Wait(offloaded_slot_[size_t(Slot(l + 1))], &copy_wait_seconds_);
  }
}

void ActivationStore::AfterForward(int l, runtime::Stream& compute) {
  if (!policy_.offload || !Offloaded(l)) return;
  runtime::Event forward_done;
  forward_done.Record(compute);
  copy_.Wait(forward_done);
  Copy(pool_[size_t(l)], Input(l));
  offloaded_slot_[size_t(Slot(l))].Record(copy_);
}

void ActivationStore::Copy(float* to, const float* from) {
  copy_.Enqueue([this, to, from] {
    const auto start = std::chrono::steady_clock::now();
    std::memcpy(to, from, size_t(btc_) * sizeof(float));
    copy_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  });
}

void ActivationStore::Load(int l) {
  // Input l goes where input l+n was; block l+n's backward has been enqueued already.
  copy_.Wait(released_slot_[size_t(Slot(l))]);
  Copy(Input(l), pool_[size_t(l)]);
  loaded_slot_[size_t(Slot(l))].Record(copy_);
}

void ActivationStore::BeforeBackward(int l, runtime::Stream& compute) {
  if (!policy_.offload) return;
  if (l == layers_ - 1) next_load_ = layers_ - slots() - 1;  // a new backward; the last n never left their slots
  for (; next_load_ >= 0 && next_load_ >= l - policy_.horizon; --next_load_) Load(next_load_);
  if (Offloaded(l)) compute.Wait(loaded_slot_[size_t(Slot(l))], &copy_wait_seconds_);
}

void ActivationStore::AfterBackward(int l, runtime::Stream& compute) {
  if (policy_.offload) released_slot_[size_t(Slot(l))].Record(compute);
}

}  // namespace meshtrain::parallel
