// `meshtrain bench train`: single-rank training throughput on the CPU, against the
// OpenBLAS sgemm rate measured here at the model's own matrix shapes (--device cuda:
// bench_train_cuda.cc).

#include <cblas.h>
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <random>

#include "api/manifest.h"
#include "api/model_shape.h"
#include "cli/bench_train.h"
#include "cli/commands.h"
#include "worker/train/token_file.h"
#include "worker/train/trainer.h"

namespace meshtrain::cli {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point since) { return std::chrono::duration<double>(Clock::now() - since).count(); }

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

}  // namespace

int BenchTrainCommand(const BenchTrainOptions& o, std::ostream& out) {
  const api::ModelShape* preset = api::FindPreset(o.model);
  if (preset == nullptr) {
    out << "--model " << o.model << ": unknown preset\n";
    return kExitUnreadable;
  }
  if (o.device == "cuda") {
#ifdef MESHTRAIN_HAVE_CUDA
    return BenchTrainCudaCommand(o, *preset, out);
#else
    out << "bench train --device cuda: this meshtrain was built without CUDA (MESHTRAIN_CUDA=OFF or no toolkit)\n";
    return kExitUnreadable;
#endif
  }
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
          {"precision", "fp32"}}}}}};
  const api::CheckedJob job = api::CheckTrainingJob(manifest, "bench", 0);
  if (!job.ok()) {
    out << "bench train: " << job.errors.front().ToString() << "\n";
    std::filesystem::remove(data);
    return kExitInvalid;
  }
  const api::ModelShape shape = api::ShapeOf(job.job.spec.model);
  train::Trainer trainer(job.job);
  std::filesystem::remove(data);  // mapped already

  for (int i = 0; i < o.warmup; ++i) trainer.Step();
  const auto start = Clock::now();
  for (int i = 0; i < o.steps; ++i) trainer.Step();
  const double step_seconds = Seconds(start) / o.steps;

  const double params = double(shape.ParameterCount());
  const double flops_per_token = FlopsPerToken(shape, o.seq);
  const double tokens_per_second = tokens / step_seconds;
  const double gflops = tokens_per_second * flops_per_token / 1e9;
  const double sgemm = MeasureSgemmGflops(shape, tokens);
  const train::MemoryReport m = trainer.memory();
  char line[256];
  std::snprintf(line, sizeof line, "model %s (%.1fM parameters), batch %d x seq %d, fp32 on CPU, %d threads\n",
                o.model.c_str(), params / 1e6, o.batch, o.seq, omp_get_max_threads());
  out << line;
  std::snprintf(line, sizeof line, "step time %.1f ms over %d steps: %.0f tokens/s\n", step_seconds * 1e3, o.steps,
                tokens_per_second);
  out << line;
  std::snprintf(line, sizeof line, "achieved %.1f GFLOP/s (6N + 12LTC = %.2f MFLOP per token)\n", gflops,
                flops_per_token / 1e6);
  out << line;
  std::snprintf(line, sizeof line, "OpenBLAS sgemm at the model's shapes: %.1f GFLOP/s; MFU against it: %.1f%%\n",
                sgemm, 100 * gflops / sgemm);
  out << line;
  std::snprintf(line, sizeof line, "memory: params %.1f MiB, grads %.1f MiB, optimizer %.1f MiB, activations %.1f MiB\n",
                m.params / 1048576.0, m.grads / 1048576.0, m.optimizer / 1048576.0, m.activations / 1048576.0);
  out << line;
  return kExitOk;
}

}  // namespace meshtrain::cli
