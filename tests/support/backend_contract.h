// The contract of runtime/stream.h and runtime/backend.h, written once and run on every
// device backend: tests/unit/backend_test.cc instantiates it for the CPU (plain and
// strict), tests/gpu/cuda_runtime_test.cc for CUDA. Each test sets work up so that a
// backend breaking the contract gives a wrong result, not a lucky pass: slow producers
// (a HostCallback that sleeps) in front of the work that must wait for them, random
// data, and fills and copies at odd offsets.
//
// The type parameter makes a backend:
//   struct Maker {
//     static void SkipIfAbsent();                       // GTEST_SKIP()s where the device is missing
//     static std::unique_ptr<runtime::Backend> Make();
//     static std::string DescribePrefix();              // what Describe() starts with
//   };
// Include this header from one source file of a test binary, then
//   INSTANTIATE_TYPED_TEST_SUITE_P(Name, BackendContract, ::testing::Types<Maker...>);
// inside namespace meshtrain::testing.

#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "worker/runtime/backend.h"
#include "worker/runtime/device_side.h"
#include "worker/runtime/memory.h"
#include "worker/runtime/stream.h"

namespace meshtrain::testing {

using namespace std::chrono_literals;

// A stream and an event of no backend, to hand to one that must refuse them.
class ForeignStream final : public runtime::Stream {
 public:
  explicit ForeignStream(std::string name) : name_(std::move(name)) {}
  const std::string& name() const override { return name_; }
  void Wait(runtime::Event&) override {}
  void Synchronize(runtime::milliseconds) override {}
  void HostCallback(std::function<void()>) override {}

 private:
  std::string name_;
};

class ForeignEvent final : public runtime::Event {
 public:
  void Record(runtime::Stream&) override {}
  bool Query() override { return true; }
  bool Synchronize(runtime::milliseconds) override { return true; }
};

inline std::vector<uint8_t> RandomBytes(size_t n, uint64_t seed) {
  std::mt19937_64 random(seed);
  std::vector<uint8_t> bytes(n);
  for (uint8_t& byte : bytes) byte = uint8_t(random());
  return bytes;
}

inline std::function<void()> SleepFor(std::chrono::milliseconds duration) {
  return [duration] { std::this_thread::sleep_for(duration); };
}

// Bytes of `got` that differ from `want`, for messages that say how much went wrong.
inline size_t Mismatches(const uint8_t* got, const uint8_t* want, size_t n) {
  size_t wrong = 0;
  for (size_t i = 0; i < n; ++i) wrong += got[i] != want[i];
  return wrong;
}

// n elements of T of a backend's device memory, from a CachingAllocator over it.
template <class T>
class DeviceBlock {
 public:
  DeviceBlock(runtime::CachingAllocator* allocator, size_t n)
      : allocator_(allocator),
        n_(n),
        address_(static_cast<T*>(allocator->Allocate(n * sizeof(T), runtime::MemoryCategory::kActivations))) {}
  ~DeviceBlock() { allocator_->Free(address_); }
  DeviceBlock(const DeviceBlock&) = delete;
  DeviceBlock& operator=(const DeviceBlock&) = delete;

  runtime::DevicePtr<T> get() const { return runtime::DeviceSide::Handle(address_); }
  size_t bytes() const { return n_ * sizeof(T); }

 private:
  runtime::CachingAllocator* allocator_;
  size_t n_;
  T* address_;
};

template <class Maker>
class BackendContract : public ::testing::Test {
 protected:
  void SetUp() override {
    Maker::SkipIfAbsent();
    if (IsSkipped()) return;
    backend_ = Maker::Make();
    device_ = std::make_unique<runtime::CachingAllocator>(&accounting_, backend_->DeviceMemory());
    pinned_ = std::make_unique<runtime::CachingAllocator>(&accounting_, backend_->PinnedHostMemory());
  }
  void TearDown() override {
    for (void* block : pinned_blocks_) pinned_->Free(block);
  }

  runtime::Backend& backend() { return *backend_; }
  DeviceBlock<std::byte> DeviceBuffer(size_t bytes) { return DeviceBlock<std::byte>(device_.get(), bytes); }
  template <class T>
  DeviceBlock<T> DeviceArrayOf(size_t n) {
    return DeviceBlock<T>(device_.get(), n);
  }
  // Page-locked host memory, freed when the test ends (after its streams are done).
  uint8_t* Pinned(size_t bytes) {
    void* block = pinned_->Allocate(bytes, runtime::MemoryCategory::kOffload);
    pinned_blocks_.push_back(block);
    return static_cast<uint8_t*>(block);
  }

