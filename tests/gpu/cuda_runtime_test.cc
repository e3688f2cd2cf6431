// worker/runtime/cuda.h: the device backend contract (tests/support/backend_contract.h)
// on CUDA, and what only CUDA has: devices, real stream and memory kinds, the caching
// allocator over cudaMalloc, and a failed kernel reported by the stream it ran on.

#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "tests/support/backend_contract.h"
#include "tests/support/gpu.h"
#include "worker/runtime/cpu_stream.h"
#include "worker/runtime/cuda.h"
#include "worker/runtime/memory.h"

namespace meshtrain::testing {

struct CudaBackendMaker {
  static void SkipIfAbsent() { MESHTRAIN_SKIP_WITHOUT_GPU(); }
  static std::unique_ptr<runtime::Backend> Make() { return runtime::cuda::MakeCudaBackend(0); }
  static std::string DescribePrefix() { return "cuda:0 ("; }
};

INSTANTIATE_TYPED_TEST_SUITE_P(Cuda, BackendContract, ::testing::Types<CudaBackendMaker>);

namespace {

using namespace runtime;
using namespace runtime::cuda;

// Runs with or without a GPU (no driver counts as no device): a device past the last one
// is refused by name.
TEST(CudaRuntime, UsingAMissingDeviceNamesItAndTheCount) {
  const int count = DeviceCount();
  try {
    UseDevice(count);
    FAIL() << "UseDevice(" << count << ") succeeded";
  } catch (const CudaError& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("CUDA device " + std::to_string(count) + " does not exist"), std::string::npos) << message;
    EXPECT_NE(message.find("sees " + std::to_string(count)), std::string::npos) << message;
  }
}

TEST(CudaRuntime, DescribesTheDeviceByName) {
  MESHTRAIN_SKIP_WITHOUT_GPU();
  cudaDeviceProp properties{};
  ASSERT_EQ(cudaGetDeviceProperties(&properties, 0), cudaSuccess);
  auto backend = MakeCudaBackend(0);
  EXPECT_EQ(backend->Describe(), std::string("cuda:0 (") + properties.name + ")");
  EXPECT_EQ(backend->device(), Device::Cuda(0));
}

TEST(CudaRuntime, StreamsAreNonBlockingAndRefuseCpuEvents) {
  MESHTRAIN_SKIP_WITHOUT_GPU();
  auto backend = MakeCudaBackend(0);
  auto stream = backend->NewStream("compute");
  unsigned flags = 0;
  ASSERT_EQ(cudaStreamGetFlags(StreamHandle(*stream), &flags), cudaSuccess);
  EXPECT_EQ(flags & cudaStreamNonBlocking, unsigned(cudaStreamNonBlocking)) << "it would serialise with stream 0";
  CpuEvent cpu_event;
  try {
    stream->Wait(cpu_event);
    ADD_FAILURE() << "a CUDA stream waited on a CPU event";
  } catch (const std::logic_error& e) {
    EXPECT_NE(std::string(e.what()).find("compute"), std::string::npos) << e.what();
  }
  CpuStream cpu_stream("cpu-copy");
  try {
    StreamHandle(cpu_stream);
    ADD_FAILURE() << "a CPU stream has a cudaStream_t";
  } catch (const std::logic_error& e) {
    EXPECT_NE(std::string(e.what()).find("cpu-copy"), std::string::npos) << e.what();
  }
}

TEST(CudaRuntime, MemoryIsOfTheKindItsSourceSays) {
  MESHTRAIN_SKIP_WITHOUT_GPU();
  auto backend = MakeCudaBackend(0);
  MemorySource device = backend->DeviceMemory(), pinned = backend->PinnedHostMemory();
  void* on_device = device.allocate(1 << 20);
  void* page_locked = pinned.allocate(1 << 20);
  ASSERT_NE(on_device, nullptr);
  ASSERT_NE(page_locked, nullptr);
  cudaPointerAttributes attributes{};
  ASSERT_EQ(cudaPointerGetAttributes(&attributes, on_device), cudaSuccess);
  EXPECT_EQ(attributes.type, cudaMemoryTypeDevice);
  EXPECT_EQ(attributes.device, 0);
  ASSERT_EQ(cudaPointerGetAttributes(&attributes, page_locked), cudaSuccess);
  EXPECT_EQ(attributes.type, cudaMemoryTypeHost) << "pinned host memory is not page-locked";
  device.free(on_device);
  pinned.free(page_locked);
}

TEST(CudaRuntime, DeviceAllocatorCachesAccountsAndNamesExhaustion) {
  MESHTRAIN_SKIP_WITHOUT_GPU();
  auto backend = MakeCudaBackend(0);
  MemoryAccounting accounting;
  CachingAllocator device(&accounting, backend->DeviceMemory());
  void* first = device.Allocate(3 << 20, MemoryCategory::kParams);
  EXPECT_EQ(accounting.current(MemoryCategory::kParams), int64_t(CachingAllocator::RoundedSize(3 << 20)));
  device.Free(first);
  EXPECT_EQ(accounting.current(MemoryCategory::kParams), 0);
  EXPECT_EQ(device.Allocate(3 << 20, MemoryCategory::kGrads), first);  // reused, not cudaMalloc'd again
  EXPECT_EQ(accounting.peak(MemoryCategory::kParams), int64_t(CachingAllocator::RoundedSize(3 << 20)));
  try {
    device.Allocate(size_t{1} << 50, MemoryCategory::kActivations);  // a petabyte
    FAIL() << "a petabyte was allocated";
  } catch (const OutOfMemory& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("out of cuda memory"), std::string::npos) << message;
    EXPECT_NE(message.find("activations"), std::string::npos) << message;
  }
  EXPECT_EQ(cudaGetLastError(), cudaSuccess) << "the failed cudaMalloc left its error behind";
  device.Free(first);
}

