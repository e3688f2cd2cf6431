// The CPU's streams and events (runtime/cpu_stream.h): order on a thread, concurrency
// between streams, events across them, bounded waits, failures, and the strict backend's
// jitter; the memory pools and their accounting; where a job trains (ChooseDevice) and the
// dense bf16 peak MFU is counted against. The contract every backend keeps is
// tests/support/backend_contract.h (run on the CPU by backend_test.cc); this file holds
// what is the CPU stream's own.

#include <atomic>
#include <chrono>
#include <future>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "worker/runtime/cpu_stream.h"
#include "worker/runtime/device.h"
#include "worker/runtime/device_peak.h"
#include "worker/runtime/memory.h"

namespace meshtrain::runtime {
namespace {

using namespace std::chrono_literals;

TEST(CpuStream, RunsTasksInOrderOnItsOwnThread) {
  CpuStream stream("compute");
  std::vector<int> order;
  std::thread::id worker;
  for (int i = 0; i < 100; ++i) {
    stream.Enqueue([&, i] {
      order.push_back(i);
      worker = std::this_thread::get_id();
    });
  }
  stream.Synchronize();
  ASSERT_EQ(order.size(), 100u);
  for (int i = 0; i < 100; ++i) EXPECT_EQ(order[i], i);
  EXPECT_NE(worker, std::this_thread::get_id());
  EXPECT_EQ(stream.name(), "compute");
}

TEST(CpuStream, TwoStreamsRunConcurrently) {
  // Each stream's task waits for the other's: only truly concurrent streams finish.
  CpuStream a("compute"), b("comm");
  std::promise<void> a_started, b_started;
  auto a_seen = b_started.get_future(), b_seen = a_started.get_future();
  std::atomic<bool> a_ok = false, b_ok = false;
  a.Enqueue([&] {
    a_started.set_value();
    a_ok = a_seen.wait_for(5s) == std::future_status::ready;
  });
  b.Enqueue([&] {
    b_started.set_value();
    b_ok = b_seen.wait_for(5s) == std::future_status::ready;
  });
  a.Synchronize();
  b.Synchronize();
  EXPECT_TRUE(a_ok);
  EXPECT_TRUE(b_ok);
}

TEST(CpuEvent, OrdersWorkAcrossStreams) {
  CpuStream producer("copy"), consumer("compute");
  std::atomic<int> value = 0;
  int seen = -1;
  CpuEvent ready;
  EXPECT_TRUE(ready.Query());  // never recorded
  producer.Enqueue([&] {
    std::this_thread::sleep_for(50ms);
    value = 42;
  });
  ready.Record(producer);
  EXPECT_FALSE(ready.Query());
  consumer.Wait(ready);
  consumer.Enqueue([&] { seen = value; });
  consumer.Synchronize();
  EXPECT_EQ(seen, 42);
  EXPECT_TRUE(ready.Query());
  EXPECT_TRUE(ready.Synchronize(1s));
}

TEST(CpuEvent, SynchronizeTimesOutWhileTheStreamIsBlocked) {
  CpuStream stream("blocked");
  std::promise<void> release;
  auto released = release.get_future().share();
  stream.Enqueue([released] { released.wait_for(10s); });
  CpuEvent event;
  event.Record(stream);
  EXPECT_FALSE(event.Synchronize(50ms));
  release.set_value();
  EXPECT_TRUE(event.Synchronize(5s));
}

// A timeout is the caller giving up, not a failure of the stream: it throws
// StreamTimeout naming the stream, and the work goes on and finishes.
TEST(CpuStream, SynchronizeThrowsAStreamTimeoutNamingTheStreamAndTheWorkGoesOn) {
  CpuStream stream("comm");
  std::promise<void> release;
  auto released = release.get_future().share();
  std::atomic<int> ran = 0;
  stream.Enqueue([released] { released.wait_for(10s); });
  stream.Enqueue([&] { ++ran; });
  try {
    stream.Synchronize(50ms);
    FAIL() << "Synchronize(50 ms) returned while the stream was blocked";
  } catch (const StreamTimeout& e) {
    EXPECT_STREQ(e.what(), "stream comm: its work did not finish within 50 ms");
  }
  EXPECT_EQ(ran, 0);
  release.set_value();
  EXPECT_NO_THROW(stream.Synchronize(5s));
  EXPECT_EQ(ran, 1);
  stream.Enqueue([&] { ++ran; });
  EXPECT_NO_THROW(stream.Synchronize(5s)) << "a timeout must not fail the stream";
  EXPECT_EQ(ran, 2);
}

// The work before a failure runs; the failure is rethrown as it was thrown, by every
// later Synchronize. (backend_test.cc holds that the work after it is skipped.)
TEST(CpuStream, WorkBeforeAFailureRunsAndTheFailureIsRethrownAsThrown) {
  CpuStream stream("failing");
  int ran = 0;
  stream.Enqueue([&] { ++ran; });
  stream.Enqueue([] { throw std::runtime_error("kernel failed"); });
  stream.Enqueue([&] { ++ran; });  // skipped after the failure
  try {
    stream.Synchronize();
    FAIL();
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "kernel failed");
  }
  EXPECT_EQ(ran, 1);
  EXPECT_THROW(stream.Synchronize(), std::runtime_error);
}

// An event carries the failure of the stream that reached it only until it is recorded
// again: recorded on a healthy stream, it no longer fails the streams that wait on it.
// (backend_test.cc holds that it does carry it.)
TEST(CpuEvent, RecordedAgainOnAHealthyStreamItNoLongerCarriesAFailure) {
  CpuStream comm("comm"), compute("compute");
  CpuEvent gathered;
  comm.Enqueue([] { throw std::runtime_error("all_gather failed"); });
  gathered.Record(comm);
  compute.Wait(gathered);
  bool ran = false;
  compute.Enqueue([&] { ran = true; });
  EXPECT_TRUE(gathered.Synchronize(10s));
  try {
    compute.Synchronize();
    FAIL() << "the waiting stream did not fail";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "all_gather failed");
  }
  EXPECT_FALSE(ran);
  CpuStream other("other");
  gathered.Record(other);
  CpuStream later("later");
  later.Wait(gathered);
  later.Enqueue([&] { ran = true; });
  later.Synchronize();
  EXPECT_TRUE(ran);
}

