#include "api/layout.h"

#include <stdexcept>

namespace meshtrain::api {

// Bounds that keep every product below in int range and reject typos like 80000 GPUs per node.
inline constexpr int64_t kMaxNodes = 65536;
inline constexpr int64_t kMaxGpusPerNode = 64;

const char* AxisName(Axis axis) {
  switch (axis) {
    case Axis::kTensor: return "tp";
    case Axis::kShard: return "shard";
    case Axis::kReplica: return "replica";
    case Axis::kPipeline: return "pipeline";
    case Axis::kContext: return "context";
    case Axis::kExpert: return "expert";
    case Axis::kExpertShard: return "expert-shard";
    case Axis::kData: return "data";
  }
  return "?";
}

FieldErrors ParallelLayout::Check(int64_t nodes, int64_t gpus_per_node, int64_t tp, int64_t hybrid_shard,
                                  int64_t pipeline, int64_t context, int64_t expert) {
  FieldErrors errors;
  auto fail = [&](std::string path, std::string message) { errors.push_back({std::move(path), std::move(message)}); };
  if (nodes < 1 || nodes > kMaxNodes) {
    fail("spec.nodes", "must be between 1 and " + std::to_string(kMaxNodes) + ", got " + std::to_string(nodes));
  }
  if (gpus_per_node < 1 || gpus_per_node > kMaxGpusPerNode) {
    fail("spec.gpusPerNode",
         "must be between 1 and " + std::to_string(kMaxGpusPerNode) + ", got " + std::to_string(gpus_per_node));
  }
  if (tp < 1) fail("spec.parallelism.tensorParallelDegree", "must be at least 1, got " + std::to_string(tp));
  if (pipeline < 1) {
    fail("spec.parallelism.pipelineParallelDegree", "must be at least 1, got " + std::to_string(pipeline));
  }
  if (context < 1) {
    fail("spec.parallelism.contextParallelDegree", "must be at least 1, got " + std::to_string(context));
  }
  if (expert < 1) {
    fail("spec.parallelism.expertParallelDegree", "must be at least 1, got " + std::to_string(expert));
  }
  if (hybrid_shard < 0) {
    fail("spec.parallelism.hybridShardDegree",
         "must be 0 (all data-parallel ranks) or positive, got " + std::to_string(hybrid_shard));
  }
  if (!errors.empty()) return errors;

  const int64_t g = gpus_per_node;
  if (g % tp != 0) {
    fail("spec.parallelism.tensorParallelDegree",
         "must divide spec.gpusPerNode (" + std::to_string(g) + "), got " + std::to_string(tp));
    return errors;
  }
  const int64_t world = nodes * g;
  if (world % (pipeline * tp) != 0) {
    fail("spec.parallelism.pipelineParallelDegree",
         "must divide the world into stages of whole TP groups (" + std::to_string(world) +
             " GPUs / tensorParallelDegree " + std::to_string(tp) + " = " + std::to_string(world / tp) +
             " TP groups), got " + std::to_string(pipeline));
    return errors;
  }
  const int64_t stage = world / (pipeline * tp);  // a stage's TP groups
  const std::string stage_text = std::to_string(world) + " GPUs / tensorParallelDegree " + std::to_string(tp) +
                                 (pipeline > 1 ? " / pipelineParallelDegree " + std::to_string(pipeline) : "");
  if (stage % context != 0) {
    fail("spec.parallelism.contextParallelDegree",
         "must divide a stage's TP groups (" + stage_text + " = " + std::to_string(stage) + "), got " +
             std::to_string(context));
    return errors;
  }
  const int64_t dp = stage / context;
  const int64_t s = hybrid_shard == 0 ? dp : hybrid_shard;
  if (dp % s != 0) {
    fail("spec.parallelism.hybridShardDegree",
         "must divide the data-parallel size (" + stage_text +
             (context > 1 ? " / contextParallelDegree " + std::to_string(context) : "") + " = " + std::to_string(dp) +
             "), got " + std::to_string(hybrid_shard));
    return errors;
  }
  if ((s * context) % expert != 0) {
    fail("spec.parallelism.expertParallelDegree",
         "must divide the ranks of a shard group (hybridShardDegree " + std::to_string(s) +
             (context > 1 ? " x contextParallelDegree " + std::to_string(context) : "") + " = " +
             std::to_string(s * context) + "): an expert group is consecutive ranks of one, got " +
             std::to_string(expert));
    return errors;
  }
  const int64_t group_gpus = s * context * tp;
  if (group_gpus % g != 0 && g % group_gpus != 0) {
    fail("spec.parallelism.hybridShardDegree",
         "shard groups must tile whole nodes: hybridShardDegree x " +
             std::string(context > 1 ? "contextParallelDegree x " : "") + "tensorParallelDegree (" +
             std::to_string(group_gpus) + ") must divide or be a multiple of spec.gpusPerNode (" +
             std::to_string(g) + "), got " + std::to_string(hybrid_shard));
  }
  return errors;
}

ParallelLayout::ParallelLayout(int64_t nodes, int64_t gpus_per_node, int64_t tp, int64_t hybrid_shard,
                               int64_t pipeline, int64_t context, int64_t expert) {
  FieldErrors errors = Check(nodes, gpus_per_node, tp, hybrid_shard, pipeline, context, expert);
  if (!errors.empty()) {
    std::string message = "invalid parallel layout:";
    for (const FieldError& e : errors) message.append(" ").append(e.ToString()).append(";");
    throw std::invalid_argument(message);
  }
  nodes_ = int(nodes);
  gpus_per_node_ = int(gpus_per_node);
  tp_ = int(tp);
  pipeline_ = int(pipeline);
  context_ = int(context);
  const int dp = world() / (tp_ * pipeline_ * context_);
  shard_ = (hybrid_shard == 0 ? dp : int(hybrid_shard)) * context_;
  replicas_ = dp * context_ / shard_;
  expert_ = int(expert);
}

ParallelLayout ParallelLayout::ForSpec(const TrainingJobSpec& spec) {
  return ParallelLayout(spec.nodes, spec.gpus_per_node, spec.parallelism.tensor_parallel_degree,
                        spec.parallelism.hybrid_shard_degree, spec.parallelism.pipeline_parallel_degree,
                        spec.parallelism.context_parallel_degree, spec.parallelism.expert_parallel_degree);
}

int ParallelLayout::Degree(Axis axis) const {
  switch (axis) {
    case Axis::kTensor: return tp_;
    case Axis::kShard: return shard_;
    case Axis::kReplica: return replicas_;
    case Axis::kPipeline: return pipeline_;
    case Axis::kContext: return context_;
    case Axis::kExpert: return expert_;
    case Axis::kExpertShard: return shard_ / expert_;
    case Axis::kData: return shard_ * replicas_;
  }
  return 0;
}

LayoutCoord ParallelLayout::CoordOf(int rank) const {
  if (rank < 0 || rank >= world()) throw std::out_of_range("rank " + std::to_string(rank) + " outside world");
  return {(rank / (shard_ * tp_)) % replicas_, (rank / tp_) % shard_, rank % tp_, rank / stage_ranks()};
}

int ParallelLayout::RankOf(LayoutCoord c) const {
  if (c.replica < 0 || c.replica >= replicas_ || c.shard < 0 || c.shard >= shard_ || c.tp < 0 || c.tp >= tp_ ||
      c.pipeline < 0 || c.pipeline >= pipeline_) {
    throw std::out_of_range("layout coordinate outside the mesh");
  }
  return ((c.pipeline * replicas_ + c.replica) * shard_ + c.shard) * tp_ + c.tp;
}

std::vector<int> ParallelLayout::GroupOf(Axis axis, int rank) const {
  LayoutCoord c = CoordOf(rank);
  std::vector<int> members;
  const int n = Degree(axis);
  members.reserve(n);
  for (int i = 0; i < n; ++i) {
    switch (axis) {
      case Axis::kTensor: c.tp = i; break;
      case Axis::kShard: c.shard = i; break;
      case Axis::kReplica: c.replica = i; break;
      case Axis::kPipeline: c.pipeline = i; break;
      case Axis::kContext: c.shard = c.shard / context_ * context_ + i; break;
      case Axis::kExpert: c.shard = c.shard / expert_ * expert_ + i; break;
      case Axis::kExpertShard: c.shard = c.shard % expert_ + i * expert_; break;
      case Axis::kData: c.replica = i / shard_, c.shard = i % shard_; break;
    }
    members.push_back(RankOf(c));
  }
  return members;
}

std::vector<std::vector<int>> ParallelLayout::Groups(Axis axis) const {
  std::vector<std::vector<int>> groups;
  for (int rank = 0; rank < world(); ++rank) {
    std::vector<int> group = GroupOf(axis, rank);
    if (group.front() == rank) groups.push_back(std::move(group));  // each group once, at its lowest rank
  }
  return groups;
}

ContextRows::ContextRows(int64_t seq, int rank, int size) : chunk(seq / (2 * size)) {
  first[0] = chunk * rank;
  first[1] = chunk * (2 * size - 1 - rank);
}

int ParallelLayout::NodesPerShardGroup() const {
  const int group_gpus = shard_ * tp_;
  return group_gpus <= gpus_per_node_ ? 1 : group_gpus / gpus_per_node_;
}

int ParallelLayout::NodesPerStage() const {
  return stage_ranks() <= gpus_per_node_ ? 1 : stage_ranks() / gpus_per_node_;
}

int64_t TokensPerMicroStep(const TrainingJobSpec& spec) {
  return spec.training.micro_batch_size * spec.model.seq_len.value() * ParallelLayout::ForSpec(spec).data_parallel();
}

int64_t AccumulationSteps(const TrainingJobSpec& spec) {
  return spec.training.global_batch_tokens / TokensPerMicroStep(spec);
}

std::string FormatRanks(const std::vector<int>& ranks) {
  if (ranks.empty()) return "";
  if (ranks.size() <= 2) {
    std::string out = std::to_string(ranks[0]);
    for (size_t i = 1; i < ranks.size(); ++i) out.append(",").append(std::to_string(ranks[i]));
    return out;
  }
  const int step = ranks[1] - ranks[0];
  bool arithmetic = step > 0;
  for (size_t i = 2; i < ranks.size() && arithmetic; ++i) arithmetic = ranks[i] - ranks[i - 1] == step;
  if (!arithmetic) {
    std::string out;
    for (int r : ranks) out.append(out.empty() ? "" : ",").append(std::to_string(r));
    return out;
  }
  std::string out = std::to_string(ranks.front()) + "-" + std::to_string(ranks.back());
  if (step != 1) out += " step " + std::to_string(step);
  return out;
}

}  // namespace meshtrain::api
