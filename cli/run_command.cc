#include <cstdio>

#include <spdlog/spdlog.h>

#include "api/layout.h"
#include "cli/commands.h"
#include "cli/job_report.h"
#include "operator/scheduler/placement.h"
#include "worker/train/trainer.h"

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

std::string MiB(int64_t bytes) {
  char buffer[32];
  std::snprintf(buffer, sizeof buffer, "%.1f MiB", double(bytes) / (1 << 20));
  return buffer;
}

}  // namespace

int RunCommand(const RunOptions& options, std::ostream& out) {
  api::CheckedJob job;
  if (int status = LoadOneValidJob(options.file, "run", &job, out); status != kExitOk) return status;
  out << job.Where() << ": ok\n";
  PrintLayout(job, /*groups=*/false, out);
  out << "  rank table on this machine:";
  for (const api::RankTableNode& node : LocalRankTable(job.job).nodes) {
    out << " " << node.name << " ranks " << api::FormatRanks(std::vector<int>(node.ranks.begin(), node.ranks.end()))
        << ";";
  }
  out << "\n";
  if (job.job.spec.training.precision == "bf16") spdlog::warn("bf16 needs CUDA; this run trains in fp32 on the CPU");

  std::optional<train::Trainer> trainer;
  try {
    trainer.emplace(job.job);
  } catch (const train::TokenFileError& e) {
    out << e.what() << "\n";
    return kExitUnreadable;
  } catch (const std::invalid_argument& e) {
    out << job.Where() << ": " << e.what() << "\n";
    return kExitInvalid;
  }
  const train::MemoryReport memory = trainer->memory();
  out << "  memory: params " << MiB(memory.params) << ", grads " << MiB(memory.grads) << ", optimizer "
      << MiB(memory.optimizer) << ", activations " << MiB(memory.activations) << "\n";
  trainer->Run([&](const train::StepReport& r) {
    char line[160];
    std::snprintf(line, sizeof line, "step %5lld/%lld | loss %.4f | lr %.2e | norm %.3f | %.0f tok/s",
                  static_cast<long long>(r.step), static_cast<long long>(r.steps), r.loss, r.learning_rate, r.grad_norm,
                  r.tokens_per_second);
    out << line;
    if (r.validation_loss) {
      std::snprintf(line, sizeof line, " | val loss %.4f", *r.validation_loss);
      out << line;
    }
    out << std::endl;
  });
  const std::vector<uint32_t> prompt = {'\n'};
  const std::string sample = train::TokensToText(trainer->Sample(prompt, options.sample_tokens, 1));
  out << "sample:\n" << sample << "\n";
  return kExitOk;
}

}  // namespace meshtrain::cli
