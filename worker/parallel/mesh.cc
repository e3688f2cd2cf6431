#include "worker/parallel/mesh.h"

#include <utility>
#include <vector>

namespace meshtrain::parallel {

Mesh::Mesh() : layout_(1, 1, 1, 1) {}

Mesh::Mesh(const api::ParallelLayout& layout, comm::Communicator* world, comm::StreamCollectives* device_world,
           runtime::Backend* backend, bool wrap_stages, bool data_group)
    : layout_(layout), wrap_stages_(wrap_stages) {
  const int rank = world == nullptr ? 0 : world->rank();
  const api::LayoutCoord at = layout.CoordOf(rank);
  shard_rank_ = at.shard;
  tp_rank_ = at.tp;
  replica_index_ = at.replica;
  stage_ = at.pipeline;
  data_parallel_rank_ = layout.DataParallelRankOf(rank);
  context_rank_ = layout.ContextRankOf(rank);
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
                        Axis{layout.replicas(), api::Axis::kReplica, &replica_, &device_replica_},
                        Axis{layout.pipeline(), api::Axis::kPipeline, &pipeline_, &device_pipeline_},
                        Axis{layout.context(), api::Axis::kContext, &context_, &device_context_},
                        Axis{layout.expert(), api::Axis::kExpert, &expert_, &device_expert_},
                        Axis{layout.shard() / layout.expert(), api::Axis::kExpertShard, &expert_shard_,
                             &device_expert_shard_}}) {
    if (a.size <= 1) continue;
    *a.host = world->SplitAxis(layout, a.axis);
    *a.device = device_world != nullptr ? device_world->SplitAxis(layout, a.axis)
                                        : comm::HostCollectives(a.host->get(), backend);
  }
  if (data_group && layout.Degree(api::Axis::kData) > 1) data_ = world->SplitAxis(layout, api::Axis::kData);
  if (layout.expert() > 1) {  // the gradients' expert group, apart from the tokens'
    const std::vector<std::vector<int>> groups = layout.Groups(api::Axis::kExpert);
    device_expert_grads_ = device_world != nullptr
                               ? device_world->SplitGroups(groups, "expert.grads")
                               : comm::HostCollectives(world, backend)->SplitGroups(groups, "expert.grads");
  }
  if (layout.pipeline() <= 1) return;
  if (device_world != nullptr) {
    BuildStageGroups(*device_world);
  } else {  // the world's host SplitGroups: a NewGroup of the world for every pair
    BuildStageGroups(*comm::HostCollectives(world, backend));
  }
}

// The ends and the links, from at most seven splits of the world, each for every
// coordinate at once (ncclCommSplit is a collective of the whole world): the ends; then
// for activations and for gradients in turn the pairs of stages (p, p+1) with p even,
// those with p odd, and with wrap_stages the pair (P-1, 0). The pairs of one split are
// disjoint, so each rank is in at most one group of each.
void Mesh::BuildStageGroups(comm::StreamCollectives& splitter) {
  const int stages = layout_.pipeline();
  // Every coordinate's ranks, stage by stage.
  std::vector<std::vector<int>> pipelines;
  for (int i = 0; i < layout_.stage_ranks(); ++i) pipelines.push_back(layout_.GroupOf(api::Axis::kPipeline, i));
  // For every coordinate, the pair of its ranks on stages a < b.
  auto pairs = [&](int a, int b) {
    std::vector<std::vector<int>> lists;
    for (const std::vector<int>& ranks : pipelines) lists.push_back({ranks[size_t(a)], ranks[size_t(b)]});
    return lists;
  };
  device_ends_ = splitter.SplitGroups(pairs(0, stages - 1), "ends");
  for (const bool forward : {true, false}) {
    for (const int parity : {0, 1}) {
      std::vector<std::vector<int>> lists;
      for (int p = parity; p + 1 < stages; p += 2) {
        for (std::vector<int>& pair : pairs(p, p + 1)) lists.push_back(std::move(pair));
      }
      if (lists.empty()) continue;  // P = 2 has no odd pair: no rank splits for one
      std::unique_ptr<comm::StreamCollectives> link = splitter.SplitGroups(lists, forward ? "forward" : "backward");
      if (link == nullptr) continue;
      const bool lower = stage_ % 2 == parity;  // this rank is stage p of the pair, not p+1
      if (forward) {
        (lower ? send_next_ : recv_prev_) = std::move(link);
      } else {
        (lower ? recv_next_ : send_prev_) = std::move(link);
      }
    }
    if (!wrap_stages_) continue;
    // Stage P-1 to stage 0 as to a next stage; in the group stage 0 is member 0.
    std::unique_ptr<comm::StreamCollectives> link =
        splitter.SplitGroups(pairs(0, stages - 1), forward ? "forward.wrap" : "backward.wrap");
    if (link == nullptr) continue;
    const bool first = stage_ == 0;
    if (forward) {
      (first ? recv_prev_ : send_next_) = std::move(link);
    } else {
      (first ? send_prev_ : recv_next_) = std::move(link);
    }
  }
}

std::string Mesh::Describe() const {
  std::string text;
  if (layout_.pipeline() > 1) text = std::to_string(layout_.pipeline()) + " stages x ";
  text += std::to_string(layout_.replicas()) + (layout_.replicas() == 1 ? " replica x " : " replicas x ") +
          std::to_string(layout_.shard()) + (layout_.shard() == 1 ? " shard" : " shards") + " x tp " +
          std::to_string(layout_.tp());
  if (layout_.context() > 1) text += " x context " + std::to_string(layout_.context());
  if (layout_.expert() > 1) text += " x experts split " + std::to_string(layout_.expert()) + " ways";
  if (tp_) text += ", " + tp_->group().name();
  if (context_) text += ", " + context_->group().name();
  if (expert_) text += ", " + expert_->group().name();
  if (shard_) text += ", " + shard_->group().name();
  if (replica_) text += ", " + replica_->group().name();
  if (pipeline_) text += ", " + pipeline_->group().name();
  return text;
}

}  // namespace meshtrain::parallel
