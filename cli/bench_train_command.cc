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
#include <random>

#include "api/manifest.h"
#include "api/model_shape.h"
#include "cli/commands.h"
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

}  // namespace

int BenchTrainCommand(const BenchTrainOptions& o, std::ostream& out) {
  const api::ModelShape* preset = api::FindPreset(o.model);
  if (preset == nullptr) {
    out << "--model " << o.model << ": unknown preset\n";
    return kExitUnreadable;
  }
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
  // Random tokens, enough for every step, in a temporary token file.
  const std::filesystem::path data =
      std::filesystem::temp_directory_path() / ("meshtrain-bench-" + std::to_string(::getpid()) + ".bin");
  {
    std::mt19937 rng(7);
    std::vector<uint32_t> random(size_t(tokens) * (o.steps + o.warmup + 1) + 1);
    for (uint32_t& t : random) t = rng() % uint32_t(preset->vocab_size);
    train::WriteTokenFile(data.string(), random);
  }
  const nlohmann::json manifest = {
      {"apiVersion", "meshtrain.dev/v1alpha1"},
      {"kind", "TrainingJob"},
      {"metadata", {{"name", "bench-train"}}},
      {"spec",
       {{"image", "meshtrain"},
        {"model", {{"preset", o.model}, {"seqLen", o.seq}}},
        {"data", {{"train", data.string()}}},
        {"training",
         {{"steps", o.steps + o.warmup}, {"warmupSteps", 1}, {"microBatchSize", o.batch}, {"globalBatchTokens", tokens},
          {"precision", cuda ? "bf16" : "fp32"}}}}}};
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
  std::snprintf(line, sizeof line, "%s: params %.1f MiB, grads %.1f MiB, optimizer %.1f MiB, activations %.1f MiB\n",
                cuda ? "device memory peak" : "memory", m.params / 1048576.0, m.grads / 1048576.0,
                m.optimizer / 1048576.0, m.activations / 1048576.0);
  out << line;
  return kExitOk;
}

}  // namespace meshtrain::cli
