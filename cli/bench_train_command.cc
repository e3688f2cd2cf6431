// `meshtrain bench train`: single-rank training throughput through the Trainer, on the
// CPU in fp32 or on GPU 0 in bf16. MFU is achieved model FLOP/s over the device's dense
// peak (runtime/device_peak.h); beside it, the matrix rate measured here at the model's
// own shapes (OpenBLAS sgemm, or cuBLAS bf16) and the share of it the step reaches.

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

#include "api/manifest.h"
#include "api/model_shape.h"
#include "cli/commands.h"
#include "worker/comm/bootstrap.h"
#include "worker/comm/fabric/fabric_communicator.h"
#include "worker/launch/local_launcher.h"
#include "worker/runtime/device_peak.h"
#include "worker/train/cuda_plugin.h"
#include "worker/train/replica.h"
#include "worker/train/token_file.h"
#include "worker/train/trainer.h"

namespace meshtrain::cli {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point since) { return std::chrono::duration<double>(Clock::now() - since).count(); }

// A (tokens x k) by (k x n) product that a training step runs `count` times forward
// (out = in @ W^T) and twice backward (dIn = dOut @ W, dW = dOut^T @ In).
struct StepProduct {
  int k, n, count;
};

std::vector<StepProduct> StepProducts(const api::ModelShape& s) {
  const int C = int(s.hidden), V = int(s.vocab_size), L = int(s.layers);
  return {{C, 3 * C, L}, {C, C, L}, {C, 4 * C, L}, {4 * C, C, L}, {C, V, 1}};
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
    return Seconds(start) / repeats;
  });
}

// 6N + 12LTC: the matrix FLOPs of forward and backward per token, attention included.
double FlopsPerToken(const api::ModelShape& s, int seq) {
  return 6 * double(s.ParameterCount()) + 12.0 * double(s.layers) * seq * double(s.hidden);
}

// The job a benchmark trains: `ranks` ranks with shard groups of `shard`, one micro-step
// of `batch` sequences per rank per step, on random tokens in `data`.
nlohmann::json BenchJob(const BenchTrainOptions& o, const std::string& data, int ranks, int shard, bool bf16) {
  return {{"apiVersion", "meshtrain.dev/v1alpha1"},
          {"kind", "TrainingJob"},
          {"metadata", {{"name", "bench-train"}}},
          {"spec",
           {{"image", "meshtrain"},
            {"gpusPerNode", ranks},
            {"parallelism", {{"hybridShardDegree", shard}}},
            {"model", {{"preset", o.model}, {"seqLen", o.seq}}},
            {"data", {{"train", data}}},
            {"training",
             {{"steps", o.steps + o.warmup}, {"warmupSteps", 1}, {"microBatchSize", o.batch},
              {"globalBatchTokens", ranks * o.batch * o.seq}, {"precision", bf16 ? "bf16" : "fp32"}}}}}};
}

// Random tokens for every step of every rank, in a temporary token file.
std::filesystem::path WriteRandomTokens(const BenchTrainOptions& o, const api::ModelShape& shape, int ranks) {
  const std::filesystem::path data =
      std::filesystem::temp_directory_path() / ("meshtrain-bench-" + std::to_string(::getpid()) + ".bin");
  std::mt19937 rng(7);
  std::vector<uint32_t> random(size_t(ranks) * o.batch * o.seq * (o.steps + o.warmup + 1) + 1);
  for (uint32_t& t : random) t = rng() % uint32_t(shape.vocab_size);
  train::WriteTokenFile(data.string(), random);
  return data;
}

// One rank of a multi-rank benchmark: trains the job in $MESHTRAIN_CONFIG and writes its
// step time and peak memory beside it.
int BenchTrainRank() {
  const comm::WorkerEnvironment env = comm::WorkerEnvironment::FromEnvironment();
  const api::CheckedJob job = api::LoadTrainingJobs(env.config).at(0);
  comm::Rendezvous rendezvous = comm::JoinRendezvous(env, std::chrono::seconds(60));
  auto world = comm::ConnectFabric(rendezvous.table, env.rank, rendezvous.store, comm::FabricOptions::FromEnvironment());
  train::Trainer trainer(job.job, world.get());
  const int64_t steps = job.job.spec.training.steps, warmup = std::min<int64_t>(2, steps - 1);
  for (int64_t i = 0; i < warmup; ++i) trainer.Step();
  world->Barrier()->Wait();
  const auto start = Clock::now();
  double exposed = 0;
  for (int64_t i = warmup; i < steps; ++i) exposed += trainer.Step().comm.exposed;
  world->Barrier()->Wait();
  const double step_seconds = Seconds(start) / double(steps - warmup);
  const train::MemoryReport m = trainer.memory();
  std::ofstream(env.config + ".rank" + std::to_string(env.rank))
      << step_seconds << " " << exposed / double(steps - warmup) << " " << m.params << " " << m.grads << " "
      << m.optimizer << " " << m.activations << " " << m.gathered << "\n";
  return kExitOk;
}