// Two jittered streams, seeded differently, pass a counter back and forth through
// events: each task must see the value the other stream's last task left, whatever the
// delays. The jitter itself must be there: the streams take turns through 300 tasks (a
// wait, a task and a record each turn), and one in two stalling up to 2 ms adds about
// 150 ms, where unjittered ones take microseconds.
TEST(CpuStream, JitteredStreamsStillKeepTheOrderEventsGive) {
  CpuStream ping("ping", CpuJitter{1, 2000us, 2}), pong("pong", CpuJitter{2, 2000us, 2});
  std::vector<std::unique_ptr<CpuEvent>> events;
  int counter = 0;  // touched by one stream at a time, in the order the events give
  std::mutex mutex;
  std::vector<std::string> wrong;
  const auto start = std::chrono::steady_clock::now();
  for (int round = 0; round < 50; ++round) {
    for (CpuStream* stream : {&ping, &pong}) {
      const int expected = int(events.size());
      if (!events.empty()) stream->Wait(*events.back());
      stream->Enqueue([&, expected, stream] {
        if (counter != expected) {
          std::lock_guard lock(mutex);
          wrong.push_back(stream->name() + " saw " + std::to_string(counter) + ", not " + std::to_string(expected));
        }
        counter = expected + 1;
      });
      events.push_back(std::make_unique<CpuEvent>());
      events.back()->Record(*stream);
    }
  }
  ping.Synchronize(10s);
  pong.Synchronize(10s);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(counter, 100);
  EXPECT_TRUE(wrong.empty()) << wrong.size() << " tasks ran out of order, the first: " << wrong.front();
  EXPECT_GT(seconds, 0.03) << "the streams did not jitter";
}

// What the jitter is for: a consumer behind four short tasks reads what a producer with
// an empty queue writes, with the wait on the producer's event forgotten. Unjittered,
// the producer nearly always writes first, and the missing wait hides. A stall of the
// producer longer than the consumer's queue shows it. Measured here, of 200 tries: 0 to 5
// unjittered, 33 to 38 with the default jitter, 0 or 1 with a 0-200 us sleep before
// every task (that delays the longer queue more).
int ReadsBeforeTheWrite(uint64_t seed_base, int tries) {
  int early = 0;
  for (int i = 0; i < tries; ++i) {
    const uint64_t seed = seed_base == 0 ? 0 : seed_base + 2 * uint64_t(i);
    CpuStream consumer("consumer", CpuJitter{seed}), producer("producer", CpuJitter{seed == 0 ? 0 : seed + 1});
    std::promise<void> start;
    std::shared_future<void> started = start.get_future().share();
    std::atomic<int> value{0};
    bool read_early = false;
    consumer.Enqueue([started] { started.wait(); });
    producer.Enqueue([started] { started.wait(); });
    for (int task = 0; task < 4; ++task) {
      consumer.Enqueue([] {
        const auto until = std::chrono::steady_clock::now() + 25us;
        while (std::chrono::steady_clock::now() < until) {
        }
      });
    }
    consumer.Enqueue([&] { read_early = value.load() == 0; });  // no Wait on the producer
    producer.Enqueue([&] { value.store(1); });
    start.set_value();
    consumer.Synchronize(10s);
    producer.Synchronize(10s);
    early += read_early ? 1 : 0;
  }
  return early;
}

