// `meshtrain bench train`: single-rank training throughput through the Trainer, on the
// CPU in fp32 or on GPU 0 in bf16. MFU is achieved model FLOP/s over the device's dense
// peak (runtime/device_peak.h); beside it, the matrix rate measured here at the model's
// own shapes (OpenBLAS sgemm, or cuBLASLt bf16) and the share of it the step reaches.

#include <cblas.h>
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <fstream>
#include <optional>
#include <random>
#include <thread>

#include "api/json_codec.h"
#include "api/manifest.h"
#include "api/engine_memory.h"
#include "api/model_shape.h"
#include "cli/bench_ranks.h"
#include "cli/commands.h"
#include "operator/scheduler/placement.h"
#include "worker/comm/bootstrap.h"
#include "worker/comm/fabric/fabric_communicator.h"
#include "worker/launch/local_launcher.h"
#include "worker/runtime/device_peak.h"
#include "worker/train/cuda_plugin.h"
#include "worker/train/devices.h"
#include "worker/train/token_file.h"
#include "worker/train/trainer.h"

namespace meshtrain::cli {
namespace {

using Clock = std::chrono::steady_clock;

// The preset's name, with its layers where --layers replaced them.
std::string ModelLabel(const BenchTrainOptions& o) {
  return o.layers > 0 ? o.model + ", layers " + std::to_string(o.layers) : o.model;
}

// A (tokens x k) by (k x n) product that a training step runs `count` times forward
// (out = in @ W^T) and twice backward (dIn = dOut @ W, dW = dOut^T @ In).
struct StepProduct {
  int k, n, count;
};

std::vector<StepProduct> StepProducts(const api::ModelShape& s) {
  std::vector<StepProduct> products;
  for (int64_t l = 0; l < s.layers; ++l) {  // each shape once, counted in every block that runs it
    for (const api::BlockProduct& p : api::BlockProducts(s, l)) {
      auto same = std::find_if(products.begin(), products.end(),
                               [&](const StepProduct& q) { return q.k == int(p.k) && q.n == int(p.n); });
      if (same != products.end()) {
        ++same->count;
      } else {
        products.push_back({int(p.k), int(p.n), 1});
      }
    }
  }
  // The LM head at the engine's padded vocabulary (api/engine_memory.h), as the step runs it.
  products.push_back({int(s.hidden), int(api::PaddedVocabRows(s.vocab_size)), 1});
  return products;
}

// "4096 tokens x (768x2304, 768x768, ...)": the shapes the matrix rate was measured at.
std::string DescribeProducts(const api::ModelShape& s, int tokens) {
  std::string shapes;
  for (const StepProduct& p : StepProducts(s)) {
    shapes += (shapes.empty() ? "" : ", ") + std::to_string(p.k) + "x" + std::to_string(p.n);
  }
  return std::to_string(tokens) + " tokens x (" + shapes + ")";
}

// GFLOP/s over a step's products, each weighted as the step weights it. `seconds`
// gives the time of one product's forward and two backward multiplications.
double StepMatrixGflops(const api::ModelShape& s, int tokens, const std::function<double(const StepProduct&)>& seconds) {
  double flops = 0, total = 0;
  for (const StepProduct& p : StepProducts(s)) {
    flops += double(p.count) * 3 * 2.0 * tokens * p.k * p.n;
    total += double(p.count) * seconds(p);
  }
  return flops / total / 1e9;
}

// GFLOP/s of sgemm over the products of one training step.
double MeasureSgemmGflops(const api::ModelShape& s, int tokens) {
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> dist(-1, 1);
  return StepMatrixGflops(s, tokens, [&](const StepProduct& sh) {
    std::vector<float> in(size_t(tokens) * sh.k), w(size_t(sh.n) * sh.k), out(size_t(tokens) * sh.n);
    for (float& x : in) x = dist(rng);
    for (float& x : w) x = dist(rng);
    for (float& x : out) x = dist(rng);
    std::vector<float> din(in.size()), dw(w.size());
    auto step = [&] {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, tokens, sh.n, sh.k, 1, in.data(), sh.k, w.data(), sh.k, 0,
                  out.data(), sh.n);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, tokens, sh.k, sh.n, 1, out.data(), sh.n, w.data(), sh.k, 1,
                  din.data(), sh.k);
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, sh.n, sh.k, tokens, 1, out.data(), sh.n, in.data(), sh.k, 1,
                  dw.data(), sh.k);
    };
    step();  // warm up
    const int repeats = 3;
    const auto start = Clock::now();
    for (int r = 0; r < repeats; ++r) step();
    return SecondsSince(start) / repeats;
  });
}

