// The parallel layout: world = P x R x S x C x T (docs/design.md, "The parallel layout").
//
//   P = pipelineParallelDegree: stages, each holding consecutive blocks of the model
//   T = tensorParallelDegree
//   C = contextParallelDegree: ranks that split each sequence (context parallelism)
//   S = hybridShardDegree, 0 meaning every data-parallel rank of a stage (world / (P * C * T))
//   R = world / (P * S * C * T) replicas
//
// Ranks are numbered TP fastest, then context, then shard, then replica, then stage
// (outermost; Megatron's tp-cp-dp-pp order): rank = (((p*R + r)*S + s)*C + c)*T + t.
// Node n holds ranks [n*G, (n+1)*G). So a TP group sits inside one node, a context group
// next to it, a shard group covers S*C*T/G whole neighbouring nodes (or several groups
// share a node), and a stage R*S*C*T/G of them: when stages fill whole nodes, only
// activations and their gradients cross between them.
//
// FSDP shards parameters over the S x C ranks of a (stage, replica, TP rank), as
// torchtitan does: the context ranks hold different tokens of the same sequences, so
// their gradients are reduced together. shard() is that group's size, S x C, and the
// layout's shard coordinate is s*C + c; the S x R data-parallel ranks read different
// sequences.
//
// Expert parallelism (EP = expertParallelDegree) splits each mixture-of-experts block's
// experts over EP consecutive shard coordinates (an expert group, inside one shard group
// and so in one node where it fits): member j holds experts [j E/EP, (j+1) E/EP), and the
// units that hold experts are sharded over the S x C / EP ranks of the shard group that
// hold the same ones (the expert-shard group: shard coordinates j, j + EP, ...).
//
// ParallelLayout is an immutable value; safe to share between threads.

#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "api/field_error.h"
#include "api/training_job.h"

namespace meshtrain::api {

// kShard: FSDP's group, S x C ranks; kContext: the C ranks that split each sequence;
// kExpert: the EP consecutive shard coordinates that split the experts; kExpertShard: the
// S x C / EP shard coordinates that hold the same experts; kData: the R x S x C ranks of a
// stage and TP rank, every one with its own tokens.
enum class Axis { kTensor, kShard, kReplica, kPipeline, kContext, kExpert, kExpertShard, kData };
// "tp", "shard", "replica", "pipeline", "context", "expert", "expert-shard", "data"
const char* AxisName(Axis axis);

struct LayoutCoord {
  int replica = 0;
  int shard = 0;  // s*C + c: the place in FSDP's group
  int tp = 0;
  int pipeline = 0;  // the stage
  bool operator==(const LayoutCoord&) const = default;
};

class ParallelLayout {
 public:
  // The problems with these sizes, with their spec field paths; empty if they form a layout.
  static FieldErrors Check(int64_t nodes, int64_t gpus_per_node, int64_t tensor_parallel_degree,
                           int64_t hybrid_shard_degree, int64_t pipeline_parallel_degree = 1,
                           int64_t context_parallel_degree = 1, int64_t expert_parallel_degree = 1);

  // Throws std::invalid_argument with Check()'s messages if the sizes do not form a layout.
  ParallelLayout(int64_t nodes, int64_t gpus_per_node, int64_t tensor_parallel_degree,
                 int64_t hybrid_shard_degree, int64_t pipeline_parallel_degree = 1,
                 int64_t context_parallel_degree = 1, int64_t expert_parallel_degree = 1);
  static ParallelLayout ForSpec(const TrainingJobSpec& spec);

  int world() const { return nodes_ * gpus_per_node_; }
  int nodes() const { return nodes_; }
  int gpus_per_node() const { return gpus_per_node_; }
  int tp() const { return tp_; }
  int shard() const { return shard_; }  // S x C: the ranks that shard each FSDP unit
  int context() const { return context_; }
  int expert() const { return expert_; }  // EP: the ranks that split each block's experts
  // Which expert group member `rank` is: it holds experts [j E/EP, (j+1) E/EP).
  int ExpertRankOf(int rank) const { return CoordOf(rank).shard % expert_; }
  int replicas() const { return replicas_; }
  int pipeline() const { return pipeline_; }
  int data_parallel() const { return shard_ / context_ * replicas_; }  // S x R: ranks reading different sequences
  int stage_ranks() const { return world() / pipeline_; }  // R x S x C x T
  int Degree(Axis axis) const;

  LayoutCoord CoordOf(int rank) const;
  int RankOf(LayoutCoord coord) const;
  // Which slice of each global batch `rank` reads: the ranks of one TP group read the same,
  // and so do the stages of one pipeline and the ranks of one context group.
  int DataParallelRankOf(int rank) const { return (rank / (tp_ * context_)) % data_parallel(); }
  // Which part of each sequence `rank` holds (0 .. C-1; ContextRows).
  int ContextRankOf(int rank) const { return (rank / tp_) % context_; }
  int StageOf(int rank) const { return rank / stage_ranks(); }
  int NodeOf(int rank) const { return rank / gpus_per_node_; }
  int LocalRankOf(int rank) const { return rank % gpus_per_node_; }

  // The members of `rank`'s group along `axis`, in increasing rank order.
  std::vector<int> GroupOf(Axis axis, int rank) const;
  // Every group along `axis`, ordered by their lowest rank.
  std::vector<std::vector<int>> Groups(Axis axis) const;

  // Whole nodes one shard group spans (1 when several groups share a node).
  int NodesPerShardGroup() const;
  // Whole nodes one stage spans (1 when several stages share a node).
  int NodesPerStage() const;

 private:
  int nodes_;
  int gpus_per_node_;
  int tp_;
  int shard_;
  int replicas_;
  int pipeline_ = 1;
  int context_ = 1;
  int expert_ = 1;
};

// The rows of a sequence of `seq` tokens that context rank `rank` of `size` holds, in
// order: of the sequence cut into 2 x size chunks, chunks rank and 2 x size - 1 - rank,
// so that every rank has the same share of causal attention's work. REQUIRES: 2 x size
// divides seq. first[j] is the first position of local chunk j (0, 1); each is seq / (2 x
// size) rows.
struct ContextRows {
  int64_t chunk = 0;     // rows of a chunk
  int64_t first[2] = {};  // the positions its two chunks start at
  ContextRows(int64_t seq, int rank, int size);
  int64_t rows() const { return 2 * chunk; }
  // The position in the sequence of local row i (0 <= i < rows()).
  int64_t Position(int64_t i) const { return i < chunk ? first[0] + i : first[1] + i - chunk; }
};

// Tokens all data-parallel ranks process in one micro-step:
// microBatchSize x seqLen x data-parallel size. REQUIRES: a defaulted spec with a valid layout.
int64_t TokensPerMicroStep(const TrainingJobSpec& spec);
// Micro-steps (gradient accumulation) per optimizer step: globalBatchTokens / TokensPerMicroStep.
int64_t AccumulationSteps(const TrainingJobSpec& spec);

// "0-7", "0,8,16" or "0-120 step 8": a compact, exact rendering of a rank list.
std::string FormatRanks(const std::vector<int>& ranks);

}  // namespace meshtrain::api