TEST(CpuStream, TheJitterShowsAForgottenWaitThatTheNaturalOrderHides) {
  EXPECT_GT(ReadsBeforeTheWrite(/*seed_base=*/1, 200), 0) << "the jitter never let the read overtake the write";
}

TEST(Memory, ALimitReturnsTheCacheFirstThenRefusesNamingTheSizes) {
  MemoryAccounting accounting;
  CachingAllocator allocator(&accounting, HostMemory(), int64_t(4) << 20);
  void* a = allocator.Allocate(2 << 20, MemoryCategory::kParams);
  allocator.Free(a);
  EXPECT_EQ(allocator.cached_bytes(), size_t(2) << 20);
  void* b = allocator.Allocate(3 << 20, MemoryCategory::kGrads);  // 4 MiB: fits once the cache is returned
  EXPECT_EQ(allocator.cached_bytes(), 0u);
  try {
    allocator.Allocate(100, MemoryCategory::kGathered);
    FAIL() << "allocated past the limit";
  } catch (const OutOfMemory& e) {
    EXPECT_STREQ(e.what(), "out of host memory: 512 B for gathered would pass the limit of 4.0 MiB, with 4.0 MiB in use");
  }
  allocator.Free(b);
}

TEST(CpuStream, DestructorDrainsTheQueue) {
  std::atomic<int> ran = 0;
  {
    CpuStream stream("drain");
    for (int i = 0; i < 10; ++i) stream.Enqueue([&] { ++ran; });
  }
  EXPECT_EQ(ran, 10);
}

TEST(Memory, AccountsCurrentAndPeakByCategory) {
  MemoryAccounting accounting;
  CachingAllocator allocator(&accounting);
  void* p = allocator.Allocate(1000, MemoryCategory::kParams);
  void* a = allocator.Allocate(3 << 20, MemoryCategory::kActivations);
  EXPECT_EQ(accounting.current(MemoryCategory::kParams), 1024);
  EXPECT_EQ(accounting.current(MemoryCategory::kActivations), 4 << 20);
  EXPECT_EQ(accounting.current_total(), 1024 + (4 << 20));
  allocator.Free(a);
  EXPECT_EQ(accounting.current(MemoryCategory::kActivations), 0);
  EXPECT_EQ(accounting.peak(MemoryCategory::kActivations), 4 << 20);
  EXPECT_EQ(accounting.peak_total(), 1024 + (4 << 20));
  EXPECT_EQ(allocator.cached_bytes(), size_t(4) << 20);
  // The cached block serves the next request of its size class, in any category.
  void* again = allocator.Allocate((3 << 20) + 5, MemoryCategory::kOffload);
  EXPECT_EQ(again, a);
  EXPECT_EQ(allocator.cached_bytes(), 0u);
  EXPECT_EQ(accounting.current(MemoryCategory::kOffload), 4 << 20);
  allocator.Free(again);
  allocator.Free(p);
  allocator.ReleaseCached();
  EXPECT_EQ(allocator.cached_bytes(), 0u);
  EXPECT_EQ(accounting.current_total(), 0);
  EXPECT_EQ(std::string(MemoryCategoryName(MemoryCategory::kComm)), "comm");
  int not_ours;
  EXPECT_THROW(allocator.Free(&not_ours), std::invalid_argument);
}

TEST(Memory, RoundsToSizeClasses) {
  EXPECT_EQ(CachingAllocator::RoundedSize(1), 512u);
  EXPECT_EQ(CachingAllocator::RoundedSize(513), 1024u);
  EXPECT_EQ(CachingAllocator::RoundedSize(1 << 20), size_t(2) << 20);
  EXPECT_EQ(CachingAllocator::RoundedSize((size_t(2) << 20) + 1), size_t(4) << 20);
}

