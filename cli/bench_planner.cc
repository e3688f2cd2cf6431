// `meshtrain bench plan --memory | --measure | --at-scale`: the layout planner against
// what the engine does. --memory trains layouts on this machine (for a mixture of experts,
// with its experts split over EP ranks too) and holds the memory model's per-rank peak
// against the accounting's; --measure runs every layout the planner finds feasible (on a
// network testbed), EP > 1 included, and ranks the model's step times against the
// measured ones, holding its per-rank peaks against theirs; --at-scale prints the
// planner's choice for GPT-2 1.5B and Llama 3.1 8B and 70B on 16 to 128 p5 nodes against
// hand-picked SMP-style layouts.

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <numeric>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "api/json_codec.h"
#include "api/manifest.h"
#include "api/model_family.h"
#include "cli/bench_ranks.h"
#include "cli/commands.h"
#include "cli/plan_report.h"
#include "operator/scheduler/device_probe.h"
#include "operator/scheduler/planner.h"
#include "operator/scheduler/synthetic_cluster.h"
#include "operator/scheduler/placement.h"
#include "worker/comm/bootstrap.h"

namespace meshtrain::cli {
namespace {

using scheduler::Candidate;
using scheduler::LayoutChoice;

BenchTrainOptions RanksOptions(const BenchPlanOptions& o) {
  BenchTrainOptions t;
  t.model = o.model;
  t.seq = o.seq;
  t.steps = o.steps;
  t.warmup = 2;
  t.ranks = o.testbed_nodes * o.ranks_per_node;
  t.nodes = o.testbed_nodes;
  t.netbed = o.netbed;
  return t;
}

RanksConfig ConfigOf(const LayoutChoice& c, int64_t global_tokens) {
  RanksConfig config{scheduler::Describe(c), c.tp, c.shard,
                     Activations{c.activations.checkpointing, c.activations.offload ? c.activations.horizon : 0},
                     c.micro_batch, global_tokens, {}};
  config.pipeline = c.pipeline;
  config.context = c.context;  // the planner's mode is the bench's, Ring
  config.expert = c.expert;
  return config;
}

std::optional<api::ModelShape> ShapeOf(const BenchPlanOptions& o, std::ostream& out) {
  const api::ModelShape* preset = api::FindPreset(o.model);
  if (preset == nullptr) {
    out << "--model " << o.model << ": unknown preset\n";
    return std::nullopt;
  }
  api::ModelShape shape = *preset;
  shape.seq_len = o.seq;
  return shape;
}

// Ranks of `values` (1 = smallest), ties sharing their mean rank.
std::vector<double> Ranks(const std::vector<double>& values) {
  std::vector<size_t> order(values.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return values[a] < values[b]; });
  std::vector<double> ranks(values.size());
  for (size_t i = 0; i < order.size();) {
    size_t j = i;
    while (j < order.size() && values[order[j]] == values[order[i]]) ++j;
    for (size_t k = i; k < j; ++k) ranks[order[k]] = double(i + j + 1) / 2;
    i = j;
  }
  return ranks;
}

double Spearman(const std::vector<double>& a, const std::vector<double>& b) {
  const std::vector<double> ra = Ranks(a), rb = Ranks(b);
  const double n = double(a.size()), mean = (n + 1) / 2;
  double cov = 0, va = 0, vb = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    cov += (ra[i] - mean) * (rb[i] - mean);
    va += (ra[i] - mean) * (ra[i] - mean);
    vb += (rb[i] - mean) * (rb[i] - mean);
  }
  return cov / std::sqrt(va * vb);
}

// `c` with its blocks' experts split over `expert` ranks.
LayoutChoice WithExperts(LayoutChoice c, int expert) {
  c.expert = expert;
  return c;
}