void PrintRanks(const RanksConfig& c, int ranks, const RanksResult& r, std::ostream& out) {
  char line[320];
  std::snprintf(line, sizeof line,
                "%s: %d ranks, tp %d, shard groups of %d, %s: %.0f tokens/s, per step %.1f ms exposed comm, %.2f ms "
                "copying activations\n",
                c.name.c_str(), ranks, c.tp, c.shard, c.activations.Describe().c_str(), r.tokens_per_second,
                r.exposed_seconds * 1e3, r.copy_seconds * 1e3);
  out << line << "  per-rank peak: " << train::FormatMemory(r.peak) << "; params + grads + optimizer "
      << runtime::FormatMiB(r.state()) << "\n";
}

// "a / b: tokens/s 0.95 (1000 / 1052), activations 0.31 (1.0 MiB / 3.2 MiB)"
void PrintRatios(const RanksConfig& a, const RanksResult& ra, const RanksConfig& b, const RanksResult& rb, bool state,
                 std::ostream& out) {
  const int64_t mine = state ? ra.state() : ra.peak.activations, theirs = state ? rb.state() : rb.peak.activations;
  char line[320];
  std::snprintf(line, sizeof line, "%s / %s: tokens/s %.2f (%.0f / %.0f), %s %.2f (%s / %s)\n", a.name.c_str(),
                b.name.c_str(), ra.tokens_per_second / rb.tokens_per_second, ra.tokens_per_second,
                rb.tokens_per_second, state ? "params + grads + optimizer" : "activations",
                double(mine) / double(theirs), runtime::FormatMiB(mine).c_str(), runtime::FormatMiB(theirs).c_str());
  out << line;
}

// The testbed's nodes as a cluster the scheduler places on: node i is "node-i" in rack
// i % racks (as scripts/netbed.sh wires them), so name order alternates racks. Fills the
// testbed node of each node rank as the scheduler orders them and in name order (the
// topology-blind placement); returns an error message or "".
std::string TestbedOrders(const BenchTrainOptions& o, std::vector<int>* aware, std::vector<int>* blind) {
  if (o.netbed.empty() || o.racks < 2) return "needs --netbed NAME of a testbed with --racks 2 or more";
  const std::string rack_label = "meshtrain.dev/rack";
  scheduler::ClusterSnapshot cluster;
  for (int i = 0; i < o.nodes; ++i) {
    scheduler::ClusterNode node;
    node.name = "node-" + std::to_string(i);
    node.labels = {{rack_label, "rack-" + std::to_string(i % o.racks)}, {"kubernetes.io/hostname", node.name}};
    node.gpus = o.ranks / o.nodes;
    cluster.nodes.push_back(std::move(node));
  }
  std::sort(cluster.nodes.begin(), cluster.nodes.end(), [](const auto& a, const auto& b) { return a.name < b.name; });
  api::CheckedJob job = api::CheckTrainingJob(BenchJob(o, "unused", o.ranks, o.nodes, {"order", o.tp, o.shard, {}}, false), "bench", 0);
  if (!job.ok()) return job.errors.front().ToString();
  job.job.spec.topology.levels = {rack_label, "kubernetes.io/hostname"};
  job.job.spec.topology.required_level = rack_label;
  const scheduler::PlacementRequest request = scheduler::PlacementRequest::ForJob(job.job);
  const scheduler::Placement placed = scheduler::Place(request, cluster), name_order = scheduler::PlaceBlind(request, cluster);
  if (!placed.ok() || !name_order.ok()) return placed.ok() ? name_order.reason : placed.reason;
  for (const auto& [from, into] : {std::pair{&placed, aware}, {&name_order, blind}}) {
    for (const std::string& name : from->nodes) into->push_back(std::stoi(name.substr(5)));
  }
  return "";
}

