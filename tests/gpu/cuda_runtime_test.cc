// worker/runtime/cuda.h: devices, streams and events, and the device and pinned-host
// sources of the caching allocator.

#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "tests/support/gpu.h"
#include "worker/runtime/cuda.h"
#include "worker/runtime/memory.h"

namespace meshtrain::runtime::cuda {
namespace {

// Runs with or without a GPU: a device past the last one is refused by name.
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

TEST(CudaRuntime, StreamsOrderedThroughAnEvent) {
  MESHTRAIN_SKIP_WITHOUT_GPU();
  UseDevice(0);
  const size_t bytes = size_t{64} << 20;
  MemoryAccounting accounting;
  CachingAllocator device(&accounting, DeviceMemory()), pinned(&accounting, PinnedHostMemory());
  auto* buffer = static_cast<char*>(device.Allocate(bytes, MemoryCategory::kActivations));
  auto* host = static_cast<char*>(pinned.Allocate(bytes, MemoryCategory::kOffload));
  std::memset(host, 0, bytes);
  Stream compute("compute"), copy("copy");
  Event written;
  // The copy stream must not read the buffer before the compute stream has filled it.
  Check(cudaMemsetAsync(buffer, 0x5a, bytes, compute.handle()), "memset");
  written.Record(compute);
  copy.Wait(written);
  Check(cudaMemcpyAsync(host, buffer, bytes, cudaMemcpyDeviceToHost, copy.handle()), "copy");
  copy.Synchronize();
  EXPECT_TRUE(written.Synchronize(std::chrono::seconds(10)));
  EXPECT_TRUE(written.Query());
  for (size_t i = 0; i < bytes; i += 4093) ASSERT_EQ(host[i], 0x5a) << "byte " << i;
  EXPECT_EQ(host[bytes - 1], 0x5a);
  device.Free(buffer);
  pinned.Free(host);
}

TEST(CudaRuntime, DeviceAllocatorCachesAccountsAndNamesExhaustion) {
  MESHTRAIN_SKIP_WITHOUT_GPU();
  UseDevice(0);
  MemoryAccounting accounting;
  CachingAllocator device(&accounting, DeviceMemory());
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
  Check(cudaGetLastError(), "after the failed allocation");  // not left sticky
  device.Free(first);
}

}  // namespace
}  // namespace meshtrain::runtime::cuda
