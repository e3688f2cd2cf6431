// The groups of one rank's place in the layout (DESIGN.md, "The parallel layout"): its
// tensor-parallel group (the T ranks that split each layer), its shard group (the S
// ranks that split each FSDP unit of the same TP slice) and its replica group (the R
// ranks holding the same shard). Each group comes twice: as stream-ordered collectives on
// device memory (the engine's steps), and as a host Communicator (what runs outside
// steps: assembling the whole model, sampling). A group of one rank has neither: the
// engine then moves nothing.
//
// On the CPU the device groups are the host groups seen through HostCollectives; on GPUs
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
  // A single rank: S = R = T = 1.
  Mesh();
  // This rank's groups of `layout`. REQUIRES: `world` (null for one rank) is the layout's
  // world and outlives the Mesh, as does `device_world` (null: the host groups through
  // HostCollectives with `backend`'s copies); every rank of the world constructs its Mesh
  // at the same point.
  Mesh(const api::ParallelLayout& layout, comm::Communicator* world, comm::StreamCollectives* device_world,
       runtime::Backend* backend);

  const api::ParallelLayout& layout() const { return layout_; }
  int tp_size() const { return layout_.tp(); }
  int tp_rank() const { return tp_rank_; }
  // Which slice of each global batch this rank reads (the ranks of a TP group the same).
  int data_parallel_rank() const { return data_parallel_rank_; }
  int data_parallel_size() const { return layout_.data_parallel(); }
  int shard_size() const { return layout_.shard(); }
  int shard_rank() const { return shard_rank_; }
  int replicas() const { return layout_.replicas(); }
  int replica_index() const { return replica_index_; }
  // Null when the group has one rank.
  comm::Communicator* tp() const { return tp_.get(); }
  comm::Communicator* shard() const { return shard_.get(); }
  comm::Communicator* replica() const { return replica_.get(); }
  comm::StreamCollectives* device_tp() const { return device_tp_.get(); }
  comm::StreamCollectives* device_shard() const { return device_shard_.get(); }
  comm::StreamCollectives* device_replica() const { return device_replica_.get(); }
  // "2 replicas x 4 shards x tp 2, tp{0-1}, shard{0-6 step 2}, replica{0,8}"
  std::string Describe() const;

 private:
  api::ParallelLayout layout_;
  int shard_rank_ = 0, tp_rank_ = 0, replica_index_ = 0, data_parallel_rank_ = 0;
  std::unique_ptr<comm::Communicator> tp_, shard_, replica_;
  std::unique_ptr<comm::StreamCollectives> device_tp_, device_shard_, device_replica_;
};

}  // namespace meshtrain::parallel
