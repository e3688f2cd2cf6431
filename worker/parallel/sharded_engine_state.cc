// ShardedEngine's state in and out of host memory, outside steps: the whole model's
// weights, a checkpoint's snapshot of this rank's shards, and restores into them.

#include <algorithm>
#include <type_traits>

#include "worker/parallel/sharded_engine.h"

namespace meshtrain::parallel {

template <class P>
std::vector<float> ShardedEngine<P>::Weights() {
  ReleaseHeld();
  Drain();
  // This rank's TP slice, each unit gathered over its shard group.
  std::vector<G> local(size_t(layout_.total()));
  std::vector<G> shard, unit_whole;
  for (FlatUnit<P>* unit : Held(true)) {
    shard.resize(size_t(unit->shard_numel()));
    backend_->Download(shard.data(), Ptr<const G>(unit->master()), unit->shard_numel(), *compute_);
    Drain();
    const G* from = shard.data();
    if (comm::Communicator* group = unit->experts_split() ? mesh_->expert_shard() : mesh_->shard()) {
      unit_whole.resize(size_t(unit->padded_numel()));
      group->AllGather(shard.data(), unit_whole.data(), shard.size(), comm::DataTypeOf<G>())->Wait();
      from = unit_whole.data();
    }
    std::copy(from, from + unit->numel(), local.begin() + unit->begin());
  }
  // Each slice in its place of the whole model (the tensors every rank holds whole from
  // TP rank 0, and every tensor but the experts' from expert rank 0), summed over the TP
  // and expert groups: every element comes from one rank.
  std::vector<G> whole(size_t(layout_.shape().ParameterCount()), G(0));
  for (const model::ParamTensor& t : layout_.tensors()) {
    if (t.tp_replicated() && mesh_->tp_rank() != 0) continue;
    if (!t.expert && mesh_->expert_rank() != 0) continue;
    const std::vector<int64_t> at = layout_.WholeIndices(t.offset, t.offset + t.size);
    for (size_t i = 0; i < at.size(); ++i) {
      if (at[i] >= 0) whole[size_t(at[i])] = local[size_t(t.offset) + i];
    }
  }
  if (comm::Communicator* group = mesh_->expert()) {
    group->AllReduce(whole.data(), whole.data(), whole.size(), comm::DataTypeOf<G>(), comm::ReduceOp::kSum)->Wait();
  }
  if (comm::Communicator* group = mesh_->tp()) {
    group->AllReduce(whole.data(), whole.data(), whole.size(), comm::DataTypeOf<G>(), comm::ReduceOp::kSum)->Wait();
  }
  // And each stage's in its place: every element comes from one stage.
  if (comm::Communicator* group = mesh_->pipeline()) {
    group->AllReduce(whole.data(), whole.data(), whole.size(), comm::DataTypeOf<G>(), comm::ReduceOp::kSum)->Wait();
  }
  return std::vector<float>(whole.begin(), whole.end());
}

template <class P>
void ShardedEngine<P>::Snapshot(ShardState* into) {
  ReleaseHeld();
  Drain();
  const std::vector<FlatUnit<P>*> held = Held(true);
  int64_t total = 0;
  for (FlatUnit<P>* unit : held) {
    for (const auto& [a, b] : unit->model_runs()) total += b - a;
  }
  if (into->size != total || into->storage == nullptr) {
    const runtime::MemorySource host = backend_->PinnedHostMemory();
    void* arrays = host.allocate(size_t(3 * total) * sizeof(float));
    if (arrays == nullptr) throw runtime::OutOfMemory("out of pinned host memory for a checkpoint snapshot");
    into->storage = std::shared_ptr<void>(arrays, host.free);
    into->size = total;
    into->master = static_cast<float*>(arrays);
    into->m = into->master + total;
    into->v = into->m + total;
  }
  into->tp_rank = mesh_->tp_rank();
  into->shard_rank = mesh_->shard_rank();
  into->replica = mesh_->replica_index();
  into->stage = mesh_->stage();
  into->expert_rank = mesh_->expert_rank();
  into->units.clear();
  for (FlatUnit<P>* unit : held) into->units.push_back(unit->index());
  // The model's elements of each shard, straight into the snapshot (fp64 through the host).
  std::vector<G> wide;
  int64_t at = 0;
  for (FlatUnit<P>* unit : held) {
    for (const auto& [a, b] : unit->model_runs()) {
      const int64_t n = b - a;
      const Ptr<G> from[3] = {unit->master(), unit->adam_m(), unit->adam_v()};
      float* to[3] = {into->master + at, into->m + at, into->v + at};
      for (int part = 0; part < 3; ++part) {
        if constexpr (std::is_same_v<G, float>) {
          backend_->Download(to[part], Ptr<const G>(from[part] + a), n, *compute_);
        } else {
          wide.resize(size_t(n));
          backend_->Download(wide.data(), Ptr<const G>(from[part] + a), n, *compute_);
          Drain();
          std::transform(wide.begin(), wide.end(), to[part], [](G x) { return float(x); });
        }
      }
      at += n;
    }
  }
  Drain();
}

template <class P>
void ShardedEngine<P>::Restore(const WholeState& whole) {
  RestoreShards(FillFrom(whole, layout_.shape().ParameterCount()));
}

template <class P>
void ShardedEngine<P>::RestoreShards(const ShardFill& fill) {
  ReleaseHeld();
  Drain();
  // One unit's shard staged at a time: the rank never holds more than its own state and
  // that unit's in host memory.
  std::vector<float> master, m, v;
  std::vector<G> narrow;
  for (FlatUnit<P>* held : Held(false)) {
    FlatUnit<P>& unit = *held;
    const int u = unit.index();
    const int64_t from = unit.begin() + unit.shard_begin(), n = unit.shard_numel();
    std::vector<int64_t> at = layout_.WholeIndices(from, from + unit.shard_real());
    at.resize(size_t(n), -1);  // the shard's tail past the unit is padding too
    for (std::vector<float>* part : {&master, &m, &v}) part->resize(size_t(n));
    fill(u, at, master.data(), m.data(), v.data());
    const std::pair<Ptr<G>, const std::vector<float>*> parts[3] = {
        {unit.master(), &master}, {unit.adam_m(), &m}, {unit.adam_v(), &v}};
    for (const auto& [to, values] : parts) {
      if constexpr (std::is_same_v<G, float>) {
        backend_->Upload(to, values->data(), n, *compute_);
      } else {
        narrow.assign(values->begin(), values->end());
        backend_->Upload(to, narrow.data(), n, *compute_);
        Drain();  // `narrow` is refilled for the next part
      }
    }
    Drain();  // the host vectors are refilled for the next unit
  }
  RefreshKept();
}

template std::vector<float> ShardedEngine<kernels::Fp32>::Weights();
template void ShardedEngine<kernels::Fp32>::Snapshot(ShardState* into);
template void ShardedEngine<kernels::Fp32>::Restore(const WholeState& whole);
template void ShardedEngine<kernels::Fp32>::RestoreShards(const ShardFill& fill);
template std::vector<float> ShardedEngine<kernels::Bf16>::Weights();
template void ShardedEngine<kernels::Bf16>::Snapshot(ShardState* into);
template void ShardedEngine<kernels::Bf16>::Restore(const WholeState& whole);
template void ShardedEngine<kernels::Bf16>::RestoreShards(const ShardFill& fill);
template std::vector<float> ShardedEngine<kernels::Fp64>::Weights();
template void ShardedEngine<kernels::Fp64>::Snapshot(ShardState* into);
template void ShardedEngine<kernels::Fp64>::Restore(const WholeState& whole);
template void ShardedEngine<kernels::Fp64>::RestoreShards(const ShardFill& fill);

}  // namespace meshtrain::parallel
