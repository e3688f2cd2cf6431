#include "worker/parallel/mesh.h"

namespace meshtrain::parallel {

Mesh::Mesh() : layout_(1, 1, 1, 1) {}

Mesh::Mesh(const api::ParallelLayout& layout, comm::Communicator* world, comm::StreamCollectives* device_world,
           runtime::Backend* backend)
    : layout_(layout) {
  const int rank = world == nullptr ? 0 : world->rank();
  const api::LayoutCoord at = layout.CoordOf(rank);
  shard_rank_ = at.shard;
  tp_rank_ = at.tp;
  replica_index_ = at.replica;
  data_parallel_rank_ = layout.DataParallelRankOf(rank);
  if (world == nullptr) return;
  // Every rank splits the axes in the same order, so the groups form alike everywhere.
  struct Axis {
    int size;
    api::Axis axis;
    std::unique_ptr<comm::Communicator>* host;
    std::unique_ptr<comm::StreamCollectives>* device;
  };
  for (const Axis& a : {Axis{layout.tp(), api::Axis::kTensor, &tp_, &device_tp_},
                        Axis{layout.shard(), api::Axis::kShard, &shard_, &device_shard_},
                        Axis{layout.replicas(), api::Axis::kReplica, &replica_, &device_replica_}}) {
    if (a.size <= 1) continue;
    *a.host = world->SplitAxis(layout, a.axis);
    *a.device = device_world != nullptr ? device_world->SplitAxis(layout, a.axis)
                                        : comm::HostCollectives(a.host->get(), backend);
  }
}

std::string Mesh::Describe() const {
  std::string text = std::to_string(layout_.replicas()) + (layout_.replicas() == 1 ? " replica x " : " replicas x ") +
                     std::to_string(layout_.shard()) + (layout_.shard() == 1 ? " shard" : " shards") + " x tp " +
                     std::to_string(layout_.tp());
  if (tp_) text += ", " + tp_->group().name();
  if (shard_) text += ", " + shard_->group().name();
  if (replica_) text += ", " + replica_->group().name();
  return text;
}

}  // namespace meshtrain::parallel
