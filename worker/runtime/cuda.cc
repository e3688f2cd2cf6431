#include "worker/runtime/cuda.h"

#include <algorithm>
#include <array>
#include <cstdio>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "worker/runtime/device_side.h"
#include "worker/runtime/memory.h"

namespace meshtrain::runtime::cuda {
namespace {

using Clock = std::chrono::steady_clock;

// How long a destroyed stream lets its queued work finish before it is released anyway.
// cudaStreamDestroy itself never waits; the wait is for the host memory that work reads
// or writes, which the caller frees once the stream is gone. A hung device must not hang
// the destructor (and the engine's error path with it), so the wait is bounded.
constexpr milliseconds kDrainOnDestroy{30'000};

// "100 ms", "2.5 s": timeouts as people wrote them.
std::string FormatTimeout(milliseconds timeout) {
  if (timeout.count() < 1000) return std::to_string(timeout.count()) + " ms";
  char text[32];
  std::snprintf(text, sizeof(text), "%g s", double(timeout.count()) / 1000);
  return text;
}

// The device the calling thread uses, made `device` only when it is not already (a
// cudaGetDevice is far cheaper than a cudaSetDevice).
void MakeCurrent(int device) {
  int current = -1;
  if (cudaGetDevice(&current) == cudaSuccess && current == device) return;
  Check(cudaSetDevice(device), "cudaSetDevice(" + std::to_string(device) + ")");
}

// Polls `event` until it is reached, it fails, or `timeout` passes; false only on the
// timeout. Backs off from spinning to sleeps of at most 200 us: a step's end is waited
// for this way, so the sleep bounds the latency it adds. A failure goes to `on_error`
// (which throws it, or not), and ends the wait: nothing is running any more.
template <class OnError>
bool PollEvent(cudaEvent_t event, milliseconds timeout, OnError on_error) {
  const Clock::time_point deadline = Clock::now() + timeout;
  std::chrono::microseconds pause{0};
  for (;;) {
    const cudaError_t status = cudaEventQuery(event);
    if (status == cudaSuccess) return true;
    if (status != cudaErrorNotReady) {
      on_error(status);
      return true;
    }
    if (Clock::now() >= deadline) return false;
    if (pause.count() == 0) {
      std::this_thread::yield();
      pause = std::chrono::microseconds(1);
    } else {
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::microseconds(200));
    }
  }
}

// The first failure of a stream's host callbacks, shared with the callbacks themselves,
// which may run after the stream is gone.
struct CallbackFailure {
  std::mutex mutex;
  std::exception_ptr error;
};

// What cudaLaunchHostFunc runs: owned on the heap, freed by the trampoline.
struct PendingCallback {
  std::function<void()> callback;
  std::shared_ptr<CallbackFailure> failure;
};

// Runs on a CUDA driver thread, which must not call CUDA and cannot take an exception:
// a throwing callback fails its stream instead (the next Synchronize rethrows it), as a
// throwing task does on the CPU.
void RunHostCallback(void* data) {
  std::unique_ptr<PendingCallback> pending(static_cast<PendingCallback*>(data));
  try {
    pending->callback();
  } catch (...) {
    std::lock_guard lock(pending->failure->mutex);
    if (!pending->failure->error) pending->failure->error = std::current_exception();
  }
}

class CudaStream final : public Stream {
 public:
  CudaStream(std::string name, int device) : name_(std::move(name)), device_(device) {
    MakeCurrent(device_);
    Check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate for stream " + name_);
    const cudaError_t made = cudaEventCreateWithFlags(&reached_, cudaEventDisableTiming);
    if (made != cudaSuccess) {
      cudaStreamDestroy(stream_);
      Check(made, "cudaEventCreate for stream " + name_);
    }
  }

  // Lets queued work finish for at most kDrainOnDestroy, then releases the stream
  // whatever the device is doing (CUDA frees it once its work is done). Never throws.
  ~CudaStream() override {
    if (cudaSetDevice(device_) == cudaSuccess && cudaEventRecord(reached_, stream_) == cudaSuccess) {
      PollEvent(reached_, kDrainOnDestroy, [](cudaError_t) {});
    }
    cudaGetLastError();  // a failure here was thrown by Synchronize already, or never will be
    cudaEventDestroy(reached_);
    cudaStreamDestroy(stream_);
  }
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;

