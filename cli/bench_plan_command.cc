// `meshtrain bench plan`: placement speed and the modelled benefit of topology awareness
// on generated EKS-like clusters.

#include <algorithm>
#include <chrono>
#include <iomanip>

#include "api/manifest.h"
#include "cli/commands.h"
#include "operator/scheduler/cost_model.h"
#include "operator/scheduler/placement.h"
#include "operator/scheduler/synthetic_cluster.h"

namespace meshtrain::cli {
namespace {

double Percentile(std::vector<double> values, double p) {
  std::sort(values.begin(), values.end());
  const size_t i = std::min(values.size() - 1, size_t(p * double(values.size() - 1) + 0.5));
  return values[i];
}

// The 2.7B shape (as in examples/gpt2-2p7b-32x8.yaml): TP 8, hybrid shard 16, 8-GPU nodes.
api::TrainingJob Job(int64_t nodes) {
  const int64_t data_parallel = nodes;  // nodes x 8 GPUs / TP 8
  const nlohmann::json manifest = {
      {"apiVersion", "meshtrain.dev/v1alpha1"},
      {"kind", "TrainingJob"},
      {"metadata", {{"name", "bench-2p7b"}}},
      {"spec",
       {{"image", "meshtrain"},
        {"nodes", nodes},
        {"gpusPerNode", 8},
        {"model", {{"layers", 32}, {"heads", 32}, {"hidden", 2560}, {"vocabSize", 50257}, {"seqLen", 2048}}},
        {"data", {{"train", "/data/*.bin"}}},
        {"training", {{"microBatchSize", 2}, {"globalBatchTokens", 2 * 2048 * data_parallel * 8}, {"precision", "bf16"}}},
        {"parallelism", {{"tensorParallelDegree", 8}, {"hybridShardDegree", 16}}}}}};
  api::CheckedJob checked = api::CheckTrainingJob(manifest, "bench", 0);
  if (!checked.ok()) throw std::logic_error("bench job invalid: " + checked.errors.front().ToString());
  return checked.job;
}

}  // namespace

int BenchPlanCommand(const BenchPlanOptions& options, std::ostream& out) {
  out << std::fixed;
  // 1. Placement time: 2,000 nodes x 8 GPUs, a 128-node job.
  {
    scheduler::SyntheticClusterOptions o;
    o.nodes = options.nodes;
    o.seed = options.seed;
    const scheduler::ClusterSnapshot cluster = scheduler::MakeSyntheticCluster(o);
    const api::TrainingJob job = Job(options.time_job_nodes);
    const scheduler::PlacementRequest request = scheduler::PlacementRequest::ForJob(job);
    std::vector<double> ms;
    scheduler::Placement placement;
    for (int i = 0; i < options.time_runs; ++i) {
      const auto start = std::chrono::steady_clock::now();
      placement = scheduler::Place(request, cluster);
      ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
    }
    int64_t eligible = 0;
    for (const auto& n : cluster.nodes) eligible += scheduler::Ineligibility(request, n).empty();
    out << "placement time: " << options.nodes << " nodes x 8 GPUs (" << eligible << " with 8 free GPUs), "
        << options.time_job_nodes << "-node job: median " << std::setprecision(2) << Percentile(ms, 0.5)
        << " ms, max " << *std::max_element(ms.begin(), ms.end()) << " ms over " << options.time_runs
        << " runs; placed: " << (placement.ok() ? "yes" : placement.reason) << " (target: at most 50 ms)\n";
  }
  // 2. Modelled step communication against topology-blind placement.
  const api::TrainingJob job = Job(options.ratio_job_nodes);
  const scheduler::PlacementRequest request = scheduler::PlacementRequest::ForJob(job);
  const scheduler::LinkModel links(job.spec.topology.levels);
  std::vector<double> ratios, aware_seconds, blind_seconds;
  int unplaced = 0;
  for (int c = 0; c < options.clusters; ++c) {
    scheduler::SyntheticClusterOptions o;
    o.nodes = options.nodes;
    o.seed = options.seed + 1 + uint64_t(c);
    const scheduler::ClusterSnapshot cluster = scheduler::MakeSyntheticCluster(o);
    const scheduler::Placement aware = scheduler::Place(request, cluster);
    const scheduler::Placement blind = scheduler::PlaceBlind(request, cluster);
    if (!aware.ok() || !blind.ok()) {
      ++unplaced;
      continue;
    }
    aware_seconds.push_back(scheduler::EstimateStepCost(job.spec, aware.paths, links).seconds);
    blind_seconds.push_back(scheduler::EstimateStepCost(job.spec, blind.paths, links).seconds);
    ratios.push_back(blind_seconds.back() / aware_seconds.back());
  }
  if (ratios.empty()) {
    out << "step communication: no cluster could place the job\n";
    return kExitInvalid;
  }
  out << "step communication, 2.7B (32 layers, 32 heads, hidden 2560) TP 8, hybrid shard 16, "
      << options.ratio_job_nodes << " nodes, " << ratios.size() << " clusters of " << options.nodes << " nodes";
  if (unplaced > 0) out << " (" << unplaced << " could not place the job)";
  out << ":\n  modelled seconds per step: topology-aware median " << std::setprecision(3)
      << Percentile(aware_seconds, 0.5) << " s, topology-blind median " << Percentile(blind_seconds, 0.5) << " s\n"
      << "  blind / aware: median " << std::setprecision(2) << Percentile(ratios, 0.5) << "x, p10 "
      << Percentile(ratios, 0.1) << "x, min " << Percentile(ratios, 0.0) << "x, max " << Percentile(ratios, 1.0)
      << "x (target: median at least 1.3x)\n";
  return kExitOk;
}

}  // namespace meshtrain::cli