int BenchTrainRanks(const BenchTrainOptions& o, const api::ModelShape& shape, const std::vector<std::string>& self_argv,
                    std::ostream& out) {
  if (o.ranks % o.nodes != 0) {
    out << "bench train: --ranks (" << o.ranks << ") must be a multiple of --nodes (" << o.nodes << ")\n";
    return kExitInvalid;
  }
  const int tp = o.tp, shard = o.shard == 0 ? o.ranks / tp : o.shard;
  const Activations asked{o.checkpointing, o.offload};
  std::vector<RanksConfig> configs;
  if (o.compare == "activations") {
    configs = {{"keep all", tp, shard, {}},
               {"checkpointing", tp, shard, {true, 0}},
               {"offload", tp, shard, {true, o.offload > 0 ? o.offload : 2}}};
  } else if (o.compare == "hybrid") {  // shard groups inside a node, against one across all nodes
    configs = {{"hybrid shard", tp, o.ranks / o.nodes / tp, asked}, {"full shard", tp, o.ranks / tp, asked}};
  } else if (o.compare == "order") {  // the scheduler's node order against name order on a racked testbed
    RanksConfig aware{"topology-aware order", tp, shard, asked}, blind{"name order", tp, shard, asked};
    if (std::string error = TestbedOrders(o, &aware.hosts, &blind.hosts); !error.empty()) {
      out << "bench train --compare order: " << error << "\n";
      return kExitInvalid;
    }
    for (const RanksConfig* c : {&aware, &blind}) {
      out << c->name << ": node ranks on testbed nodes";
      for (size_t n = 0; n < c->hosts.size(); ++n) out << " " << c->hosts[n] << " (rack " << c->hosts[n] % o.racks << ")";
      out << "\n";
    }
    configs = {aware, blind};
  } else if (o.compare == "context") {  // one sequence over every TP group, against one sequence each
    const int groups = o.ranks / tp;
    RanksConfig split{"context " + std::to_string(groups), tp, 1, asked};
    split.context = groups;
    split.global_batch_tokens = int64_t(o.batch) * o.seq;
    configs = {split, {"a sequence a rank", tp, groups, asked}};
  } else if (o.compare == "data-parallel") {  // the same ranks without TP, sharded alike
    configs = {{"tp", tp, shard, asked}, {"data-parallel", 1, o.shard == 0 ? o.ranks : shard, asked}};
  } else {
    configs = {{tp > 1 ? "tp" : shard == 1 ? "replicated" : "sharded", tp, shard, asked}};
    if (o.compare == "replicated") {
      configs.push_back({"replicated", tp, 1, asked});
      if (shard == 1) {  // both replicated: compare the FSDP life cycle with units kept whole
        configs[0].name = "sharded life cycle (units gathered per use)";
        configs[1].name = "replicated (units kept gathered)";
        configs[1].keep_units_gathered = true;
      }
    }
  }
  for (const RanksConfig& c : configs) {
    const api::CheckedJob check =
        api::CheckTrainingJob(BenchJob(o, "unused", o.ranks, o.nodes, c, false), "bench", 0);
    if (!check.ok()) {
      out << "bench train: " << check.errors.front().ToString() << "\n";
      return kExitInvalid;
    }
  }
  const RemovedOnExit data(WriteRandomTokens(int64_t(o.ranks) * o.batch * o.seq * (o.steps + o.warmup + 1), shape));
  char line[256];
  std::snprintf(line, sizeof line, "model %s (%.1fM parameters), %d ranks x batch %d x seq %d a step, %s\n",
                ModelLabel(o).c_str(), double(shape.ParameterCount()) / 1e6, o.ranks, o.batch, o.seq,
                o.device == "cuda" ? "bf16 on the GPUs (ranks sharing one GPU stage collectives through the host)"
                                   : "fp32 on CPU");
  out << line;
  if (o.device != "cuda") out << "kernels: " << train::KernelsOn(runtime::Device::Cpu()) << "\n";
  std::vector<RanksResult> results;
  for (const RanksConfig& c : configs) {
    const std::optional<RanksResult> r = RunBenchRanks(o, self_argv, data.string(), c, out);
    if (!r) break;
    results.push_back(*r);
  }
  if (results.size() != configs.size()) {
    out << "bench train: the ranks failed\n";
    return kExitInvalid;
  }
  for (size_t i = 0; i < configs.size(); ++i) PrintRanks(configs[i], o.ranks, results[i], out);
  // Sharding and TP save state against their peer; the activation modes and context
  // parallelism save activations.
  const bool state = o.compare != "activations" && o.compare != "context";
  for (size_t i = 1; i < configs.size(); ++i) {
    if (state) PrintRatios(configs[0], results[0], configs[i], results[i], true, out);
    else if (o.compare == "context") PrintRatios(configs[0], results[0], configs[i], results[i], false, out);
    else PrintRatios(configs[i], results[i], configs[0], results[0], false, out);
  }
  return kExitOk;
}