  const std::string& name() const override { return name_; }
  cudaStream_t handle() const { return stream_; }
  int device() const { return device_; }

  void Wait(Event& event) override;

  void Synchronize(milliseconds timeout) override {
    MakeCurrent(device_);
    // One event per stream: two threads synchronizing at once share it, and the earlier
    // one then waits for the later mark too, which is late but never early.
    Check(cudaEventRecord(reached_, stream_), "stream " + name_ + ": recording its end");
    const bool reached = PollEvent(reached_, timeout, [&](cudaError_t status) {
      Check(status, "stream " + name_ + ": its work");
    });
    if (!reached) {
      throw StreamTimeout("stream " + name_ + ": its work did not finish within " + FormatTimeout(timeout));
    }
    std::lock_guard lock(callback_failure_->mutex);
    if (callback_failure_->error) std::rethrow_exception(callback_failure_->error);
  }

  void HostCallback(std::function<void()> callback) override {
    MakeCurrent(device_);
    auto pending = std::make_unique<PendingCallback>(PendingCallback{std::move(callback), callback_failure_});
    Check(cudaLaunchHostFunc(stream_, RunHostCallback, pending.get()), "cudaLaunchHostFunc on stream " + name_);
    pending.release();  // RunHostCallback owns it now
  }

  // The CudaStream behind `stream`; std::logic_error naming it when it is another
  // backend's.
  static CudaStream& Of(Stream& stream) {
    auto* cuda = dynamic_cast<CudaStream*>(&stream);
    if (cuda == nullptr) {
      throw std::logic_error("stream " + stream.name() + " is not a CUDA stream, but CUDA work was put on it");
    }
    return *cuda;
  }

 private:
  std::string name_;
  int device_;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t reached_ = nullptr;  // recorded by Synchronize and the destructor
  std::shared_ptr<CallbackFailure> callback_failure_ = std::make_shared<CallbackFailure>();
};

class CudaEvent final : public Event {
 public:
  explicit CudaEvent(int device) : device_(device) {
    MakeCurrent(device_);
    Check(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming), "cudaEventCreate");
  }
  ~CudaEvent() override { cudaEventDestroy(event_); }
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;

  void Record(Stream& stream) override {
    CudaStream& cuda = CudaStream::Of(stream);
    MakeCurrent(device_);
    Check(cudaEventRecord(event_, cuda.handle()), "cudaEventRecord on stream " + cuda.name());
  }

  bool Query() override {
    MakeCurrent(device_);
    const cudaError_t status = cudaEventQuery(event_);
    if (status == cudaErrorNotReady) return false;
    Check(status, "cudaEventQuery");
    return true;
  }

  bool Synchronize(milliseconds timeout) override {
    MakeCurrent(device_);
    return PollEvent(event_, timeout, [](cudaError_t status) { Check(status, "waiting for an event"); });
  }

  cudaEvent_t handle() const { return event_; }

 private:
  int device_;
  cudaEvent_t event_ = nullptr;
};

void CudaStream::Wait(Event& event) {
  auto* cuda = dynamic_cast<CudaEvent*>(&event);
  if (cuda == nullptr) throw std::logic_error("stream " + name_ + " can only wait on CUDA events");
  MakeCurrent(device_);
  Check(cudaStreamWaitEvent(stream_, cuda->handle(), 0), "cudaStreamWaitEvent on stream " + name_);
}

// Pairs of timing events. Completed pairs are read by Seconds() and their events reused,
// so a timer used every step holds a few events, not one pair per interval ever timed.
class CudaStreamTimer final : public StreamTimer {
 public:
  explicit CudaStreamTimer(int device) : device_(device) {}
  ~CudaStreamTimer() override {
    // An event destroyed before it is reached is released once it is (CUDA's rule).
    if (open_ != nullptr) cudaEventDestroy(open_);
    for (const Interval& interval : ended_) {
      cudaEventDestroy(interval.begin);
      cudaEventDestroy(interval.end);
    }
    for (cudaEvent_t event : spare_) cudaEventDestroy(event);
  }
  CudaStreamTimer(const CudaStreamTimer&) = delete;
  CudaStreamTimer& operator=(const CudaStreamTimer&) = delete;

