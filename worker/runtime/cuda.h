// The CUDA side of the runtime (DESIGN.md, "Engine"): the device, streams and events
// as the real CUDA objects, and the memory sources behind device and pinned-host
// CachingAllocators. Built only when CUDA is found (MESHTRAIN_HAVE_CUDA).
//
// Stream and Event keep the contract of the CPU ones in stream.h (Record, Wait,
// Query, Synchronize), so the engine's scheduling reads the same on either device.
// Every failure throws CudaError naming the call, the device and CUDA's own words.
// Thread-safety: Stream and Event may be used from any thread, as CUDA allows; the
// current device is per host thread (UseDevice).

#pragma once

#include <cuda_runtime_api.h>

#include <chrono>
#include <stdexcept>
#include <string>

#include "worker/runtime/memory.h"

namespace meshtrain::runtime::cuda {

class CudaError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Throws CudaError("<what>: <CUDA's message> (<error name>)") unless `status` is cudaSuccess.
void Check(cudaError_t status, const std::string& what);

// Devices the CUDA runtime sees: 0 without a driver or a device (never throws).
int DeviceCount();

// Makes `index` this thread's current device. Throws CudaError naming the index and
// how many devices there are when it does not exist.
void UseDevice(int index);

// Device memory (cudaMalloc) of the thread's current device, and page-locked host
// memory (cudaMallocHost) for copies that overlap compute. For CachingAllocator.
MemorySource DeviceMemory();
MemorySource PinnedHostMemory();

class Event;

class Stream {
 public:
  // A non-blocking stream on the current device; `name` goes into error messages.
  explicit Stream(std::string name);
  ~Stream();
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  const std::string& name() const { return name_; }
  cudaStream_t handle() const { return stream_; }
  // Later work on this stream waits until `event`'s recorded point (cudaStreamWaitEvent).
  void Wait(const Event& event);
  // Blocks until everything enqueued so far has run; throws a failed kernel's error.
  void Synchronize();

 private:
  std::string name_;
  cudaStream_t stream_ = nullptr;
};

class Event {
 public:
  Event();  // timing disabled: a pure fence
  ~Event();
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  void Record(Stream& stream);
  // True once the recorded point has been reached (or if never recorded).
  bool Query() const;
  // Polls until reached or `timeout` passes; true if reached. Bounded, unlike
  // cudaEventSynchronize, so a hung device becomes an error rather than a hang.
  bool Synchronize(std::chrono::milliseconds timeout = std::chrono::minutes(5)) const;
  cudaEvent_t handle() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
};

}  // namespace meshtrain::runtime::cuda
