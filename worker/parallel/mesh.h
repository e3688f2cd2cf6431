// The groups of one rank's place in the layout (docs/design.md, "The parallel layout"): its
// tensor-parallel group (the T ranks that split each layer), its context group (the C
// ranks that split each sequence), its shard group (the S x C ranks that split each FSDP
// unit of the same TP slice), its replica group (the R ranks holding the same shard) and
// its pipeline group (the P ranks of the same coordinate on every stage). Each group comes twice: as stream-ordered collectives on device memory
// (the engine's steps), and as a host Communicator (what runs outside steps: assembling
// the whole model, sampling). A group of one rank has neither: the engine then moves
// nothing.
//
// With expert parallelism (EP > 1) a rank also has its expert group (the EP shard ranks
// that split the experts, api/layout.h) twice, once for the tokens' all-to-alls on the
// compute stream and once for the gradients on the comm stream, so that the two streams
// never share a group; and the expert-shard group that shards the units holding experts.
//
// Pipeline stages also get links to their neighbours, device groups of two (the same
// coordinate on stages p and p+1), each used in one direction only: activations flow
// forward (send_next, recv_prev), their gradients backward (send_prev, recv_next), so
// that traffic in the two directions between one pair never shares a group (two members
// sending to each other over one group may deadlock, stream_collectives.h). With
// wrap_stages the last stage links to the first as to a next stage (the interleaved
// schedule's loop). And the two ends of a pipeline (stages 0 and P-1) share a group of
// their own, for a tied embedding's two copies.
//
// On the CPU the device groups are host groups seen through HostCollectives; on GPUs
// with NCCL they are NCCL's, split from the device world.
// Thread-safety: the groups follow their own contracts; Mesh itself is not changed after
// construction.

#pragma once

#include <memory>
#include <string>

#include "api/layout.h"
#include "worker/comm/communicator.h"
#include "worker/comm/stream_collectives.h"
#include "worker/runtime/backend.h"

namespace meshtrain::parallel {

class Mesh {
 public:
  // A single rank: P = S = R = T = 1.
  Mesh();
  // This rank's groups of `layout`. REQUIRES: `world` (null for one rank) is the layout's
  // world and outlives the Mesh, as does `device_world` (null: the host groups through
  // HostCollectives with `backend`'s copies); every rank of the world constructs its Mesh
  // at the same point, with the same `wrap_stages`, which adds the links from the last
  // stage to the first, and the same `data_group`, which adds a host group of the data
  // ranks (data()).
  Mesh(const api::ParallelLayout& layout, comm::Communicator* world, comm::StreamCollectives* device_world,
       runtime::Backend* backend, bool wrap_stages = false, bool data_group = false);