struct RanksResult {
  double tokens_per_second = 0, exposed_seconds = 0;
  train::MemoryReport peak;  // the largest of any rank, by category
  int64_t state() const { return peak.params + peak.grads + peak.optimizer; }
};

// Runs `ranks` ranks with shard groups of `shard` and gathers what they measured.
std::optional<RanksResult> RunBenchRanks(const BenchTrainOptions& o, const std::vector<std::string>& self_argv,
                                         const std::string& data, int shard, std::ostream& out) {
  const std::filesystem::path job =
      std::filesystem::temp_directory_path() / ("meshtrain-bench-" + std::to_string(::getpid()) + ".json");
  std::ofstream(job) << BenchJob(o, data, o.ranks, shard, false).dump(2);
  launch::LocalLaunch launch;
  launch.ranks_per_node = o.ranks;
  launch.command = self_argv;
  launch.job_name = "bench-train";
  launch.environment["MESHTRAIN_CONFIG"] = job.string();
  const int cores = int(std::max(1u, std::thread::hardware_concurrency()));
  launch.environment["OMP_NUM_THREADS"] = std::to_string(std::max(1, cores / o.ranks));
  const bool ok = launch::LaunchLocal(launch, out).status == 0;
  RanksResult result;
  double slowest = 0;
  for (int r = 0; r < o.ranks && ok; ++r) {
    std::ifstream in(job.string() + ".rank" + std::to_string(r));
    double seconds = 0, exposed = 0;
    train::MemoryReport m;
    in >> seconds >> exposed >> m.params >> m.grads >> m.optimizer >> m.activations >> m.gathered;
    slowest = std::max(slowest, seconds);
    result.exposed_seconds = std::max(result.exposed_seconds, exposed);
    result.peak.params = std::max(result.peak.params, m.params);
    result.peak.grads = std::max(result.peak.grads, m.grads);
    result.peak.optimizer = std::max(result.peak.optimizer, m.optimizer);
    result.peak.activations = std::max(result.peak.activations, m.activations);
    result.peak.gathered = std::max(result.peak.gathered, m.gathered);
    std::filesystem::remove(job.string() + ".rank" + std::to_string(r));
  }
  std::filesystem::remove(job);
  if (!ok || slowest <= 0) return std::nullopt;
  result.tokens_per_second = double(o.ranks) * o.batch * o.seq / slowest;
  return result;
}

void PrintRanks(const char* name, int ranks, int shard, const RanksResult& r, std::ostream& out) {
  char line[256];
  std::snprintf(line, sizeof line, "%s: %d ranks, shard groups of %d: %.0f tokens/s, %.1f ms a step exposed comm\n",
                name, ranks, shard, r.tokens_per_second, r.exposed_seconds * 1e3);
  out << line << "  per-rank peak: " << train::FormatMemory(r.peak) << "; params + grads + optimizer "
      << runtime::FormatMiB(r.state()) << "\n";
}

int BenchTrainRanks(const BenchTrainOptions& o, const api::ModelShape& shape, const std::vector<std::string>& self_argv,
                    std::ostream& out) {
  if (o.device != "cpu") {
    out << "bench train --ranks: the sharded engine runs on the CPU; use --device cpu\n";
    return kExitInvalid;
  }
  const int shard = o.shard == 0 ? o.ranks : o.shard;
  const api::CheckedJob check = api::CheckTrainingJob(BenchJob(o, "unused", o.ranks, o.shard, false), "bench", 0);
  if (!check.ok()) {
    out << "bench train: " << check.errors.front().ToString() << "\n";
    return kExitInvalid;
  }
  const std::filesystem::path data = WriteRandomTokens(o, shape, o.ranks);
  char line[256];
  std::snprintf(line, sizeof line, "model %s (%.1fM parameters), %d ranks x batch %d x seq %d a step, fp32 on CPU\n",
                o.model.c_str(), double(shape.ParameterCount()) / 1e6, o.ranks, o.batch, o.seq);
  out << line;
  const std::optional<RanksResult> sharded = RunBenchRanks(o, self_argv, data.string(), o.shard, out);
  std::optional<RanksResult> replicated;
  if (sharded && o.compare == "replicated") replicated = RunBenchRanks(o, self_argv, data.string(), 1, out);
  std::filesystem::remove(data);
  if (!sharded || (o.compare == "replicated" && !replicated)) {
    out << "bench train: the ranks failed\n";
    return kExitInvalid;
  }
  PrintRanks(shard == 1 ? "replicated" : "sharded", o.ranks, shard, *sharded, out);
  if (!replicated) return kExitOk;
  PrintRanks("replicated", o.ranks, 1, *replicated, out);
  std::snprintf(line, sizeof line, "sharded / replicated: tokens/s %.2f (%.0f / %.0f), params + grads + optimizer %.2f (%s / %s)\n",
                sharded->tokens_per_second / replicated->tokens_per_second, sharded->tokens_per_second,
                replicated->tokens_per_second, double(sharded->state()) / double(replicated->state()),
                runtime::FormatMiB(sharded->state()).c_str(), runtime::FormatMiB(replicated->state()).c_str());
  out << line;
  return kExitOk;
}

}  // namespace