// Training throughput of one rank in this process.
int BenchTrainOneRank(const BenchTrainOptions& o, const api::ModelShape& preset, std::ostream& out) {
  const train::CudaPlugin* cuda = o.device == "cuda" ? train::CudaPluginOrNull(nullptr) : nullptr;
  const runtime::Device device = cuda ? runtime::Device::Cuda(0) : runtime::Device::Cpu();
  const int tokens = o.batch * o.seq;
  const RemovedOnExit data(WriteRandomTokens(int64_t(tokens) * (o.steps + o.warmup + 1), preset));
  nlohmann::json manifest =
      BenchJob(o, data.string(), 1, 1, {"one rank", 1, 1, {o.checkpointing, o.offload}}, cuda != nullptr);
  // --precision (and --compare's): as the spec says it, fp8 with its recipe.
  auto with_precision = [&](nlohmann::json m, const std::string& precision) {
    if (precision.empty()) return m;
    m["spec"]["training"]["precision"] = precision;
    if (precision == "fp8") m["spec"]["training"]["float8"] = {{"recipe", o.float8_recipe}};
    return m;
  };
  manifest = with_precision(manifest, o.precision);
  const api::CheckedJob job = api::CheckTrainingJob(manifest, "bench", 0);
  if (!job.ok()) {
    out << "bench train: " << job.errors.front().ToString() << "\n";
    return kExitInvalid;
  }
  const api::ModelShape shape = api::ShapeOf(job.job.spec.model);
  train::Trainer trainer(job.job, nullptr, device);

  for (int i = 0; i < o.warmup; ++i) trainer.Step();
  const auto start = Clock::now();
  for (int i = 0; i < o.steps; ++i) trainer.Step();
  const double step_seconds = SecondsSince(start) / o.steps;
  // --compare fp32|bf16: the same rank in that precision, on the same tokens and steps.
  std::optional<double> compared_tokens_per_second;
  if (o.compare == "fp32" || o.compare == "bf16") {
    const api::CheckedJob other = api::CheckTrainingJob(with_precision(manifest, o.compare), "bench", 0);
    if (!other.ok()) {
      out << "bench train (" << o.compare << "): " << other.errors.front().ToString() << "\n";
      return kExitInvalid;
    }
    train::Trainer peer(other.job, nullptr, device);
    for (int i = 0; i < o.warmup; ++i) peer.Step();
    const auto peer_start = Clock::now();
    for (int i = 0; i < o.steps; ++i) peer.Step();
    compared_tokens_per_second = tokens / (SecondsSince(peer_start) / o.steps);
  }

  const double params = double(shape.ParameterCount());
  const double flops_per_token = shape.TrainingFlopsPerToken(o.seq);
  const double tokens_per_second = tokens / step_seconds;
  const double gflops = tokens_per_second * flops_per_token / 1e9;
  const double rate = cuda ? StepMatrixGflops(shape, tokens,
                                              [&](const StepProduct& p) {
                                                return cuda->matmul_seconds(0, tokens, p.k, p.n);
                                              })
                           : MeasureSgemmGflops(shape, tokens);
  // MFU is achieved FLOP/s over the device's dense peak; none is known for a CPU.
  runtime::DensePeak peak{0, "no dense fp32 peak is known for a CPU"};
  const std::string precision =
      o.precision == "fp8" ? "fp8 (" + o.float8_recipe + ")" : !o.precision.empty() ? o.precision : cuda ? "bf16" : "fp32";
  std::string where = precision + (cuda ? "" : o.precision == "fp8" ? " over fp32" : "") + " on CPU, " +
                      std::to_string(omp_get_max_threads()) + " threads, " + train::KernelsOn(device);
  if (cuda) {
    const runtime::CudaDeviceFacts facts = cuda->device_facts(0);
    peak = runtime::DenseBf16Peak(facts);
    where = precision + " on " + facts.name;
  }
  const char* unit = cuda ? "TFLOP/s" : "GFLOP/s";
  const double scale = cuda ? 1e-3 : 1;
  const train::MemoryReport m = trainer.memory();
  char line[512];  // room for a device's name (up to 256 bytes)
  std::snprintf(line, sizeof line, "model %s (%.1fM parameters), batch %d x seq %d, ", ModelLabel(o).c_str(), params / 1e6,
                o.batch, o.seq);
  out << line << where << "\n";
  std::snprintf(line, sizeof line, "step time %.1f ms over %d steps: %.0f tokens/s\n", step_seconds * 1e3, o.steps,
                tokens_per_second);
  out << line;
  std::snprintf(line, sizeof line, "achieved %.1f %s (6N + 12LTC = %.2f MFLOP per token)\n", gflops * scale, unit,
                flops_per_token / 1e6);
  out << line;
  if (peak.flops > 0) {
    std::snprintf(line, sizeof line, "MFU %.1f%% of the dense bf16 peak, %.1f TFLOP/s (%s)\n",
                  100 * gflops * 1e9 / peak.flops, peak.flops / 1e12, peak.source.c_str());
  } else {
    std::snprintf(line, sizeof line, "MFU: not counted (%s)\n", peak.source.c_str());
  }
  out << line;
  out << "matrix rate: " << (cuda ? "cuBLASLt bf16" : "OpenBLAS sgemm") << " at the model's shapes, "
      << DescribeProducts(shape, tokens) << ":";
  std::snprintf(line, sizeof line, " %.1f %s; the step reaches %.1f%% of it\n", rate * scale, unit,
                100 * gflops / rate);
  out << line;
  out << (cuda ? "device memory peak: " : "memory: ") << train::FormatMemory(m) << "\n";
  if (compared_tokens_per_second) {
    const std::string theirs = o.compare + (cuda || o.compare == "fp32" ? "" : " (fp32 on the CPU)");
    std::snprintf(line, sizeof line, "%s %.0f tokens/s against %s's %.0f, on the same tokens: %.2fx\n",
                  precision.c_str(), tokens_per_second, theirs.c_str(), *compared_tokens_per_second,
                  tokens_per_second / *compared_tokens_per_second);
    out << line;
  }

  // A mixture of experts against the dense model of its active parameters, on the same
  // tokens, batches and steps.
  const std::optional<api::ModelShape> dense = shape.Family().DenseOfSameActive(shape);
  if (!dense) return kExitOk;
  nlohmann::json dense_manifest = manifest;
  nlohmann::json& model = dense_manifest["spec"]["model"];
  model = api::ToJson(api::SpecOfShape(*dense));
  model["seqLen"] = o.seq;
  const api::CheckedJob dense_job = api::CheckTrainingJob(dense_manifest, "bench (dense)", 0);
  if (!dense_job.ok()) {
    out << "bench train (the dense model): " << dense_job.errors.front().ToString() << "\n";
    return kExitInvalid;
  }
  train::Trainer dense_trainer(dense_job.job, nullptr, device);
  for (int i = 0; i < o.warmup; ++i) dense_trainer.Step();
  const auto dense_start = Clock::now();
  for (int i = 0; i < o.steps; ++i) dense_trainer.Step();
  const double dense_tokens_per_second = tokens / (SecondsSince(dense_start) / o.steps);
  std::snprintf(line, sizeof line, "dense model of the same active parameters (%.1fM parameters, %.2f MFLOP per token): ",
                double(dense->ParameterCount()) / 1e6, dense->TrainingFlopsPerToken(o.seq) / 1e6);
  out << line << api::DescribeShape(*dense) << "\n";
  std::snprintf(line, sizeof line, "%s %.0f tokens/s against the dense model's %.0f: %.2fx\n", ModelLabel(o).c_str(),
                tokens_per_second, dense_tokens_per_second, tokens_per_second / dense_tokens_per_second);
  out << line;
  return kExitOk;
}

}  // namespace

