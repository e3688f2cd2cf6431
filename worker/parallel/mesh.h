// The communicators of one rank's place in the layout (DESIGN.md, "The parallel layout"):
// its shard group (the S ranks that split each FSDP unit) and its replica group (the R
// ranks holding the same shard). A group of one rank has no communicator: the engine
// then moves nothing.
//
// Thread-safety: the communicators follow comm/communicator.h; Mesh itself is not
// changed after construction.

#pragma once

#include <memory>
#include <string>

#include "api/layout.h"
#include "worker/comm/communicator.h"

namespace meshtrain::parallel {

class Mesh {
 public:
  // A single rank: S = R = T = 1.
  Mesh();
  // This rank's groups of `layout`. REQUIRES: `world` (null for one rank) is the layout's
  // world and outlives the Mesh; the layout has no tensor parallelism (the Trainer
  // refuses it); every rank of the world constructs its Mesh at the same point.
  Mesh(const api::ParallelLayout& layout, comm::Communicator* world);

  const api::ParallelLayout& layout() const { return layout_; }
  int shard_size() const { return layout_.shard(); }
  int shard_rank() const { return shard_rank_; }
  int replicas() const { return layout_.replicas(); }
  // Null when the group has one rank.
  comm::Communicator* shard() const { return shard_.get(); }
  comm::Communicator* replica() const { return replica_.get(); }
  // "2 replicas x 4 shards (tp 1): shard{0-3}, replica{0,4}"
  std::string Describe() const;

 private:
  api::ParallelLayout layout_;
  int shard_rank_ = 0;
  std::unique_ptr<comm::Communicator> shard_, replica_;
};

}  // namespace meshtrain::parallel