// --memory: layouts of T, S, micro-batch and activations on one node of this machine; for
// a mixture of experts, also of EP (every EP that divides its experts and S).
int MemoryCheck(const BenchPlanOptions& o, const std::vector<std::string>& self_argv, std::ostream& out) {
  const std::optional<api::ModelShape> shape = ShapeOf(o, out);
  if (!shape) return kExitUnreadable;
  BenchTrainOptions t = RanksOptions(o);
  t.ranks = 4;
  t.nodes = 1;
  t.netbed.clear();
  t.steps = 1;
  t.device = o.device;
  const bool cuda = o.device == "cuda";
  if (RefusedWithoutGpu(o.device, "bench plan --memory", out)) return kExitUnreadable;
  const int64_t global = int64_t(8) * o.seq * t.ranks;  // 8 sequences per rank a step
  const api::ActivationPolicy keep{}, checkpoint{true, false, 2}, offload1{true, true, 1}, offload2{true, true, 2};
  std::vector<LayoutChoice> layouts = {
      {1, 1, 4, keep},       {1, 2, 4, keep},       {1, 4, 4, keep},       {2, 1, 4, keep},
      {2, 2, 4, keep},       {4, 1, 4, keep},       {1, 4, 4, checkpoint}, {2, 2, 4, checkpoint},
      {1, 4, 4, offload1},   {2, 2, 4, offload2},   {4, 1, 4, offload1},   {1, 2, 2, checkpoint},
      {1, 1, 8, offload2},   {2, 1, 1, keep},
  };
  // On a GPU each layout starts four CUDA processes: six layouts that cover T, S and the
  // activation policies keep the check within minutes.
  if (cuda) layouts = {{1, 1, 4, keep}, {1, 4, 4, keep}, {2, 2, 4, keep}, {4, 1, 4, offload1},
                       {1, 4, 4, checkpoint}, {2, 2, 4, offload2}};
  // A TP degree the model cannot take (one that does not divide its heads, key/value heads
  // or MLP width: a mixture's experts' width).
  std::erase_if(layouts, [&](const LayoutChoice& c) { return !api::TensorParallelDivides(*shape, c.tp); });
  // A mixture of experts: its experts split over EP ranks of the shard group, each policy
  // and S = 2 and 4 at least once, where the experts allow (EP divides them).
  if (shape->experts > 0) {
    std::vector<LayoutChoice> split = {
        WithExperts({1, 2, 4, keep}, 2),       WithExperts({1, 4, 4, keep}, 2),
        WithExperts({1, 4, 4, keep}, 4),       WithExperts({1, 4, 4, checkpoint}, 4),
        WithExperts({1, 4, 4, offload1}, 2),   WithExperts({1, 2, 2, checkpoint}, 2),
        WithExperts({1, 4, 8, offload2}, 4),
    };
    if (cuda) split = {WithExperts({1, 4, 4, keep}, 2), WithExperts({1, 4, 4, offload1}, 4)};
    std::erase_if(split, [&](const LayoutChoice& c) { return shape->experts % c.expert != 0; });
    layouts.insert(layouts.end(), split.begin(), split.end());
  }
  const RemovedOnExit data(WriteRandomTokens(global * (t.steps + t.warmup + 1), *shape));
  out << "memory model against the engine's accounting: " << o.model << " at seq " << o.seq << ", " << t.ranks
      << (cuda ? " bf16 ranks sharing GPU 0" : " fp32 ranks on one node") << ", global batch " << global
      << " tokens; per-rank peak, the largest rank's\n";
  char line[256];
  std::snprintf(line, sizeof line, "  %-52s %12s %12s %8s\n", "layout", "predicted", "measured", "error");
  out << line;
  int within = 0, failed = 0;
  double worst = 0;
  for (const LayoutChoice& c : layouts) {
    const std::optional<RanksResult> r = RunBenchRanks(t, self_argv, data.string(), ConfigOf(c, global), out);
    if (!r) {
      out << "  " << scheduler::Describe(c) << ": the ranks failed\n";
      ++failed;
      continue;
    }
    const int micro_batches = int(global / (int64_t(c.micro_batch) * o.seq * (t.ranks / c.tp)));
    const int64_t predicted =
        scheduler::PredictMemory(*shape, o.seq, c, cuda ? 2 : 4, /*cpu_kernels=*/!cuda, false, micro_batches).total();
    const double error = double(predicted - r->peak_total) / double(r->peak_total);
    worst = std::max(worst, std::abs(error));
    within += std::abs(error) <= 0.10;
    std::snprintf(line, sizeof line, "  %-52s %9.2f MiB %9.2f MiB %+7.1f%%\n", scheduler::Describe(c).c_str(),
                  double(predicted) / (1 << 20), double(r->peak_total) / (1 << 20), 100 * error);
    out << line;
  }
  std::snprintf(line, sizeof line, "%d of %zu layouts within 10%% (worst %.1f%%)%s\n", within, layouts.size(),
                100 * worst, failed ? "; some ranks failed" : "");
  out << line;
  return within == int(layouts.size()) ? kExitOk : kExitInvalid;
}

