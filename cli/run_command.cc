#include <spdlog/spdlog.h>

#include "api/layout.h"
#include "cli/commands.h"
#include "cli/job_report.h"
#include "operator/scheduler/placement.h"

namespace meshtrain::cli {
namespace {

// The job's nodes as virtual nodes of this machine, placed and ranked by the same
// scheduler code the operator uses. Cluster-only constraints (node selector,
// tolerations, EFA, required topology) do not apply here.
api::RankTable LocalRankTable(const api::TrainingJob& job) {
  scheduler::ClusterSnapshot local;
  for (int64_t i = 0; i < job.spec.nodes; ++i) {
    scheduler::ClusterNode node;
    node.name = "local-" + std::to_string(i);
    node.gpus = job.spec.gpus_per_node;
    local.nodes.push_back(std::move(node));
  }
  scheduler::PlacementRequest request = scheduler::PlacementRequest::ForJob(job);
  request.node_selector.clear();
  request.tolerations.clear();
  request.efa_per_node = 0;
  request.required = false;
  const scheduler::Placement placement = scheduler::Place(request, local);
  return scheduler::MakeRankTable(placement, job.spec.topology.levels, job.spec.gpus_per_node);
}

}  // namespace

int RunCommand(const std::string& file, std::ostream& out) {
  std::vector<api::CheckedJob> jobs;
  if (!LoadJobsOrReport(file, &jobs, out)) return kExitUnreadable;
  if (jobs.size() != 1) {
    out << file << ": holds " << jobs.size() << " documents; meshtrain run takes a file with one TrainingJob\n";
    return kExitInvalid;
  }
  const api::CheckedJob& job = jobs.front();
  if (!job.ok()) {
    PrintErrors(job, out);
    return kExitInvalid;
  }
  out << job.Where() << ": ok\n";
  PrintLayout(job, /*groups=*/false, out);
  out << "  rank table on this machine:";
  for (const api::RankTableNode& node : LocalRankTable(job.job).nodes) {
    out << " " << node.name << " ranks " << api::FormatRanks(std::vector<int>(node.ranks.begin(), node.ranks.end()))
        << ";";
  }
  out << "\n";
  spdlog::warn("this build has no training engine yet: the job was validated and laid out, not trained");
  return kExitOk;
}

}  // namespace meshtrain::cli
