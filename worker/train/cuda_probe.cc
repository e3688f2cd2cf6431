#include "worker/train/cuda_probe.h"

#include <chrono>
#include <memory>

#include "worker/kernels/cuda/cuda_ops.h"
#include "worker/runtime/cuda.h"
#include "worker/runtime/device_memory.h"

namespace meshtrain::train {

using runtime::cuda::Check;

runtime::CudaDeviceFacts ProbeDeviceFacts(int device) {
  runtime::cuda::UseDevice(device);
  cudaDeviceProp properties{};
  Check(cudaGetDeviceProperties(&properties, device), "cudaGetDeviceProperties");
  runtime::CudaDeviceFacts facts;
  facts.name = properties.name;
  facts.multiprocessors = properties.multiProcessorCount;
  facts.compute_major = properties.major;
  facts.compute_minor = properties.minor;
  // CUDA 13 keeps the clock only as an attribute.
  Check(cudaDeviceGetAttribute(&facts.clock_khz, cudaDevAttrClockRate, device), "cudaDeviceGetAttribute(clock rate)");
  return facts;
}

double ProbeMatmulSeconds(int device, int tokens, int k, int n) {
  const std::unique_ptr<runtime::Backend> backend = runtime::cuda::MakeCudaBackend(device);
  runtime::MemoryAccounting accounting;
  runtime::CachingAllocator allocator(&accounting, backend->DeviceMemory());
  const std::unique_ptr<kernels::Ops<kernels::Bf16>> ops = kernels::cuda::MakeCudaOps(*backend, &allocator);
  const std::unique_ptr<runtime::Stream> stream = backend->NewStream("matmul rate");
  using runtime::bf16;
  using runtime::MemoryCategory;
  auto matrix = [&](int64_t count) {
    runtime::DeviceArray<bf16> m(&allocator, count, MemoryCategory::kActivations);
    backend->Fill(m.get(), 0x3c, m.bytes(), *stream);  // 0x3c3c: 0.0115, never zero
    return m;
  };
  runtime::DeviceArray<bf16> in = matrix(int64_t(tokens) * k), w = matrix(int64_t(n) * k),
                             out = matrix(int64_t(tokens) * n), din = matrix(int64_t(tokens) * k);
  runtime::DeviceArray<float> dw(&allocator, int64_t(n) * k, MemoryCategory::kGrads);
  backend->Zero(dw.get(), dw.size(), *stream);
  auto product = [&] {
    ops->MatmulForward(out.get(), nullptr, in.get(), w.get(), nullptr, nullptr, tokens, k, n, *stream);
    ops->MatmulBackward(din.get(), dw.get(), nullptr, out.get(), in.get(), w.get(), nullptr, tokens, k, n, *stream);
  };
  product();  // warm up: cuBLASLt picks its kernels
  stream->Synchronize();
  constexpr int kRepeats = 20;
  const auto start = std::chrono::steady_clock::now();
  for (int r = 0; r < kRepeats; ++r) product();
  stream->Synchronize();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / kRepeats;
}

}  // namespace meshtrain::train