// One rank trained here at `micro_batch` on its share of the threads when `ranks` ranks
// share this machine's cores: the FLOP/s its kernels reach (scaled by the share of the
// cores it gets), and what activation checkpointing's recompute costs.
struct RankRate {
  double flops = 0;
  double recompute_factor = 1;  // the recompute's time over the modelled block forward's
};

RankRate MeasureRank(const api::ModelShape& shape, int seq, int micro_batch, int ranks) {
  const int cores = int(std::max(1u, std::thread::hardware_concurrency()));
  const int threads = std::max(1, cores / ranks);
  const RemovedOnExit data(WriteRandomTokens(int64_t(micro_batch) * seq * 16, shape));
  auto make_trainer = [&](bool checkpointing) {
    BenchTrainOptions t;
    t.seq = seq;
    const RanksConfig one{"one rank", 1, 1, {checkpointing, 0}, micro_batch, int64_t(micro_batch) * seq, {}};
    nlohmann::json manifest = BenchJob(t, data.string(), 1, 1, one, false);
    api::ModelShape at_seq = shape;
    at_seq.seq_len = seq;
    manifest["spec"]["model"] = api::ToJson(api::SpecOfShape(at_seq));
    const api::CheckedJob job = api::CheckTrainingJob(manifest, "bench", 0);
    if (!job.ok()) throw std::invalid_argument(job.errors.front().ToString());
    return std::make_unique<train::Trainer>(job.job);
  };
  const int before = omp_get_max_threads();
  omp_set_num_threads(threads);
  // Each step timed alone on a ProbeClock (time this thread waited for a CPU left out), the
  // two trainers' steps interleaved, and the median of each taken
  // (operator/scheduler/device_probe.h): load elsewhere on the machine then slows neither
  // side's figure.
  const std::unique_ptr<train::Trainer> keep_all = make_trainer(false), recompute = make_trainer(true);
  keep_all->Step();
  recompute->Step();
  constexpr int kSamples = 5;
  std::vector<double> keep_samples, checkpointing_samples;
  for (int i = 0; i < kSamples; ++i) {
    for (auto [trainer, samples] : {std::pair{keep_all.get(), &keep_samples}, {recompute.get(), &checkpointing_samples}}) {
      const scheduler::ProbeClock clock;
      trainer->Step();
      samples->push_back(clock.Seconds());
    }
  }
  omp_set_num_threads(before);
  const double keep = scheduler::MedianOf(keep_samples), checkpointing = scheduler::MedianOf(checkpointing_samples);
  const double share = std::min(1.0, double(cores) / (double(ranks) * threads));
  RankRate rate;
  rate.flops = double(micro_batch) * seq * shape.TrainingFlopsPerToken(seq) / keep * share;
  // The step model's block forward at this rate.
  const double tokens = double(micro_batch) * seq;
  const double block_forward = tokens * api::BlockForwardFlopsPerToken(shape, seq, 1) / (rate.flops / share);
  rate.recompute_factor = scheduler::RecomputeFactor(keep, checkpointing, double(shape.layers) * block_forward);
  return rate;
}