  void Begin(Stream& stream) override {
    CudaStream& cuda = CudaStream::Of(stream);
    std::lock_guard lock(mutex_);
    MakeCurrent(device_);
    if (open_ == nullptr) open_ = TakeEvent();
    // A second Begin without an End moves the start, as re-recording an event does.
    Check(cudaEventRecord(open_, cuda.handle()), "timer: cudaEventRecord on stream " + cuda.name());
  }

  void End(Stream& stream) override {
    CudaStream& cuda = CudaStream::Of(stream);
    std::lock_guard lock(mutex_);
    if (open_ == nullptr) throw std::logic_error("timer: End on stream " + cuda.name() + " without a Begin");
    MakeCurrent(device_);
    cudaEvent_t end = TakeEvent();
    const cudaError_t recorded = cudaEventRecord(end, cuda.handle());
    if (recorded != cudaSuccess) {
      spare_.push_back(end);
      Check(recorded, "timer: cudaEventRecord on stream " + cuda.name());
    }
    ended_.push_back({open_, end});
    open_ = nullptr;
  }

  double Seconds() override {
    std::lock_guard lock(mutex_);
    std::vector<Interval> still_running;
    for (const Interval& interval : ended_) {
      const cudaError_t status = cudaEventQuery(interval.end);
      if (status == cudaErrorNotReady) {  // its stream was not synchronized: counted later
        still_running.push_back(interval);
        continue;
      }
      Check(status, "timer: the end of an interval");
      float ms = 0;
      Check(cudaEventElapsedTime(&ms, interval.begin, interval.end), "timer: cudaEventElapsedTime");
      seconds_ += double(ms) / 1000;
      spare_.push_back(interval.begin);
      spare_.push_back(interval.end);
    }
    ended_ = std::move(still_running);
    return seconds_;
  }

 private:
  struct Interval {
    cudaEvent_t begin, end;
  };

  // REQUIRES: mutex_ held.
  cudaEvent_t TakeEvent() {
    if (!spare_.empty()) {
      cudaEvent_t event = spare_.back();
      spare_.pop_back();
      return event;
    }
    cudaEvent_t event = nullptr;
    Check(cudaEventCreate(&event), "timer: cudaEventCreate");  // timing enabled
    return event;
  }

  int device_;
  std::mutex mutex_;
  cudaEvent_t open_ = nullptr;  // the last Begin, until its End
  std::vector<Interval> ended_;
  std::vector<cudaEvent_t> spare_;
  double seconds_ = 0;
};

// MemorySource takes plain function pointers, which cannot hold a device; so each device
// up to kDevicesWithOwnSource gets its own pair, which makes that device current before
// it allocates, whatever thread the allocator runs in. Past that (no node has so many
// GPUs), allocations go to the calling thread's current device.
constexpr int kDevicesWithOwnSource = 32;

template <int kDevice>
void* DeviceAllocateOn(size_t bytes) {
  if (kDevice >= 0) {
    int current = -1;
    if (cudaGetDevice(&current) != cudaSuccess || current != kDevice) {
      if (cudaSetDevice(kDevice) != cudaSuccess) {
        cudaGetLastError();
        return nullptr;
      }
    }
  }
  void* ptr = nullptr;
  if (cudaMalloc(&ptr, bytes) != cudaSuccess) {
    cudaGetLastError();  // an out-of-memory error is not sticky; clear it for later calls
    return nullptr;
  }
  return ptr;
}

void DeviceFree(void* ptr) { cudaFree(ptr); }  // any device's memory, whatever is current

template <int... kDevices>
constexpr std::array<void* (*)(size_t), sizeof...(kDevices)> DeviceAllocators(std::integer_sequence<int, kDevices...>) {
  return {&DeviceAllocateOn<kDevices>...};
}
constexpr auto kDeviceAllocators = DeviceAllocators(std::make_integer_sequence<int, kDevicesWithOwnSource>());

void* PinnedAllocate(size_t bytes) {
  void* ptr = nullptr;
  // Portable: pinned for every device, so it does not matter which one is current.
  if (cudaHostAlloc(&ptr, bytes, cudaHostAllocPortable) != cudaSuccess) {
    cudaGetLastError();
    return nullptr;
  }
  return ptr;
}

void PinnedFree(void* ptr) { cudaFreeHost(ptr); }

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(int device) : device_(device) {
    cudaDeviceProp properties{};
    Check(cudaGetDeviceProperties(&properties, device_), "cudaGetDeviceProperties");
    description_ = Device::Cuda(device_).ToString() + " (" + properties.name + ")";
  }