TEST(Memory, ConcurrentUseKeepsTheBooksBalanced) {
  MemoryAccounting accounting;
  CachingAllocator allocator(&accounting);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 1000; ++i) {
        void* p = allocator.Allocate(size_t(64 * (i % 7 + 1)), MemoryCategory(t % 2));
        allocator.Free(p);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(accounting.current_total(), 0);
  EXPECT_GT(accounting.peak_total(), 0);
  EXPECT_LE(accounting.peak_total(), 4 * 512);
}

TEST(ChooseDevice, Bf16OrAutoTrainsOnTheRanksGpuWhereThereIsOne) {
  for (const char* precision : {"auto", "bf16"}) {
    const DeviceChoice choice = ChooseDevice(precision, 5, 4, "");
    EXPECT_EQ(choice.device, Device::Cuda(1)) << precision;  // local rank 5 of 4 devices
    EXPECT_EQ(choice.precision, "bf16");
    EXPECT_EQ(choice.note, "");
  }
  EXPECT_EQ(ChooseDevice("auto", 0, 1, "").device.ToString(), "cuda:0");
}

TEST(ChooseDevice, WithoutAGpuEverythingTrainsInFp32OnTheCpuAndBf16SaysWhy) {
  const DeviceChoice automatic = ChooseDevice("auto", 0, 0, "this meshtrain was built without CUDA");
  EXPECT_EQ(automatic.device, Device::Cpu());
  EXPECT_EQ(automatic.precision, "fp32");
  EXPECT_EQ(automatic.note, "");  // auto means "whatever this machine does best"
  const DeviceChoice bf16 = ChooseDevice("bf16", 0, 0, "this meshtrain was built without CUDA");
  EXPECT_EQ(bf16.device.ToString(), "cpu");
  EXPECT_EQ(bf16.note,
            "precision bf16 needs a CUDA device, but this meshtrain was built without CUDA; "
            "this run trains in fp32 on the CPU");
  EXPECT_NE(ChooseDevice("bf16", 0, 0, "").note.find("but none is visible;"), std::string::npos);
}

TEST(ChooseDevice, Fp32StaysOnTheCpuEvenWithAGpuAndSaysSo) {
  const DeviceChoice choice = ChooseDevice("fp32", 0, 8, "");
  EXPECT_EQ(choice.device, Device::Cpu());
  EXPECT_NE(choice.note.find("bf16 only"), std::string::npos) << choice.note;
  EXPECT_EQ(ChooseDevice("fp32", 0, 0, "no device").note, "");  // nothing unexpected happened
}

// MFU is counted against the dense bf16 peak, the datasheet's where the device is known.
TEST(DenseBf16Peak, KnownDevicesUseTheirDatasheetFigure) {
  // The lent machine's card: its peak boost clock (1980 MHz) would give 1070 TFLOP/s.
  const DensePeak h100 = DenseBf16Peak({"NVIDIA H100 80GB HBM3", 132, 1980000, 9, 0});
  EXPECT_DOUBLE_EQ(h100.flops, 989.4e12);
  EXPECT_EQ(h100.source, "the datasheet figure for H100");
  EXPECT_DOUBLE_EQ(DenseBf16Peak({"NVIDIA H100 PCIe", 114, 1755000, 9, 0}).flops, 756e12);
  EXPECT_DOUBLE_EQ(DenseBf16Peak({"NVIDIA H200", 132, 1980000, 9, 0}).flops, 989.4e12);
  EXPECT_DOUBLE_EQ(DenseBf16Peak({"NVIDIA A100-SXM4-80GB", 108, 1410000, 8, 0}).flops, 312e12);
  EXPECT_DOUBLE_EQ(DenseBf16Peak({"NVIDIA L40S", 142, 2520000, 8, 9}).flops, 362.05e12);
  EXPECT_DOUBLE_EQ(DenseBf16Peak({"NVIDIA L4", 58, 2040000, 8, 9}).flops, 121e12);
}

TEST(DenseBf16Peak, OtherDevicesAreDerivedFromSmsClockAndCapability) {
  const DensePeak derived = DenseBf16Peak({"Some Hopper", 100, 1500000, 9, 0});
  EXPECT_DOUBLE_EQ(derived.flops, 100 * 1.5e9 * 4096);
  EXPECT_EQ(derived.source, "100 SMs x 1500 MHz x 4096 dense bf16 FLOP per clock (compute capability 9.0)");
  const DensePeak unknown = DenseBf16Peak({"Some Volta", 80, 1530000, 7, 0});
  EXPECT_EQ(unknown.flops, 0);
  EXPECT_EQ(unknown.source, "no dense bf16 rate is known for Some Volta (compute capability 7.0)");
}

}  // namespace
}  // namespace meshtrain::runtime