// A kernel that traps, as PTX the driver compiles for whatever GPU this is.
constexpr char kTrapPtx[] = R"(
.version 8.0
.target sm_80
.address_size 64
.visible .entry meshtrain_trap()
{
  trap;
}
)";

// A failed kernel poisons its CUDA context for good, so it runs in a child process (a
// death test re-executes this binary): the stream's Synchronize throws CudaError naming
// the stream, and the stream and backend are then destroyed without hanging.
TEST(CudaRuntimeDeathTest, AFailedKernelIsThrownNamingItsStream) {
  MESHTRAIN_SKIP_WITHOUT_GPU();
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        auto backend = MakeCudaBackend(0);
        auto stream = backend->NewStream("faulty-stream");
        cudaLibrary_t library = nullptr;
        cudaKernel_t kernel = nullptr;
        Check(cudaLibraryLoadData(&library, kTrapPtx, nullptr, nullptr, 0, nullptr, nullptr, 0), "loading the PTX");
        Check(cudaLibraryGetKernel(&kernel, library, "meshtrain_trap"), "cudaLibraryGetKernel");
        Check(cudaLaunchKernel(reinterpret_cast<const void*>(kernel), dim3(1), dim3(1), nullptr, 0,
                               StreamHandle(*stream)),
              "launching the trap");
        int code = 1;
        try {
          stream->Synchronize(std::chrono::seconds(30));
          std::fprintf(stderr, "Synchronize returned after a trap\n");
        } catch (const CudaError& e) {
          std::fprintf(stderr, "%s\n", e.what());
          code = 0;
        }
        stream.reset();
        backend.reset();
        std::fprintf(stderr, "destroyed\n");
        std::exit(code);
      },
      ::testing::ExitedWithCode(0), "stream faulty-stream: its work on device 0: .*\ndestroyed");
}

}  // namespace
}  // namespace meshtrain::testing
