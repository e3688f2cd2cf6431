#include "cli/job_report.h"

#include "cli/commands.h"

#include <algorithm>
#include <cstdio>

#include "api/engine_memory.h"
#include "api/layout.h"
#include "api/model_shape.h"
#include "api/pipeline.h"
#include "operator/scheduler/memory_model.h"
#include "operator/scheduler/planner.h"

namespace meshtrain::cli {

bool LoadJobsOrReport(const std::string& file, std::vector<api::CheckedJob>* jobs, std::ostream& out) {
  try {
    *jobs = api::LoadTrainingJobs(file, "", api::ModelDirectory::kIfPresent);
    return true;
  } catch (const api::ManifestError& e) {
    out << e.what() << "\n";
    return false;
  }
}

int LoadOneValidJob(const std::string& file, const std::string& command, api::CheckedJob* job, std::ostream& out) {
  std::vector<api::CheckedJob> jobs;
  if (!LoadJobsOrReport(file, &jobs, out)) return kExitUnreadable;
  if (jobs.size() != 1) {
    out << api::ManifestSourceName(file) << ": holds " << jobs.size() << " documents; meshtrain " << command
        << " takes one TrainingJob\n";
    return kExitInvalid;
  }
  *job = std::move(jobs.front());
  if (!job->ok()) {
    PrintErrors(*job, out);
    return kExitInvalid;
  }
  return kExitOk;
}

void PrintErrors(const api::CheckedJob& job, std::ostream& out) {
  for (const api::FieldError& e : job.errors) out << job.Where() << ": " << e.ToString() << "\n";
}

void PrintWarnings(const api::CheckedJob& job, std::ostream& out) {
  for (const api::FieldError& w : job.warnings) out << job.Where() << ": warning: " << w.ToString() << "\n";
}

namespace {

std::vector<int> Range(int first, int end) {
  std::vector<int> out;
  for (int i = first; i < end; ++i) out.push_back(i);
  return out;
}

// The pipeline's line and each stage's: its ranks and nodes, its blocks (api::SplitBlocks,
// chunk by chunk) and the rest of the model it holds, and the memory model's peak of its
// ranks (the planner's, scheduler::PredictMemory, on a GPU at the job's precision).
void PrintStages(const api::TrainingJobSpec& spec, const api::ParallelLayout& mesh, const api::ModelShape& shape,
                 std::ostream& out) {
  const api::Pipeline pipeline = api::Pipeline::Of(spec.parallelism);
  // seq: this rank's rows of each sequence (of C context ranks).
  const int M = int(api::AccumulationSteps(spec)), seq = int(shape.seq_len) / mesh.context(), P = pipeline.stages;
  char bubble[32];
  std::snprintf(bubble, sizeof bubble, "%.1f%%", 100 * api::BubbleFraction(pipeline, M));
  out << "  pipeline: " << P << " stages, schedule " << api::PipelineScheduleName(pipeline.schedule) << ", "
      << pipeline.virtual_stages << " chunk(s) of blocks a stage, " << M
      << " micro-batches a step (the schedule's bubble " << bubble << "); a stage spans " << mesh.NodesPerStage()
      << " node(s)\n";
  const int compute_bytes = spec.training.precision == "fp32" ? 4 : 2;
  const int batch = int(spec.training.micro_batch_size), tp = mesh.tp();
  const api::EngineTypes types = scheduler::EngineTypesOf(compute_bytes, /*cpu_kernels=*/false, shape, batch, seq, tp,
                                                         mesh.context(), spec.parallelism.context_parallel_mode,
                                                         mesh.expert());
  const api::ActivationPolicy policy{spec.parallelism.activation_checkpointing, spec.parallelism.activation_offloading,
                                     int(spec.parallelism.activation_loading_horizon)};
  const std::vector<int> first = api::SplitBlocks(shape, seq, pipeline.chunks());
  for (int p = 0; p < P; ++p) {
    const std::vector<int> ranks = Range(p * mesh.stage_ranks(), (p + 1) * mesh.stage_ranks());
    const std::vector<int> nodes = Range(mesh.NodeOf(ranks.front()), mesh.NodeOf(ranks.back()) + 1);
    std::string blocks;
    for (int c : api::ChunksOf(pipeline, p)) {
      const int from = first[size_t(c)], to = first[size_t(c) + 1] - 1;
      blocks += (blocks.empty() ? "" : ", ") + std::to_string(from) + (to > from ? "-" + std::to_string(to) : "");
    }
    if (p == 0) blocks += " + embedding";
    if (p == P - 1) blocks += shape.tied ? " + head (tied: with a copy of the embedding)" : " + head";
    const api::StageShape stage = api::StageShapeOf(shape, pipeline, p, M, seq);
    int64_t most = 0, offload = 0;
    for (int t = 0; t < tp; ++t) {
      const api::EngineMemory m = api::EngineMemoryOf(shape, batch, seq, t, tp, mesh.shard(), policy, types,
                                                      spec.model.dropout > 0, /*keep_units_gathered=*/false, stage);
      most = std::max(most, m.device());
      offload = std::max(offload, m.offload);
    }
    out << "    stage " << p << ": ranks " << api::FormatRanks(ranks) << " (node" << (nodes.size() > 1 ? "s " : " ")
        << api::FormatRanks(nodes) << "), blocks " << blocks << "; " << scheduler::MemorySize(most) << " per rank"
        << (offload > 0 ? " and " + scheduler::MemorySize(offload) + " of host memory" : "") << " on a GPU in "
        << (compute_bytes == 4 ? "fp32" : "bf16") << "\n";
  }
}

}  // namespace

void PrintLayout(const api::CheckedJob& job, bool groups, std::ostream& out) {
  const api::TrainingJobSpec& spec = job.job.spec;
  const api::ParallelLayout mesh = api::ParallelLayout::ForSpec(spec);
  const api::ModelShape shape = api::ShapeOf(spec.model);
  out << "TrainingJob " << job.job.metadata.name << ": " << mesh.nodes() << " node(s) x " << mesh.gpus_per_node()
      << " GPU(s) = " << mesh.world() << " rank(s)\n"
      << "  model: " << api::DescribeShape(shape) << " (" << shape.ParameterCount() << " parameters)\n"
      << "  mesh: " << (mesh.pipeline() > 1 ? std::to_string(mesh.pipeline()) + " stage(s) x " : "")
      << mesh.replicas() << " replica(s) x " << mesh.shard() << " shard"
      << (mesh.context() > 1 ? " (" + std::to_string(mesh.shard() / mesh.context()) + " x context " +
                                   std::to_string(mesh.context()) + ", " + spec.parallelism.context_parallel_mode +
                                   " attention)"
                             : "")
      << " x " << mesh.tp() << " tp; data-parallel size " << mesh.data_parallel() << "; a shard group spans "
      << mesh.NodesPerShardGroup() << " node(s)\n";
  if (mesh.expert() > 1) {
    const int64_t dense = shape.DenseBlocks();
    out << "  experts: expert parallelism " << mesh.expert() << ", " << shape.experts / mesh.expert() << " of "
        << shape.experts << " experts of each " << (dense > 0 ? "sparse " : "") << "block a rank, their blocks sharded over "
        << mesh.shard() / mesh.expert() << " rank(s)"
        << (dense > 0 ? "; the " + std::to_string(dense) + " dense blocks over all " + std::to_string(mesh.shard())
                      : "")
        << "\n";
  }
  out << "  batch: " << spec.training.global_batch_tokens << " tokens per step = " << api::TokensPerMicroStep(spec)
      << " per micro-step x " << api::AccumulationSteps(spec) << " accumulation step(s)\n";
  if (mesh.pipeline() > 1) PrintStages(spec, mesh, shape, out);
  for (const api::DerivedDefault& d : job.defaults) {
    out << "  default: " << d.field << " = " << d.value << " (" << d.reason << ")\n";
  }
  if (!groups) return;

  out << "  nodes:\n";
  for (int n = 0; n < mesh.nodes(); ++n) {
    std::vector<int> ranks;
    for (int r = n * mesh.gpus_per_node(); r < (n + 1) * mesh.gpus_per_node(); ++r) ranks.push_back(r);
    out << "    node " << n << ": ranks " << api::FormatRanks(ranks) << "\n";
  }
  for (api::Axis axis :
       {api::Axis::kTensor, api::Axis::kContext, api::Axis::kShard, api::Axis::kExpert, api::Axis::kExpertShard,
        api::Axis::kReplica, api::Axis::kPipeline}) {
    if (axis == api::Axis::kPipeline && mesh.pipeline() == 1) continue;
    if (axis == api::Axis::kContext && mesh.context() == 1) continue;
    if ((axis == api::Axis::kExpert || axis == api::Axis::kExpertShard) && mesh.expert() == 1) continue;
    const auto all = mesh.Groups(axis);
    out << "  " << api::AxisName(axis) << " groups (" << all.size() << " of " << mesh.Degree(axis) << "):\n";
    for (const auto& group : all) {
      std::vector<int> nodes;
      for (int rank : group) {
        if (nodes.empty() || nodes.back() != mesh.NodeOf(rank)) nodes.push_back(mesh.NodeOf(rank));
      }
      out << "    " << api::FormatRanks(group) << "  (node" << (nodes.size() > 1 ? "s " : " ")
          << api::FormatRanks(nodes) << ")\n";
    }
  }
}

}  // namespace meshtrain::cli
