#include "worker/parallel/mesh.h"


namespace meshtrain::parallel {

Mesh::Mesh() : layout_(1, 1, 1, 1) {}

Mesh::Mesh(const api::ParallelLayout& layout, comm::Communicator* world) : layout_(layout) {
  const int rank = world == nullptr ? 0 : world->rank();
  const api::LayoutCoord at = layout.CoordOf(rank);
  shard_rank_ = at.shard;
  tp_rank_ = at.tp;
  replica_index_ = at.replica;
  data_parallel_rank_ = layout.DataParallelRankOf(rank);
  // Every rank splits the axes in the same order, so the groups form alike everywhere.
  if (world != nullptr && layout.tp() > 1) tp_ = world->SplitAxis(layout, api::Axis::kTensor);
  if (world != nullptr && layout.shard() > 1) shard_ = world->SplitAxis(layout, api::Axis::kShard);
  if (world != nullptr && layout.replicas() > 1) replica_ = world->SplitAxis(layout, api::Axis::kReplica);
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