  const api::ParallelLayout& layout() const { return layout_; }
  int tp_size() const { return layout_.tp(); }
  int tp_rank() const { return tp_rank_; }
  // Which slice of each global batch this rank reads (the ranks of a TP group the same,
  // and the stages of a pipeline).
  int data_parallel_rank() const { return data_parallel_rank_; }
  int data_parallel_size() const { return layout_.data_parallel(); }
  int shard_size() const { return layout_.shard(); }  // S x C
  // Which part of each sequence this rank holds (api::ContextRows), of context_size().
  int context_size() const { return layout_.context(); }
  int context_rank() const { return context_rank_; }
  int shard_rank() const { return shard_rank_; }
  // Expert parallelism: this rank's place in its expert group, of expert_size(), and in
  // its expert-shard group, of shard_size() / expert_size().
  int expert_size() const { return layout_.expert(); }
  int expert_rank() const { return shard_rank_ % layout_.expert(); }
  int expert_shard_rank() const { return shard_rank_ / layout_.expert(); }
  int replicas() const { return layout_.replicas(); }
  int replica_index() const { return replica_index_; }
  int stages() const { return layout_.pipeline(); }
  int stage() const { return stage_; }
  bool wrap_stages() const { return wrap_stages_; }
  // Null when the group has one rank.
  comm::Communicator* tp() const { return tp_.get(); }
  comm::Communicator* shard() const { return shard_.get(); }
  comm::Communicator* replica() const { return replica_.get(); }
  comm::Communicator* pipeline() const { return pipeline_.get(); }
  comm::Communicator* context() const { return context_.get(); }
  comm::StreamCollectives* device_tp() const { return device_tp_.get(); }
  comm::StreamCollectives* device_shard() const { return device_shard_.get(); }
  comm::StreamCollectives* device_replica() const { return device_replica_.get(); }
  comm::StreamCollectives* device_context() const { return device_context_.get(); }
  comm::Communicator* expert() const { return expert_.get(); }
  // The R x S x C ranks of this stage and TP rank (api::Axis::kData), for host statistics
  // outside the streams: null without data_group, or with one such rank.
  comm::Communicator* data() const { return data_.get(); }
  comm::Communicator* expert_shard() const { return expert_shard_.get(); }
  comm::StreamCollectives* device_expert() const { return device_expert_.get(); }
  comm::StreamCollectives* device_expert_grads() const { return device_expert_grads_.get(); }
  comm::StreamCollectives* device_expert_shard() const { return device_expert_shard_.get(); }
  // The P ranks of this (replica, shard, tp) coordinate, stage by stage.
  comm::StreamCollectives* device_pipeline() const { return device_pipeline_.get(); }
  // Stage 0's and stage P-1's rank of this coordinate, in that order ("ends{0,24}"): null
  // when P = 1 or this rank is on neither end. For P = 2 a group of its own beside the
  // links between the same two ranks.
  comm::StreamCollectives* device_ends() const { return device_ends_.get(); }

  // A neighbouring stage: the two-member group to it, used in one direction only, and
  // the neighbour's rank in that group. group is null where there is no such neighbour
  // (the first stage's previous and the last stage's next, unless wrap_stages).
  struct StageLink {
    comm::StreamCollectives* group = nullptr;
    int peer = -1;
  };
  // Activations: this rank sends to the same coordinate on stage p+1 (with wrap_stages,
  // stage P-1 sends to stage 0) and receives from stage p-1 (stage 0 from P-1).
  StageLink send_next() const { return Link(send_next_); }
  StageLink recv_prev() const { return Link(recv_prev_); }
  // Their gradients, the other way: to stage p-1 (stage 0 to P-1), from stage p+1.
  StageLink send_prev() const { return Link(send_prev_); }
  StageLink recv_next() const { return Link(recv_next_); }

  // "2 stages x 2 replicas x 4 shards x tp 2, tp{0-1}, shard{0-6 step 2}, replica{0,8},
  // pipeline{0,16}" (stages only when P > 1; "x context 2" and its group when C > 1)
  std::string Describe() const;

 private:
  static StageLink Link(const std::unique_ptr<comm::StreamCollectives>& group) {
    return group == nullptr ? StageLink{} : StageLink{group.get(), 1 - group->rank()};
  }
  void BuildStageGroups(comm::StreamCollectives& splitter);

  api::ParallelLayout layout_;
  int shard_rank_ = 0, tp_rank_ = 0, replica_index_ = 0, data_parallel_rank_ = 0, stage_ = 0, context_rank_ = 0;
  bool wrap_stages_ = false;
  std::unique_ptr<comm::Communicator> tp_, shard_, replica_, pipeline_, context_, expert_, expert_shard_, data_;
  std::unique_ptr<comm::StreamCollectives> device_tp_, device_shard_, device_replica_, device_pipeline_,
      device_context_, device_expert_, device_expert_grads_, device_expert_shard_;
  std::unique_ptr<comm::StreamCollectives> device_ends_, send_next_, recv_prev_, send_prev_, recv_next_;
};

}  // namespace meshtrain::parallel
