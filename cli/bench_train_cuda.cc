// `meshtrain bench train --device cuda`: mixed-precision (bf16) training throughput on
// one GPU, against the cuBLAS bf16 rate measured here at the model's own matrix shapes.

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <vector>

#include "api/model_shape.h"
#include "cli/bench_train.h"
#include "cli/commands.h"
#include "worker/kernels/cuda/kernels.h"
#include "worker/model/gpt2_cuda.h"
#include "worker/runtime/cuda.h"

namespace meshtrain::cli {
namespace {

using Clock = std::chrono::steady_clock;
using runtime::cuda::Check;
namespace k = kernels::cuda;

double Seconds(Clock::time_point since) { return std::chrono::duration<double>(Clock::now() - since).count(); }

// GFLOP/s of cuBLAS in bf16 over the products of one training step.
double MeasureBf16Gflops(const api::ModelShape& s, int tokens) {
  runtime::MemoryAccounting accounting;
  runtime::CachingAllocator allocator(&accounting, runtime::cuda::DeviceMemory());
  runtime::cuda::Stream stream("bench");
  k::Blas blas;
  return StepMatrixGflops(s, tokens, [&](const StepProduct& sh) {
    auto take = [&](int64_t n) {
      auto* p = static_cast<k::bf16*>(
          allocator.Allocate(size_t(n) * sizeof(k::bf16), runtime::MemoryCategory::kActivations));
      Check(cudaMemsetAsync(p, 0x3c, size_t(n) * sizeof(k::bf16), stream.handle()), "filling a bench matrix");
      return p;
    };
    k::bf16 *in = take(int64_t(tokens) * sh.k), *w = take(int64_t(sh.n) * sh.k), *out = take(int64_t(tokens) * sh.n),
            *din = take(int64_t(tokens) * sh.k);
    auto* dw = static_cast<float*>(
        allocator.Allocate(size_t(sh.n) * sh.k * sizeof(float), runtime::MemoryCategory::kGrads));
    auto step = [&] {
      k::MatmulForward(blas, out, in, w, nullptr, tokens, sh.k, sh.n, stream.handle());
      k::MatmulBackward(blas, din, dw, nullptr, out, in, w, tokens, sh.k, sh.n, stream.handle());
    };
    step();  // warm up: cuBLAS picks its kernels
    stream.Synchronize();
    const int repeats = 20;
    const auto start = Clock::now();
    for (int r = 0; r < repeats; ++r) step();
    stream.Synchronize();
    for (void* p : {static_cast<void*>(in), static_cast<void*>(w), static_cast<void*>(out), static_cast<void*>(din),
                    static_cast<void*>(dw)}) {
      allocator.Free(p);
    }
    return Seconds(start) / repeats;
  });
}

}  // namespace

int BenchTrainCudaCommand(const BenchTrainOptions& o, const api::ModelShape& preset, std::ostream& out) {
  if (runtime::cuda::DeviceCount() == 0) {
    out << "bench train --device cuda: no CUDA device (the CUDA runtime sees none)\n";
    return kExitUnreadable;
  }
  runtime::cuda::UseDevice(0);
  api::ModelShape shape = preset;
  shape.seq_len = std::max<int64_t>(shape.seq_len, o.seq);
  const int tokens = o.batch * o.seq;
  runtime::MemoryAccounting accounting;
  model::Gpt2Cuda model(shape, o.batch, o.seq, /*seed=*/1, &accounting);
  std::mt19937 rng(7);
  std::vector<int32_t> inputs(static_cast<size_t>(tokens)), targets(inputs.size());
  auto step = [&](int64_t t) {
    for (size_t i = 0; i < inputs.size(); ++i) {
      inputs[i] = int32_t(rng() % uint32_t(shape.vocab_size));
      targets[i] = int32_t(rng() % uint32_t(shape.vocab_size));
    }
    model.ZeroGrad();
    model.Forward(inputs.data(), targets.data(), o.batch, o.seq);
    model.Backward(1.0f);
    model.Update(3e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, 1.0f, t);
  };
  for (int i = 0; i < o.warmup; ++i) step(i + 1);
  model.stream().Synchronize();
  const auto start = Clock::now();
  for (int i = 0; i < o.steps; ++i) step(o.warmup + i + 1);
  model.stream().Synchronize();
  const double step_seconds = Seconds(start) / o.steps;

  const double params = double(shape.ParameterCount());
  const double flops_per_token = FlopsPerToken(shape, o.seq);
  const double tokens_per_second = tokens / step_seconds;
  const double gflops = tokens_per_second * flops_per_token / 1e9;
  const double bf16_rate = MeasureBf16Gflops(shape, tokens);
  cudaDeviceProp properties{};
  Check(cudaGetDeviceProperties(&properties, 0), "cudaGetDeviceProperties");
  using runtime::MemoryCategory;
  char line[512];  // room for the device's name (up to 256 bytes)
  std::snprintf(line, sizeof line, "model %s (%.1fM parameters), batch %d x seq %d, bf16 on %s\n", o.model.c_str(),
                params / 1e6, o.batch, o.seq, properties.name);
  out << line;
  std::snprintf(line, sizeof line, "step time %.1f ms over %d steps: %.0f tokens/s\n", step_seconds * 1e3, o.steps,
                tokens_per_second);
  out << line;
  std::snprintf(line, sizeof line, "achieved %.1f TFLOP/s (6N + 12LTC = %.2f MFLOP per token)\n", gflops / 1e3,
                flops_per_token / 1e6);
  out << line;
  std::snprintf(line, sizeof line, "cuBLAS bf16 at the model's shapes: %.1f TFLOP/s; MFU against it: %.1f%%\n",
                bf16_rate / 1e3, 100 * gflops / bf16_rate);
  out << line;
  std::snprintf(line, sizeof line,
                "device memory peak: params %.1f MiB, grads %.1f MiB, optimizer %.1f MiB, activations %.1f MiB\n",
                accounting.peak(MemoryCategory::kParams) / 1048576.0, accounting.peak(MemoryCategory::kGrads) / 1048576.0,
                accounting.peak(MemoryCategory::kOptimizer) / 1048576.0,
                accounting.peak(MemoryCategory::kActivations) / 1048576.0);
  out << line;
  return kExitOk;
}

}  // namespace meshtrain::cli
