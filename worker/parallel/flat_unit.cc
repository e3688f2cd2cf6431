#include "worker/parallel/flat_unit.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "api/engine_memory.h"
#include "worker/kernels/cpu/kernels.h"

namespace meshtrain::parallel {
namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

}  // namespace

UnitShard ShardOfUnit(const model::ParameterLayout& layout, int index, int shard_size, int shard_rank) {
  const auto [begin, end] = layout.Unit(index);
  UnitShard s;
  s.unit_begin = begin;
  s.numel = end - begin;
  s.shard_numel = api::ShardElements(s.numel, shard_size);
  s.begin = std::min(s.numel, int64_t(shard_rank) * s.shard_numel);
  s.real = std::min(s.numel, s.begin + s.shard_numel) - s.begin;
  return s;
}

FlatUnit::FlatUnit(const model::ParameterLayout& layout, int index, int shard_size, int shard_rank, uint64_t seed,
                   runtime::CachingAllocator* allocator)
    : index_(index), shard_size_(shard_size), allocator_(allocator) {
  const UnitShard shard = ShardOfUnit(layout, index, shard_size, shard_rank);
  begin_ = shard.unit_begin;
  numel_ = shard.numel;
  shard_numel_ = shard.shard_numel;
  shard_begin_ = shard.begin;
  shard_real_ = shard.real;
  using runtime::MemoryCategory;
  master_ = runtime::Buffer<float>(allocator, size_t(shard_numel_), MemoryCategory::kParams);
  grad_ = runtime::Buffer<float>(allocator, size_t(shard_numel_), MemoryCategory::kGrads);
  m_ = runtime::Buffer<float>(allocator, size_t(shard_numel_), MemoryCategory::kOptimizer);
  v_ = runtime::Buffer<float>(allocator, size_t(shard_numel_), MemoryCategory::kOptimizer);
  const int64_t from = begin_ + shard_begin_, to = from + shard_real_;
  model::InitParameterRange(master_.data(), layout, seed, from, to);
  for (const model::ParamTensor& t : layout.tensors()) {
    const int64_t a = std::max(from, t.offset), b = std::min(to, t.offset + t.size);
    if (a < b) segments_.push_back({a - from, b - a, t.decay, t.tp_replicated()});
  }
}

void FlatUnit::Gather(comm::Communicator* shard, runtime::Stream& comm, train::CommStats* seconds) {
  comm.Enqueue([this, shard, seconds] {
    const size_t padded = size_t(shard_numel_) * size_t(shard_size_);
    params_ = static_cast<float*>(allocator_->Allocate(padded * sizeof(float), runtime::MemoryCategory::kGathered));
    if (shard == nullptr) {
      std::memcpy(params_, master_.data(), size_t(numel_) * sizeof(float));
      return;
    }
    const Clock::time_point start = Clock::now();
    shard->AllGather(master_.data(), params_, size_t(shard_numel_), comm::DataType::kFloat32)->Wait();
    seconds->all_gather += SecondsSince(start);
  });
  ready_.Record(comm);
}

void FlatUnit::FreeParams(runtime::Stream& stream) {
  stream.Enqueue([this] {
    allocator_->Free(params_);
    params_ = nullptr;
  });
}

void FlatUnit::AllocateGrads() {
  const size_t padded = size_t(shard_numel_) * size_t(shard_size_);
  grads_ = static_cast<float*>(allocator_->Allocate(padded * sizeof(float), runtime::MemoryCategory::kGathered));
  std::fill(grads_, grads_ + padded, 0.0f);
}

void FlatUnit::ReduceGrads(comm::Communicator* shard, runtime::Stream& comm, train::CommStats* seconds) {
  comm.Enqueue([this, shard, seconds] {
    float* g = grad_.data();
    if (shard == nullptr) {
      for (int64_t i = 0; i < numel_; ++i) g[i] += grads_[i];
    } else {
      float* reduced =
          static_cast<float*>(allocator_->Allocate(size_t(shard_numel_) * sizeof(float), runtime::MemoryCategory::kComm));
      const Clock::time_point start = Clock::now();
      try {
        shard->ReduceScatter(grads_, reduced, size_t(shard_numel_), comm::DataType::kFloat32, comm::ReduceOp::kAverage)
            ->Wait();
      } catch (...) {
        allocator_->Free(reduced);
        throw;
      }
      seconds->reduce_scatter += SecondsSince(start);
      for (int64_t i = 0; i < shard_numel_; ++i) g[i] += reduced[i];
      allocator_->Free(reduced);
    }
    allocator_->Free(grads_);
    grads_ = nullptr;
  });
}

void FlatUnit::AllReduceReplicas(comm::Communicator* replica, runtime::Stream& comm, train::CommStats* seconds) {
  if (replica == nullptr) return;
  comm.Enqueue([this, replica, seconds] {
    const Clock::time_point start = Clock::now();
    replica->AllReduce(grad_.data(), grad_.data(), size_t(shard_numel_), comm::DataType::kFloat32,
                       comm::ReduceOp::kAverage)
        ->Wait();
    seconds->all_reduce += SecondsSince(start);
  });
}

void FlatUnit::ZeroShardGrads() { std::fill(grad_.begin(), grad_.end(), 0.0f); }

double FlatUnit::ShardGradSquares(bool tp_replicated) const {
  double squares = 0;
  for (const Segment& seg : segments_) {
    if (seg.tp_replicated && !tp_replicated) continue;
    for (int64_t i = seg.offset; i < seg.offset + seg.size; ++i) squares += double(grad_[size_t(i)]) * grad_[size_t(i)];
  }
  return squares;
}

void FlatUnit::Update(const train::OptimizerStep& s, float clip_scale) {
  if (clip_scale != 1.0f) {
    for (float& g : grad_) g *= clip_scale;
  }
  for (const Segment& seg : segments_) {
    kernels::cpu::AdamWUpdate(master_.data() + seg.offset, grad_.data() + seg.offset, m_.data() + seg.offset,
                              v_.data() + seg.offset, seg.size, s.learning_rate, s.beta1, s.beta2, s.epsilon,
                              seg.decay ? s.weight_decay : 0.0f, s.t);
  }
}

}  // namespace meshtrain::parallel