 private:
  runtime::MemoryAccounting accounting_;
  std::unique_ptr<runtime::Backend> backend_;
  std::unique_ptr<runtime::CachingAllocator> device_, pinned_;
  std::vector<void*> pinned_blocks_;
};

TYPED_TEST_SUITE_P(BackendContract);

TYPED_TEST_P(BackendContract, DescribesItsDeviceAndNamesItsStreams) {
  const std::string description = this->backend().Describe();
  EXPECT_EQ(description.rfind(TypeParam::DescribePrefix(), 0), 0u) << description;
  EXPECT_EQ(this->backend().NewStream("compute")->name(), "compute");
}

// Sixteen fills of one buffer, each copied out before the next: copies that overtook
// the fills, or fills that overtook the copies, would leave another step's value.
TYPED_TEST_P(BackendContract, WorkOnOneStreamRunsInOrder) {
  auto stream = this->backend().NewStream("ordered");
  constexpr int kSteps = 16;
  const size_t n = (size_t{1} << 16) + 3;
  auto buffer = this->DeviceBuffer(n);
  uint8_t* results = this->Pinned(kSteps * n);
  std::memset(results, 0, kSteps * n);
  std::mutex mutex;
  std::vector<int> callbacks;
  stream->HostCallback(SleepFor(50ms));  // everything below is queued before any of it runs
  for (int step = 0; step < kSteps; ++step) {
    this->backend().Fill(buffer.get(), uint8_t(step + 1), n, *stream);
    this->backend().CopyToHost(results + step * n, buffer.get(), n, *stream);
    stream->HostCallback([&mutex, &callbacks, step] {
      std::lock_guard lock(mutex);
      callbacks.push_back(step);
    });
  }
  stream->Synchronize(10s);
  for (int step = 0; step < kSteps; ++step) {
    const std::vector<uint8_t> want(n, uint8_t(step + 1));
    EXPECT_EQ(Mismatches(results + step * n, want.data(), n), 0u) << "step " << step;
  }
  std::vector<int> in_order(kSteps);
  for (int step = 0; step < kSteps; ++step) in_order[step] = step;
  EXPECT_EQ(callbacks, in_order);
}

// The producer sleeps before it writes; a consumer that did not wait for the event would
// copy out the zeros that were there before.
TYPED_TEST_P(BackendContract, AnEventOrdersWorkAcrossStreams) {
  auto producer = this->backend().NewStream("producer");
  auto consumer = this->backend().NewStream("consumer");
  const size_t n = (size_t{1} << 20) + 3;
  const std::vector<uint8_t> data = RandomBytes(n, 1);
  uint8_t* source = this->Pinned(n);
  uint8_t* result = this->Pinned(n);
  std::memcpy(source, data.data(), n);
  std::memset(result, 0, n);
  auto buffer = this->DeviceBuffer(n);
  this->backend().Fill(buffer.get(), 0, n, *consumer);
  consumer->Synchronize(10s);

  auto written = this->backend().NewEvent();
  EXPECT_TRUE(written->Query()) << "an event never recorded counts as reached";
  producer->HostCallback(SleepFor(300ms));
  this->backend().CopyFromHost(buffer.get(), source, n, *producer);
  written->Record(*producer);
  EXPECT_FALSE(written->Query()) << "the producer is still asleep";

  consumer->Wait(*written);
  this->backend().CopyToHost(result, buffer.get(), n, *consumer);
  consumer->Synchronize(10s);
  EXPECT_TRUE(written->Query());
  EXPECT_EQ(Mismatches(result, data.data(), n), 0u) << "the consumer read the buffer before the producer wrote it";
  producer->Synchronize(10s);
}

TYPED_TEST_P(BackendContract, WaitingOnAnEventNeverRecordedDoesNotBlock) {
  auto stream = this->backend().NewStream("waiter");
  auto never = this->backend().NewEvent();
  stream->Wait(*never);
  auto buffer = this->DeviceBuffer(64);
  uint8_t* out = this->Pinned(64);
  this->backend().Fill(buffer.get(), 7, 64, *stream);
  this->backend().CopyToHost(out, buffer.get(), 64, *stream);
  stream->Synchronize(10s);
  EXPECT_EQ(out[63], 7);
}

TYPED_TEST_P(BackendContract, RecordingAgainMovesTheMark) {
  auto stream = this->backend().NewStream("marked");
  auto event = this->backend().NewEvent();
  event->Record(*stream);
  ASSERT_TRUE(event->Synchronize(10s));
  stream->HostCallback(SleepFor(300ms));
  event->Record(*stream);
  EXPECT_FALSE(event->Query()) << "the second mark is behind a sleeping callback";
  EXPECT_TRUE(event->Synchronize(10s));
  EXPECT_TRUE(event->Query());
}

TYPED_TEST_P(BackendContract, EventSynchronizeIsBounded) {
  auto stream = this->backend().NewStream("slow");
  auto event = this->backend().NewEvent();
  stream->HostCallback(SleepFor(600ms));
  event->Record(*stream);
  const auto start = std::chrono::steady_clock::now();
  EXPECT_FALSE(event->Synchronize(20ms));
  const auto waited = std::chrono::steady_clock::now() - start;
  EXPECT_GE(waited, 15ms);
  EXPECT_LT(waited, 450ms) << "Synchronize(20 ms) waited for the whole callback";
  EXPECT_TRUE(event->Synchronize(10s));
  EXPECT_TRUE(event->Query());
}

// A callback blocks the stream for up to 2 s: Synchronize(100 ms) must give up in time,
// naming the stream, and succeed once the stream moves again.
TYPED_TEST_P(BackendContract, StreamSynchronizeTimesOutNamingTheStreamThenSucceeds) {
  auto stream = this->backend().NewStream("stuck-stream");
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  stream->HostCallback([released] { released.wait_for(2s); });
  const auto start = std::chrono::steady_clock::now();
  try {
    stream->Synchronize(100ms);
    ADD_FAILURE() << "Synchronize(100 ms) returned while the stream was blocked";
  } catch (const runtime::StreamTimeout& e) {
    EXPECT_NE(std::string(e.what()).find("stuck-stream"), std::string::npos) << e.what();
  }
  const auto waited = std::chrono::steady_clock::now() - start;
  EXPECT_GE(waited, 90ms);
  EXPECT_LT(waited, 1500ms) << "Synchronize(100 ms) waited for the blocked callback";
  release.set_value();
  EXPECT_NO_THROW(stream->Synchronize(10s));
}

TYPED_TEST_P(BackendContract, ATimerAddsTheIntervalsOfItsStream) {
  auto stream = this->backend().NewStream("timed");
  auto timer = this->backend().NewTimer();
  timer->Begin(*stream);
  stream->HostCallback(SleepFor(50ms));
  timer->End(*stream);
  stream->Synchronize(10s);
  const double first = timer->Seconds();
  EXPECT_GE(first, 0.045);
  EXPECT_LT(first, 1.0);
  // Many intervals, as in many steps: the total stays exact, each read once.
  for (int i = 0; i < 200; ++i) {
    timer->Begin(*stream);
    timer->End(*stream);
  }
  timer->Begin(*stream);
  stream->HostCallback(SleepFor(20ms));
  timer->End(*stream);
  stream->Synchronize(10s);
  const double total = timer->Seconds();
  EXPECT_GE(total, first + 0.018);
  EXPECT_LT(total, first + 1.0);
  EXPECT_DOUBLE_EQ(timer->Seconds(), total) << "an interval was counted twice";
}

// Random bytes through every kind of memory, at odd sizes and offsets.
TYPED_TEST_P(BackendContract, CopiesRoundTripThroughEveryKindOfMemory) {
  auto stream = this->backend().NewStream("copies");
  const size_t n = (size_t{3} << 20) + 5;
  const std::vector<uint8_t> source = RandomBytes(n, 2);
  auto a = this->DeviceBuffer(n), b = this->DeviceBuffer(n), c = this->DeviceBuffer(n);
  uint8_t* pinned = this->Pinned(n);
  std::memset(pinned, 0, n);
  std::vector<uint8_t> pageable(n, 0);
  runtime::Backend& backend = this->backend();
  backend.CopyFromHost(a.get(), source.data(), n, *stream);  // pageable host -> device
  backend.Copy(b.get(), a.get(), n, *stream);                // device -> device
  backend.CopyToHost(pinned, b.get(), n, *stream);           // device -> pinned host
  backend.CopyFromHost(c.get(), pinned, n, *stream);         // pinned host -> device
  backend.CopyToHost(pageable.data(), c.get(), n, *stream);  // device -> pageable host
  stream->Synchronize(10s);
  EXPECT_EQ(Mismatches(pinned, source.data(), n), 0u) << "device -> pinned host";
  EXPECT_EQ(Mismatches(pageable.data(), source.data(), n), 0u) << "pinned host -> device -> pageable host";

  // A sub-range between offsets of no alignment.
  const std::vector<uint8_t> other = RandomBytes(n, 3);
  backend.CopyFromHost(a.get(), other.data(), n, *stream);
  backend.Copy(a.get() + 7, c.get() + 1001, 4099, *stream);
  std::vector<uint8_t> mixed(n);
  backend.CopyToHost(mixed.data(), a.get(), n, *stream);
  stream->Synchronize(10s);
  std::vector<uint8_t> want = other;
  std::copy(source.begin() + 1001, source.begin() + 1001 + 4099, want.begin() + 7);
  EXPECT_EQ(Mismatches(mixed.data(), want.data(), n), 0u) << "copy of 4099 bytes from offset 1001 to offset 7";

  // The typed forms count elements.
  std::vector<float> values(1000);
  std::mt19937 random(4);
  for (float& v : values) v = std::uniform_real_distribution<float>(-1, 1)(random);
  auto x = this->template DeviceArrayOf<float>(1000), y = this->template DeviceArrayOf<float>(1000);
  std::vector<float> back(1000, 0.0f);
  backend.Upload(x.get(), values.data(), 1000, *stream);
  backend.CopyElements(y.get(), runtime::DevicePtr<const float>(x.get()), 1000, *stream);
  backend.Download(back.data(), runtime::DevicePtr<const float>(y.get()), 1000, *stream);
  stream->Synchronize(10s);
  EXPECT_EQ(back, values);
}

TYPED_TEST_P(BackendContract, FillSetsEveryByteOfItsRangeAndNoOther) {
  auto stream = this->backend().NewStream("fills");
  const size_t n = (size_t{1} << 20) + 77;
  constexpr uint8_t kValue = 0xA5;
  std::vector<uint8_t> source = RandomBytes(n, 5);
  for (size_t edge : {size_t{12}, n - 16}) {  // just outside the range: never the fill value
    if (source[edge] == kValue) source[edge] = 0x5A;
  }
  auto buffer = this->DeviceBuffer(n);
  std::vector<uint8_t> out(n);
  this->backend().CopyFromHost(buffer.get(), source.data(), n, *stream);
  this->backend().Fill(buffer.get() + 13, kValue, n - 29, *stream);
  this->backend().CopyToHost(out.data(), buffer.get(), n, *stream);
  stream->Synchronize(10s);
  EXPECT_EQ(Mismatches(out.data(), source.data(), 13), 0u) << "bytes before the range";
  const std::vector<uint8_t> filled(n - 29, kValue);
  EXPECT_EQ(Mismatches(out.data() + 13, filled.data(), n - 29), 0u) << "bytes in the range";
  EXPECT_EQ(Mismatches(out.data() + n - 16, source.data() + n - 16, 16), 0u) << "bytes after the range";

  auto values = this->template DeviceArrayOf<double>(999);
  std::vector<double> back(999, 1.0);
  this->backend().Fill(values.get(), 0xFF, values.bytes(), *stream);
  this->backend().Zero(values.get(), 999, *stream);
  this->backend().Download(back.data(), runtime::DevicePtr<const double>(values.get()), 999, *stream);
  stream->Synchronize(10s);
  EXPECT_EQ(back, std::vector<double>(999, 0.0));
}

// A throwing observer fails its stream, and the failure stays (errors are sticky).
TYPED_TEST_P(BackendContract, AThrowingHostCallbackFailsTheStream) {
  auto stream = this->backend().NewStream("observed");
  stream->HostCallback([] { throw std::runtime_error("the observer broke"); });
  for (int attempt = 0; attempt < 2; ++attempt) {
    try {
      stream->Synchronize(10s);
      ADD_FAILURE() << "Synchronize did not report the failed callback (attempt " << attempt << ")";
    } catch (const runtime::StreamTimeout& e) {
      ADD_FAILURE() << e.what();
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find("the observer broke"), std::string::npos) << e.what();
    }
  }
}