int BenchTrainCommand(const BenchTrainOptions& o, const std::vector<std::string>& self_argv, std::ostream& out) {
  if (comm::WorkerEnvironment::Present()) return BenchTrainRank();
  const api::ModelShape* preset = api::FindPreset(o.model);
  if (preset == nullptr) {
    out << "--model " << o.model << ": unknown preset\n";
    return kExitUnreadable;
  }
  if (o.ranks > 1) return BenchTrainRanks(o, *preset, self_argv, out);
  const train::CudaPlugin* cuda = nullptr;
  if (o.device == "cuda") {
    std::string why;
    if (train::CudaDeviceCount(&why) == 0) {
      out << "bench train --device cuda: " << why << "\n";
      return kExitUnreadable;
    }
    cuda = train::CudaPluginOrNull(nullptr);
  }
  const runtime::Device device = cuda ? runtime::Device::Cuda(0) : runtime::Device::Cpu();
  const int tokens = o.batch * o.seq;
  const std::filesystem::path data = WriteRandomTokens(o, *preset, 1);
  const nlohmann::json manifest = BenchJob(o, data.string(), 1, 0, cuda != nullptr);
  const api::CheckedJob job = api::CheckTrainingJob(manifest, "bench", 0);
  if (!job.ok()) {
    out << "bench train: " << job.errors.front().ToString() << "\n";
    std::filesystem::remove(data);
    return kExitInvalid;
  }
  const api::ModelShape shape = api::ShapeOf(job.job.spec.model);
  train::Trainer trainer(job.job, nullptr, device);
  std::filesystem::remove(data);  // mapped already

  for (int i = 0; i < o.warmup; ++i) trainer.Step();
  const auto start = Clock::now();
  for (int i = 0; i < o.steps; ++i) trainer.Step();
  const double step_seconds = Seconds(start) / o.steps;

  const double params = double(shape.ParameterCount());
  const double flops_per_token = FlopsPerToken(shape, o.seq);
  const double tokens_per_second = tokens / step_seconds;
  const double gflops = tokens_per_second * flops_per_token / 1e9;
  const double rate = cuda ? StepMatrixGflops(shape, tokens,
                                              [&](const StepProduct& p) {
                                                return cuda->matmul_seconds(0, tokens, p.k, p.n);
                                              })
                           : MeasureSgemmGflops(shape, tokens);
  // MFU is achieved FLOP/s over the device's dense peak; none is known for a CPU.
  runtime::DensePeak peak{0, "no dense fp32 peak is known for a CPU"};
  std::string where = "fp32 on CPU, " + std::to_string(omp_get_max_threads()) + " threads";
  if (cuda) {
    const runtime::CudaDeviceFacts facts = cuda->device_facts(0);
    peak = runtime::DenseBf16Peak(facts);
    where = "bf16 on " + facts.name;
  }
  const char* unit = cuda ? "TFLOP/s" : "GFLOP/s";
  const double scale = cuda ? 1e-3 : 1;
  const train::MemoryReport m = trainer.memory();
  char line[512];  // room for a device's name (up to 256 bytes)
  std::snprintf(line, sizeof line, "model %s (%.1fM parameters), batch %d x seq %d, %s\n", o.model.c_str(),
                params / 1e6, o.batch, o.seq, where.c_str());
  out << line;
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
  out << "matrix rate: " << (cuda ? "cuBLAS bf16" : "OpenBLAS sgemm") << " at the model's shapes, "
      << DescribeProducts(shape, tokens) << ":";
  std::snprintf(line, sizeof line, " %.1f %s; the step reaches %.1f%% of it\n", rate * scale, unit,
                100 * gflops / rate);
  out << line;
  out << (cuda ? "device memory peak: " : "memory: ") << train::FormatMemory(m) << "\n";
  return kExitOk;
}

}  // namespace meshtrain::cli
