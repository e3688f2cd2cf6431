// The device backend contract (tests/support/backend_contract.h) on the CPU, plain and
// strict, and what only the CPU backend has: task failures that skip the rest of the
// queue and travel through events, and the strict mode's poisoned memory.

#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "tests/support/backend_contract.h"
#include "worker/runtime/cpu_backend.h"
#include "worker/runtime/cpu_stream.h"

namespace meshtrain::testing {

struct CpuBackendMaker {
  static void SkipIfAbsent() {}
  static std::unique_ptr<runtime::Backend> Make() { return std::make_unique<runtime::CpuBackend>(); }
  static std::string DescribePrefix() { return "cpu"; }
};

struct StrictCpuBackendMaker {
  static void SkipIfAbsent() {}
  static std::unique_ptr<runtime::Backend> Make() {
    return std::make_unique<runtime::CpuBackend>(runtime::CpuBackendOptions{7, true});
  }
  static std::string DescribePrefix() { return "cpu (strict: jitter seed 7, poisoned memory)"; }
};

using CpuBackends = ::testing::Types<CpuBackendMaker, StrictCpuBackendMaker>;
INSTANTIATE_TYPED_TEST_SUITE_P(Cpu, BackendContract, CpuBackends);

namespace {

using runtime::CpuEvent;
using runtime::CpuStream;

TEST(CpuStream, AFailedTaskSkipsTheRestOfTheQueueAndStaysFailed) {
  CpuStream stream("failing");
  std::atomic<bool> ran_after{false};
  stream.Enqueue([] { throw std::runtime_error("task 1 failed"); });
  stream.Enqueue([&] { ran_after = true; });
  for (int attempt = 0; attempt < 2; ++attempt) {
    try {
      stream.Synchronize(std::chrono::seconds(10));
      ADD_FAILURE() << "no failure reported";
    } catch (const std::runtime_error& e) {
      EXPECT_STREQ(e.what(), "task 1 failed");
    }
  }
  EXPECT_FALSE(ran_after) << "work after a failed task ran";
}

// The consumer waits on an event the failed producer reached: it must fail too, not run
// on data the producer never wrote.
TEST(CpuStream, AnEventCarriesAFailureToTheStreamsThatWaitOnIt) {
  CpuStream producer("comm"), consumer("compute");
  CpuEvent done;
  producer.Enqueue([] { throw std::runtime_error("all_gather on group shard{0-3} failed"); });
  done.Record(producer);
  consumer.Wait(done);
  std::atomic<bool> consumed{false};
  consumer.Enqueue([&] { consumed = true; });
  EXPECT_TRUE(done.Synchronize(std::chrono::seconds(10))) << "a failed stream still reaches its events";
  EXPECT_THROW(consumer.Synchronize(std::chrono::seconds(10)), std::runtime_error);
  EXPECT_FALSE(consumed);
}

TEST(CpuBackend, StrictModePoisonsNewDeviceMemory) {
  runtime::CpuBackend strict(runtime::CpuBackendOptions{0, true});
  runtime::MemorySource source = strict.DeviceMemory();
  auto* values = static_cast<float*>(source.allocate(64 * sizeof(float)));
  ASSERT_NE(values, nullptr);
  for (int i = 0; i < 64; ++i) EXPECT_TRUE(std::isnan(values[i])) << i;
  source.free(values);
  EXPECT_EQ(strict.Describe(), "cpu (strict: poisoned memory)");
  EXPECT_EQ(runtime::CpuBackend(runtime::CpuBackendOptions{3, false}).Describe(), "cpu (strict: jitter seed 3)");
}


}  // namespace
}  // namespace meshtrain::testing