TYPED_TEST_P(BackendContract, RefusesStreamsAndEventsOfAnotherBackend) {
  ForeignStream foreign("foreign-stream");
  ForeignEvent foreign_event;
  auto stream = this->backend().NewStream("own-stream");
  auto event = this->backend().NewEvent();
  auto timer = this->backend().NewTimer();
  auto buffer = this->DeviceBuffer(64);
  std::vector<uint8_t> host(64);
  runtime::Backend& backend = this->backend();
  auto expect_refusal = [](const std::string& what, const std::string& name, const std::function<void()>& work) {
    try {
      work();
      ADD_FAILURE() << what << " was accepted";
    } catch (const std::logic_error& e) {
      EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << what << ": " << e.what();
    }
  };
  expect_refusal("Fill", "foreign-stream", [&] { backend.Fill(buffer.get(), 0, 64, foreign); });
  expect_refusal("Copy", "foreign-stream", [&] { backend.Copy(buffer.get(), buffer.get() + 32, 32, foreign); });
  expect_refusal("CopyToHost", "foreign-stream", [&] { backend.CopyToHost(host.data(), buffer.get(), 64, foreign); });
  expect_refusal("CopyFromHost", "foreign-stream",
                 [&] { backend.CopyFromHost(buffer.get(), host.data(), 64, foreign); });
  expect_refusal("Event::Record", "foreign-stream", [&] { event->Record(foreign); });
  expect_refusal("StreamTimer::Begin", "foreign-stream", [&] { timer->Begin(foreign); });
  expect_refusal("Stream::Wait", "own-stream", [&] { stream->Wait(foreign_event); });
}