// --measure: every feasible layout on the testbed, modelled and measured.
int MeasureLayouts(const BenchPlanOptions& o, const std::vector<std::string>& self_argv, std::ostream& out) {
  const std::optional<api::ModelShape> shape = ShapeOf(o, out);
  if (!shape) return kExitUnreadable;
  const BenchTrainOptions t = RanksOptions(o);
  scheduler::PlanRequest r;
  r.shape = *shape;
  r.seq = o.seq;
  r.global_batch_tokens = o.global_batch_tokens > 0 ? o.global_batch_tokens : int64_t(16) * o.seq * t.ranks;
  r.cluster.nodes = t.nodes;
  r.cluster.gpus_per_node = o.ranks_per_node;
  for (int n = 0; n < t.nodes; ++n) r.cluster.node_paths.push_back({"node-" + std::to_string(n)});
  r.max_micro_batch = o.max_micro_batch;
  r.max_horizon = 2;
  try {
    if (o.links_file.empty()) throw std::runtime_error("--measure needs --links FILE (meshtrain bench comm --calibrate)");
    scheduler::ApplyLinkFile(o.links_file, &r.cluster.links);
  } catch (const std::exception& e) {
    out << "bench plan: " << e.what() << "\n";
    return kExitUnreadable;
  }
  r.device = scheduler::CpuDevice(int64_t(o.memory_mib) << 20, 0);
  for (int mb = 1; mb <= o.max_micro_batch; mb *= 2) {
    const RankRate rate = MeasureRank(*shape, o.seq, mb, t.ranks);
    r.device.matrix_flops_by_micro_batch[mb] = rate.flops;
    r.device.recompute_factor = rate.recompute_factor;  // the largest micro-batch's
  }
  r.device.matrix_flops = r.device.matrix_flops_by_micro_batch.begin()->second;
  char line[800];
  out << "device model: " << t.ranks << " ranks on " << std::thread::hardware_concurrency()
      << " cores; per-rank rate measured by micro-batch:";
  for (const auto& [mb, flops] : r.device.matrix_flops_by_micro_batch) {
    std::snprintf(line, sizeof line, " %d: %.2f GFLOP/s;", mb, flops / 1e9);
    out << line;
  }
  std::snprintf(line, sizeof line, " a recomputed block forward takes %.2fx its FLOP time", r.device.recompute_factor);
  out << line;
  out << "\nlinks (" << o.links_file << "): intra-node " << r.cluster.links.IntraNode().bytes_per_second / 1e9
      << " GB/s, between nodes " << r.cluster.links.BetweenNodes(0).bytes_per_second / 1e9 << " GB/s per rank\n";
  const scheduler::Plan plan = scheduler::PlanLayouts(r);
  // The plain default: full sharding over all ranks in the spec's order, micro-batch 8 or less.
  const LayoutChoice plain{1, t.ranks, int(std::min<int64_t>(8, r.global_batch_tokens / o.seq / t.ranks)), {}};
  PrintPlan(r, plan, o.top, plain, out);
  // Every feasible layout (or the --measure-top fastest modelled of each P and EP),
  // measured; then the default.
  std::vector<Candidate> runs;
  std::map<std::pair<int, int>, int> taken_by_stages_and_experts;
  for (const Candidate& c : plan.feasible) {
    const std::pair<int, int> key{c.choice.pipeline.stages, c.choice.expert};
    if (o.measure_top == 0 || taken_by_stages_and_experts[key]++ < o.measure_top) runs.push_back(c);
  }
  const RemovedOnExit data(WriteRandomTokens(r.global_batch_tokens * (t.steps + t.warmup + 1), *shape));
  std::vector<double> predicted, measured;
  std::vector<int64_t> peaks;  // each layout's measured per-rank peak (the largest rank's)
  for (const Candidate& c : runs) {
    const std::optional<RanksResult> m = RunBenchRanks(t, self_argv, data.string(), ConfigOf(c.choice, r.global_batch_tokens), out);
    if (!m) {
      out << "bench plan: the ranks of " << scheduler::Describe(c.choice) << " failed\n";
      return kExitInvalid;
    }
    predicted.push_back(c.step.tokens_per_second);
    measured.push_back(m->tokens_per_second);
    peaks.push_back(m->peak_total);
    std::snprintf(line, sizeof line, "  measured %zu of %zu: %s: %.0f tokens/s (modelled %.0f)\n", measured.size(),
                  runs.size(), scheduler::Describe(c.choice).c_str(), m->tokens_per_second, c.step.tokens_per_second);
    out << line << std::flush;
  }
  const Candidate def = scheduler::Evaluate(r, plain);
  const std::optional<RanksResult> def_measured =
      RunBenchRanks(t, self_argv, data.string(), ConfigOf(def.choice, r.global_batch_tokens), out);
  out << (o.measure_top == 0 ? "every feasible layout" : "the measured layouts")
      << ", modelled and measured (tokens/s; per-rank peak, the largest rank's), fastest modelled first:\n";
  std::snprintf(line, sizeof line, "  %-52s %10s %12s %12s %9s %12s %8s\n", "layout", "memory", "modelled", "measured",
                "m/model", "peak", "error");
  out << line;
  size_t best_measured = 0;
  double worst_memory = 0;
  for (size_t i = 0; i < runs.size(); ++i) {
    if (measured[i] > measured[best_measured]) best_measured = i;
    const double error = double(runs[i].needed - peaks[i]) / double(peaks[i]);
    worst_memory = std::max(worst_memory, std::abs(error));
    std::snprintf(line, sizeof line, "  %-52s %6.1f MiB %12.0f %12.0f %9.2f %8.1f MiB %+7.1f%%\n",
                  scheduler::Describe(runs[i].choice).c_str(), double(runs[i].needed) / (1 << 20), predicted[i],
                  measured[i], measured[i] / predicted[i], double(peaks[i]) / (1 << 20), 100 * error);
    out << line;
  }
  if (runs.empty() || !def_measured) {
    out << "bench plan: nothing to compare\n";
    return kExitInvalid;
  }
  std::snprintf(line, sizeof line, "memory model against the measured per-rank peak: worst %.1f%% over %zu layouts\n",
                100 * worst_memory, runs.size());
  out << line;
  // A mixture of experts: per EP measured, its fastest modelled and best measured layouts.
  if (shape->experts > 0) {
    std::map<int, std::pair<size_t, size_t>> by_expert;  // EP: (fastest modelled, best measured)
    for (size_t i = 0; i < runs.size(); ++i) {
      const auto [it, first] = by_expert.try_emplace(runs[i].choice.expert, i, i);  // runs: fastest modelled first
      if (!first && measured[i] > measured[it->second.second]) it->second.second = i;
    }
    out << "by expertParallelDegree EP, the fastest modelled and the best measured (tokens/s):\n";
    for (const auto& [ep, best] : by_expert) {
      const auto [modelled, measured_best] = best;
      std::snprintf(line, sizeof line, "  EP=%d: %s: modelled %.0f, measured %.0f (%.2f); best measured %s: %.0f\n", ep,
                    scheduler::Describe(runs[modelled].choice).c_str(), predicted[modelled], measured[modelled],
                    measured[modelled] / predicted[modelled], scheduler::Describe(runs[measured_best].choice).c_str(),
                    measured[measured_best]);
      out << line;
    }
  }
  const double rho = Spearman(predicted, measured);
  std::snprintf(line, sizeof line,
                "Spearman rank correlation, modelled against measured: %.3f over %zu layouts (target: at least 0.8)\n"
                "the pick (%s): %.0f tokens/s measured; the best measured (%s): %.0f; pick / best %.3f (target: at "
                "least 0.9)\n"
                "the default (%s): %.0f tokens/s measured (%.0f modelled); pick / default %.2fx (target: at least 1.3x)\n",
                rho, runs.size(), scheduler::Describe(runs[0].choice).c_str(), measured[0],
                scheduler::Describe(runs[best_measured].choice).c_str(), measured[best_measured],
                measured[0] / measured[best_measured], scheduler::Describe(def.choice).c_str(),
                def_measured->tokens_per_second, def.step.tokens_per_second, measured[0] / def_measured->tokens_per_second);
  out << line;
  // With stages picked: the pick against the best measured layout without them.
  if (runs[0].choice.pipeline.stages > 1) {
    std::optional<size_t> flat;
    for (size_t i = 0; i < runs.size(); ++i) {
      if (runs[i].choice.pipeline.stages == 1 && (!flat || measured[i] > measured[*flat])) flat = i;
    }
    if (flat) {
      std::snprintf(line, sizeof line,
                    "the pick has %d stages; the best measured without stages (%s): %.0f tokens/s; pick / best "
                    "without stages %.2fx (target: at least 1.5x)\n",
                    runs[0].choice.pipeline.stages, scheduler::Describe(runs[*flat].choice).c_str(), measured[*flat],
                    measured[0] / measured[*flat]);
      out << line;
    }
  }
  return kExitOk;
}

