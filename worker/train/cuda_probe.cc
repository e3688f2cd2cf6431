#include "worker/train/cuda_probe.h"

#include <chrono>

#include "worker/kernels/cuda/kernels.h"
#include "worker/runtime/cuda.h"

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
  namespace kc = kernels::cuda;
  runtime::cuda::UseDevice(device);
  runtime::MemoryAccounting accounting;
  runtime::CachingAllocator allocator(&accounting, runtime::cuda::DeviceMemory());
  runtime::cuda::Stream stream("matmul rate");
  kc::Blas blas;
  auto take = [&](int64_t count) {
    auto* p = static_cast<kc::bf16*>(
        allocator.Allocate(size_t(count) * sizeof(kc::bf16), runtime::MemoryCategory::kActivations));
    Check(cudaMemsetAsync(p, 0x3c, size_t(count) * sizeof(kc::bf16), stream.handle()), "filling a matrix");
    return p;
  };
  kc::bf16 *in = take(int64_t(tokens) * k), *w = take(int64_t(n) * k), *out = take(int64_t(tokens) * n),
           *din = take(int64_t(tokens) * k);
  auto* dw = static_cast<float*>(allocator.Allocate(size_t(n) * k * sizeof(float), runtime::MemoryCategory::kGrads));
  auto product = [&] {
    kc::MatmulForward(blas, out, in, w, nullptr, tokens, k, n, stream.handle());
    kc::MatmulBackward(blas, din, dw, nullptr, out, in, w, tokens, k, n, stream.handle());
  };
  product();  // warm up: cuBLAS picks its kernels
  stream.Synchronize();
  constexpr int kRepeats = 20;
  const auto start = std::chrono::steady_clock::now();
  for (int r = 0; r < kRepeats; ++r) product();
  stream.Synchronize();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / kRepeats;
  for (void* p : {static_cast<void*>(in), static_cast<void*>(w), static_cast<void*>(out), static_cast<void*>(din),
                  static_cast<void*>(dw)}) {
    allocator.Free(p);
  }
  return seconds;
}

}  // namespace meshtrain::train
