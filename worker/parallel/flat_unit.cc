#include "worker/parallel/flat_unit.h"

#include <algorithm>
#include <stdexcept>

#include "api/engine_memory.h"

namespace meshtrain::parallel {

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

template <class P>
FlatUnit<P>::FlatUnit(const model::ParameterLayout& layout, int index, int shard_size, int shard_rank, uint64_t seed,
                      bool counts_replicated, runtime::CachingAllocator* allocator, runtime::Backend& backend,
                      Ptr<kernels::ShardSegment> segments, runtime::Stream& stream)
    : index_(index),
      shard_size_(shard_size),
      shard_rank_(shard_rank),
      shard_(ShardOfUnit(layout, index, shard_size, shard_rank)),
      segments_(segments),
      ready_(backend.NewEvent()),
      backward_done_(backend.NewEvent()) {
  using runtime::MemoryCategory;
  if (layout.ep_size() > 1 && layout.UnitHasExperts(index)) {
    expert_size_ = layout.ep_size();
    before_experts_ = layout.ExpertsInUnit();
  }
  const int64_t n = shard_.shard_numel;
  master_ = runtime::DeviceArray<G>(allocator, n, MemoryCategory::kParams);
  grads_ = runtime::DeviceArray<G>(allocator, n, MemoryCategory::kGrads);
  m_ = runtime::DeviceArray<G>(allocator, n, MemoryCategory::kOptimizer);
  v_ = runtime::DeviceArray<G>(allocator, n, MemoryCategory::kOptimizer);
  const int64_t from = shard_.unit_begin + shard_.begin, to = from + shard_.real;
  for (const auto& [a, b] : layout.RealRanges(from, to)) model_runs_.emplace_back(a - from, b - from);

  // The shard's initial weights (zero in every padding), computed here and uploaded.
  static thread_local std::vector<G> host;
  host.assign(size_t(n), G(0));
  model::InitParameterRange(host.data(), layout, seed, from, to);
  backend.Upload(master_.get(), host.data(), n, stream);
  for (const Ptr<G> zeroed : {grads_.get(), m_.get(), v_.get()}) backend.Zero(zeroed, n, stream);

  static thread_local std::vector<kernels::ShardSegment> table;
  table.clear();
  for (const model::ParamTensor& t : layout.tensors()) {
    const int64_t a = std::max(from, t.offset), b = std::min(to, t.offset + t.real);
    if (a >= b) continue;
    const bool counted = (!t.tp_replicated() || counts_replicated) && (t.expert || !experts_split() || layout.ep_rank() == 0);
    table.push_back({a - from, b - a, t.decay ? 1 : 0, counted ? 1 : 0});
  }
  segment_count_ = int(table.size());
  backend.Upload(segments_, table.data(), int64_t(table.size()), stream);
  stream.Synchronize();  // the host buffers are reused by the next unit
}

template <class P>
void FlatUnit<P>::Gather(Ptr<A> slot, comm::StreamCollectives* shard, kernels::Ops<P>& ops, runtime::Stream& comm) {
  const int64_t n = shard_.shard_numel;
  const Ptr<A> mine = slot + int64_t(shard_rank_) * n;
  ops.Cast(mine, master_.get(), n, comm);
  if (shard != nullptr) comm::AllGather<A>(*shard, mine, slot, size_t(n), comm);
  ready_->Record(comm);
}

template <class P>
void FlatUnit<P>::ReduceGrads(Ptr<G> unsharded, Ptr<G> reduced, comm::StreamCollectives* shard, kernels::Ops<P>& ops,
                              runtime::Stream& comm, comm::StreamCollectives* experts) {
  const int64_t n = shard_.shard_numel;
  if (!experts_split()) {
    if (shard == nullptr) return;  // the backward added into the shard's gradients
    comm::ReduceScatter<G>(*shard, unsharded, reduced, size_t(n), comm::ReduceOp::kAverage, comm);
    ops.Accumulate(grads_.get(), reduced, n, 1.0f, comm);
    return;
  }
  if (experts == nullptr) throw std::logic_error("FlatUnit: a unit whose experts are split needs the expert group");
  Ptr<G> mine = unsharded;  // one rank holds the shard: the unsharded gradients are it
  if (shard != nullptr) {
    comm::ReduceScatter<G>(*shard, unsharded, reduced, size_t(n), comm::ReduceOp::kAverage, comm);
    mine = reduced;
  }
  const int64_t alike = std::clamp<int64_t>(before_experts_ - shard_.begin, 0, n);
  if (alike > 0) comm::AllReduce<G>(*experts, mine, size_t(alike), comm::ReduceOp::kSum, comm);
  ops.Accumulate(grads_.get(), mine, n, 1.0f / float(expert_size_), comm);
}

template <class P>
void FlatUnit<P>::AllReduceReplicas(comm::StreamCollectives* replica, runtime::Stream& comm) {
  if (replica == nullptr) return;
  comm::AllReduce<G>(*replica, grads_.get(), size_t(shard_.shard_numel), comm::ReduceOp::kAverage, comm);
}

template <class P>
void FlatUnit<P>::ZeroShardGrads(runtime::Backend& backend, runtime::Stream& stream) {
  backend.Zero(grads_.get(), shard_.shard_numel, stream);
}

template <class P>
void FlatUnit<P>::AddSquares(Ptr<double> sum, kernels::Ops<P>& ops, runtime::Stream& stream) {
  ops.SumSquares(sum, grads_.get(), segments_, segment_count_, stream);
}

template <class P>
void FlatUnit<P>::Update(const kernels::AdamWStep& step, Ptr<const float> clip_scale, Ptr<A> params,
                         kernels::Ops<P>& ops, runtime::Stream& stream) {
  ops.AdamW(master_.get(), params, grads_.get(), m_.get(), v_.get(), segments_, segment_count_, step, clip_scale,
            stream);
}

template class FlatUnit<kernels::Fp32>;
template class FlatUnit<kernels::Bf16>;
template class FlatUnit<kernels::Fp64>;

}  // namespace meshtrain::parallel