  Device device() const override { return Device::Cuda(device_); }
  std::string Describe() const override { return description_; }

  std::unique_ptr<Stream> NewStream(const std::string& name) override {
    return std::make_unique<CudaStream>(name, device_);
  }
  std::unique_ptr<Event> NewEvent() override { return std::make_unique<CudaEvent>(device_); }
  std::unique_ptr<StreamTimer> NewTimer() override { return std::make_unique<CudaStreamTimer>(device_); }

  MemorySource DeviceMemory() override {
    MakeCurrent(device_);
    auto allocate = device_ < kDevicesWithOwnSource ? kDeviceAllocators[device_] : &DeviceAllocateOn<-1>;
    return {"cuda", allocate, DeviceFree};
  }
  MemorySource PinnedHostMemory() override { return {"pinned host", PinnedAllocate, PinnedFree}; }

  void Copy(DeviceBytes to, ConstDeviceBytes from, size_t bytes, Stream& stream) override {
    Enqueue(DeviceSide::Address(to), DeviceSide::Address(from), bytes, stream, "copy device to device");
  }
  void Copy2D(DeviceBytes to, size_t to_pitch, ConstDeviceBytes from, size_t from_pitch, size_t width, size_t rows,
              Stream& stream) override {
    if (rows == 0 || width == 0) return;
    CudaStream& cuda = CudaStream::Of(stream);
    MakeCurrent(device_);
    Check(cudaMemcpy2DAsync(DeviceSide::Address(to), to_pitch, DeviceSide::Address(from), from_pitch, width, rows,
                            cudaMemcpyDeviceToDevice, cuda.handle()),
          "2D copy of " + std::to_string(rows) + " rows of " + FormatBytes(width) + " on stream " + cuda.name());
  }
  void CopyToHost(void* to, ConstDeviceBytes from, size_t bytes, Stream& stream) override {
    Enqueue(to, DeviceSide::Address(from), bytes, stream, "copy device to host");
  }
  void CopyFromHost(DeviceBytes to, const void* from, size_t bytes, Stream& stream) override {
    Enqueue(DeviceSide::Address(to), from, bytes, stream, "copy host to device");
  }
  void Fill(DeviceBytes to, uint8_t value, size_t bytes, Stream& stream) override {
    CudaStream& cuda = CudaStream::Of(stream);
    MakeCurrent(device_);
    Check(cudaMemsetAsync(DeviceSide::Address(to), value, bytes, cuda.handle()),
          "fill of " + FormatBytes(bytes) + " on stream " + cuda.name());
  }

 private:
  // cudaMemcpyDefault: the addresses say where each side is (unified addressing), so a
  // pinned buffer moves by DMA and a pageable one is staged by the driver.
  void Enqueue(void* to, const void* from, size_t bytes, Stream& stream, const char* what) {
    CudaStream& cuda = CudaStream::Of(stream);
    MakeCurrent(device_);
    Check(cudaMemcpyAsync(to, from, bytes, cudaMemcpyDefault, cuda.handle()),
          std::string(what) + " of " + FormatBytes(bytes) + " on stream " + cuda.name());
  }

  int device_;
  std::string description_;
};

}  // namespace

void Check(cudaError_t status, const std::string& what) {
  if (status == cudaSuccess) return;
  cudaGetLastError();  // clears an error that is not sticky, so later calls do not report it again
  int device = -1;
  cudaGetDevice(&device);
  throw CudaError(what + " on device " + std::to_string(device) + ": " + cudaGetErrorString(status) + " (" +
                  cudaGetErrorName(status) + ")");
}

int DeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the "no device" error for later calls
    return 0;
  }
  return count;
}

void UseDevice(int index) {
  const int count = DeviceCount();
  if (index < 0 || index >= count) {
    throw CudaError("CUDA device " + std::to_string(index) + " does not exist: the CUDA runtime sees " +
                    std::to_string(count) + (count == 1 ? " device" : " devices"));
  }
  MakeCurrent(index);
}

std::unique_ptr<Backend> MakeCudaBackend(int index) {
  UseDevice(index);
  return std::make_unique<CudaBackend>(index);
}

cudaStream_t StreamHandle(Stream& stream) { return CudaStream::Of(stream).handle(); }

}  // namespace meshtrain::runtime::cuda
