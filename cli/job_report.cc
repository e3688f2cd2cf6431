#include "cli/job_report.h"

#include "cli/commands.h"

#include "api/layout.h"
#include "api/model_shape.h"

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

void PrintLayout(const api::CheckedJob& job, bool groups, std::ostream& out) {
  const api::TrainingJobSpec& spec = job.job.spec;
  const api::ParallelLayout mesh = api::ParallelLayout::ForSpec(spec);
  const api::ModelShape shape = api::ShapeOf(spec.model);
  out << "TrainingJob " << job.job.metadata.name << ": " << mesh.nodes() << " node(s) x " << mesh.gpus_per_node()
      << " GPU(s) = " << mesh.world() << " rank(s)\n"
      << "  model: " << api::DescribeShape(shape) << " (" << shape.ParameterCount() << " parameters)\n"
      << "  mesh: " << mesh.replicas() << " replica(s) x " << mesh.shard() << " shard x " << mesh.tp()
      << " tp; data-parallel size " << mesh.data_parallel() << "; a shard group spans "
      << mesh.NodesPerShardGroup() << " node(s)\n";
  out << "  batch: " << spec.training.global_batch_tokens << " tokens per step = " << api::TokensPerMicroStep(spec)
      << " per micro-step x " << api::AccumulationSteps(spec) << " accumulation step(s)\n";
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
  for (api::Axis axis : {api::Axis::kTensor, api::Axis::kShard, api::Axis::kReplica}) {
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
