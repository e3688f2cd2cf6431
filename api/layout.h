// The parallel layout: world = R x S x T (DESIGN.md, "The parallel layout").
//
//   T = tensorParallelDegree
//   S = hybridShardDegree, 0 meaning every data-parallel rank (world / T)
//   R = world / (S * T) replicas
//
// Ranks are numbered TP fastest, then shard, then replica: rank = (r*S + s)*T + t.
// Node n holds ranks [n*G, (n+1)*G). So a TP group sits inside one node, and a
// shard group covers S*T/G whole neighbouring nodes (or several groups share a node).
//
// ParallelLayout is an immutable value; safe to share between threads.

#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "api/field_error.h"
#include "api/training_job.h"

namespace meshtrain::api {

enum class Axis { kTensor, kShard, kReplica };
const char* AxisName(Axis axis);  // "tp", "shard", "replica"

struct LayoutCoord {
  int replica = 0;
  int shard = 0;
  int tp = 0;
  bool operator==(const LayoutCoord&) const = default;
};

class ParallelLayout {
 public:
  // The problems with these sizes, with their spec field paths; empty if they form a layout.
  static FieldErrors Check(int64_t nodes, int64_t gpus_per_node, int64_t tensor_parallel_degree,
                           int64_t hybrid_shard_degree);

  // Throws std::invalid_argument with Check()'s messages if the sizes do not form a layout.
  ParallelLayout(int64_t nodes, int64_t gpus_per_node, int64_t tensor_parallel_degree,
                 int64_t hybrid_shard_degree);
  static ParallelLayout ForSpec(const TrainingJobSpec& spec);

  int world() const { return nodes_ * gpus_per_node_; }
  int nodes() const { return nodes_; }
  int gpus_per_node() const { return gpus_per_node_; }
  int tp() const { return tp_; }
  int shard() const { return shard_; }
  int replicas() const { return replicas_; }
  int data_parallel() const { return shard_ * replicas_; }
  int Degree(Axis axis) const;

  LayoutCoord CoordOf(int rank) const;
  int RankOf(LayoutCoord coord) const;
  // Which slice of each global batch `rank` reads: the ranks of one TP group read the same.
  int DataParallelRankOf(int rank) const { return rank / tp_; }
  int NodeOf(int rank) const { return rank / gpus_per_node_; }
  int LocalRankOf(int rank) const { return rank % gpus_per_node_; }

  // The members of `rank`'s group along `axis`, in increasing rank order.
  std::vector<int> GroupOf(Axis axis, int rank) const;
  // Every group along `axis`, ordered by their lowest rank.
  std::vector<std::vector<int>> Groups(Axis axis) const;

  // Whole nodes one shard group spans (1 when several groups share a node).
  int NodesPerShardGroup() const;

 private:
  int nodes_;
  int gpus_per_node_;
  int tp_;
  int shard_;
  int replicas_;
};

// Tokens all data-parallel ranks process in one micro-step:
// microBatchSize x seqLen x data-parallel size. REQUIRES: a defaulted spec with a valid layout.
int64_t TokensPerMicroStep(const TrainingJobSpec& spec);
// Micro-steps (gradient accumulation) per optimizer step: globalBatchTokens / TokensPerMicroStep.
int64_t AccumulationSteps(const TrainingJobSpec& spec);

// "0-7", "0,8,16" or "0-120 step 8": a compact, exact rendering of a rank list.
std::string FormatRanks(const std::vector<int>& ranks);

}  // namespace meshtrain::api