TYPED_TEST_P(BackendContract, StreamsServeAnyThread) {
  auto stream = this->backend().NewStream("shared");
  const size_t n = 4096;
  auto buffer = this->DeviceBuffer(n);
  uint8_t* out = this->Pinned(n);
  std::memset(out, 0, n);
  std::thread other([&] {
    this->backend().Fill(buffer.get(), 0x3C, n, *stream);
    this->backend().CopyToHost(out, buffer.get(), n, *stream);
  });
  other.join();
  stream->Synchronize(10s);
  const std::vector<uint8_t> want(n, 0x3C);
  EXPECT_EQ(Mismatches(out, want.data(), n), 0u);
}

TYPED_TEST_P(BackendContract, ADestroyedStreamLetsItsQueuedWorkFinish) {
  const size_t n = (size_t{1} << 20) + 1;
  const std::vector<uint8_t> data = RandomBytes(n, 6);
  uint8_t* source = this->Pinned(n);
  uint8_t* out = this->Pinned(n);
  std::memcpy(source, data.data(), n);
  std::memset(out, 0, n);
  auto buffer = this->DeviceBuffer(n);
  {
    auto stream = this->backend().NewStream("short-lived");
    stream->HostCallback(SleepFor(100ms));
    this->backend().CopyFromHost(buffer.get(), source, n, *stream);
    this->backend().CopyToHost(out, buffer.get(), n, *stream);
  }  // no Synchronize
  EXPECT_EQ(Mismatches(out, data.data(), n), 0u);
}

REGISTER_TYPED_TEST_SUITE_P(BackendContract, DescribesItsDeviceAndNamesItsStreams, WorkOnOneStreamRunsInOrder,
                            AnEventOrdersWorkAcrossStreams, WaitingOnAnEventNeverRecordedDoesNotBlock,
                            RecordingAgainMovesTheMark, EventSynchronizeIsBounded,
                            StreamSynchronizeTimesOutNamingTheStreamThenSucceeds, ATimerAddsTheIntervalsOfItsStream,
                            CopiesRoundTripThroughEveryKindOfMemory, FillSetsEveryByteOfItsRangeAndNoOther,
                            AThrowingHostCallbackFailsTheStream, RefusesStreamsAndEventsOfAnotherBackend,
                            StreamsServeAnyThread, ADestroyedStreamLetsItsQueuedWorkFinish);

}  // namespace meshtrain::testing