// --at-scale: the planner's choice on p5 nodes of a synthetic EKS cluster against
// hand-picked SMP-style layouts (each with the best micro-batch and activations the
// planner finds for its T and S), for GPT-2 1.5B, Llama 3.1 8B and 70B.
int AtScale(const BenchPlanOptions& o, std::ostream& out) {
  struct Model {
    std::string name;
    api::ModelShape shape;
    int64_t global_batch_tokens;
  };
  const std::vector<Model> models = {
      {"GPT-2 1.5B", *api::FindPreset("gpt2-1.5b"), int64_t(1) << 20},
      {"Llama 3.1 8B (seq 2048)", *api::FindPreset("llama3.1-8b"), int64_t(4) << 20},
      {"Llama 3.1 70B (seq 2048)", *api::FindPreset("llama3.1-70b"), int64_t(4) << 20},
  };
  const scheduler::DeviceModel device = *scheduler::FindInstanceDevice("p5.48xlarge");
  scheduler::SyntheticClusterOptions cluster_options;
  cluster_options.nodes = o.nodes;
  cluster_options.seed = o.seed;
  cluster_options.gpu_used_fraction = 0;
  const scheduler::ClusterSnapshot cluster = scheduler::MakeSyntheticCluster(cluster_options);
  char line[400];
  out << "the planner on p5.48xlarge (" << device.name << ", 8 per node), placed on a synthetic EKS cluster of "
      << o.nodes << " nodes; modelled per-rank peak and step time\n";
  for (const Model& m : models) {
    out << m.name << ", global batch " << m.global_batch_tokens << " tokens:\n";
    std::snprintf(line, sizeof line, "  %5s  %-22s %-50s %10s %9s %12s %9s\n", "nodes", "layout", "choice", "memory",
                  "step", "tokens/s", "vs chosen");
    out << line;
    for (int nodes : {16, 32, 64, 128}) {
      const nlohmann::json manifest = {
          {"apiVersion", "meshtrain.dev/v1alpha1"},
          {"kind", "TrainingJob"},
          {"metadata", {{"name", "at-scale"}}},
          {"spec",
           {{"image", "meshtrain"},
            {"nodes", nodes},
            {"gpusPerNode", 8},
            {"model", api::ToJson(api::SpecOfShape(m.shape))},
            {"data", {{"train", "/data/*.bin"}}},
            {"training", {{"globalBatchTokens", m.global_batch_tokens}, {"precision", "bf16"}}},
            {"parallelism", {{"mode", "auto"}}}}}};
      const api::CheckedJob job = api::CheckTrainingJob(manifest, "at-scale", 0);
      if (!job.ok()) throw std::logic_error("at-scale job: " + job.errors.front().ToString());
      const scheduler::Placement placed = scheduler::Place(scheduler::PlacementRequest::ForJob(job.job), cluster);
      if (!placed.ok()) {
        out << "  " << nodes << " nodes: not placed: " << placed.reason << "\n";
        continue;
      }
      scheduler::PlanRequest request =
          scheduler::RequestFor(job.job.spec, placed.paths, scheduler::LinkModel(job.job.spec.topology.levels), device);
      request.max_micro_batch = 16;
      const scheduler::Plan plan = scheduler::PlanLayouts(request);
      const scheduler::Candidate* best = plan.best();
      const int world = nodes * 8;
      struct Reference {
        std::string name;
        int tp, shard;
      };
      const std::vector<Reference> references = {
          {"planner", 0, 0}, {"TP 8, hybrid shard 16", 8, 16}, {"TP 8, hybrid shard 32", 8, 32}, {"full sharding", 1, world}};
      for (const Reference& ref : references) {
        const scheduler::Candidate* row = ref.tp == 0 ? best : nullptr;
        std::string why;
        for (const scheduler::Candidate& c : plan.feasible) {
          const bool same =
              c.choice.tp == ref.tp && c.choice.shard == ref.shard && c.choice.context == 1 && c.choice.expert == 1;
          if (row == nullptr && ref.tp != 0 && same) row = &c;
        }
        if (ref.tp != 0 && row == nullptr) {
          if (m.shape.KvHeads() % ref.tp != 0) why = "T=" + std::to_string(ref.tp) + " does not divide " +
                                                     std::to_string(m.shape.KvHeads()) + " key/value heads";
          else if (!api::ParallelLayout::Check(nodes, 8, ref.tp, ref.shard).empty()) why = "not a layout of these ranks";
          else why = "does not fit";
          for (const scheduler::Candidate& c : plan.rejected) {
            if (c.choice.tp == ref.tp && c.choice.shard == ref.shard && c.choice.context == 1 && c.choice.expert == 1) {
              why = c.reason;
            }
          }
        }
        if (row == nullptr) {
          std::snprintf(line, sizeof line, "  %5d  %-22s %s\n", nodes, ref.name.c_str(),
                        why.empty() ? "no layout fits" : why.c_str());
        } else {
          std::snprintf(line, sizeof line, "  %5d  %-22s %-50s %6.1f GiB %7.3f s %12.0f %8.2fx\n", nodes,
                        ref.name.c_str(), scheduler::Describe(row->choice).c_str(),
                        double(row->needed) / double(int64_t(1) << 30), row->step.seconds, row->step.tokens_per_second,
                        best ? best->step.seconds / row->step.seconds : 0.0);
        }
        out << line;
      }
    }
  }
  return kExitOk;
}

}  // namespace

int BenchPlannerCommand(const BenchPlanOptions& o, const std::vector<std::string>& self_argv, std::ostream& out) {
  if (comm::WorkerEnvironment::Present()) return BenchTrainRank();
  try {
    if (o.memory) return MemoryCheck(o, self_argv, out);
    if (o.measure) return MeasureLayouts(o, self_argv, out);
    if (o.at_scale) return AtScale(o, out);
  } catch (const std::exception& e) {
    out << "bench plan: " << e.what() << "\n";
    return kExitInvalid;
  }
  return BenchPlanCommand(o, out);
}

}  // namespace meshtrain::cli