int BenchTrainCommand(const BenchTrainOptions& o, const std::vector<std::string>& self_argv, std::ostream& out) {
  if (comm::WorkerEnvironment::Present()) return BenchTrainRank();
  const api::ModelShape* found = api::FindPreset(o.model);
  if (found == nullptr) {
    out << "--model " << o.model << ": unknown preset\n";
    return kExitUnreadable;
  }
  api::ModelShape cut = *found;
  if (o.layers > 0) cut.layers = o.layers;
  const api::ModelShape* preset = &cut;
  // Without a GPU the ranks would train on the CPU under a heading that says bf16 on the GPU.
  if (RefusedWithoutGpu(o.device, "bench train", out)) return kExitUnreadable;
  try {
    const bool precisions = o.compare == "fp32" || o.compare == "bf16";  // one rank, twice
    if (o.ranks > 1 || o.tp > 1 || (!o.compare.empty() && !precisions)) {
      return BenchTrainRanks(o, *preset, self_argv, out);
    }
    return BenchTrainOneRank(o, *preset, out);
  } catch (const runtime::OutOfMemory& e) {
    out << "bench train: --model " << o.model << " at --batch " << o.batch << " x --seq " << o.seq
        << " does not fit: " << e.what() << "\n";
    return kExitUnreadable;
  }
}

}  // namespace meshtrain::cli
