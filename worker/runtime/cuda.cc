#include "worker/runtime/cuda.h"

#include <thread>

namespace meshtrain::runtime::cuda {

void Check(cudaError_t status, const std::string& what) {
  if (status == cudaSuccess) return;
  int device = -1;
  cudaGetDevice(&device);
  throw CudaError(what + " on device " + std::to_string(device) + ": " + cudaGetErrorString(status) + " (" +
                  cudaGetErrorName(status) + ")");
}

int DeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" error for later calls
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
  Check(cudaSetDevice(index), "cudaSetDevice");
}

MemorySource DeviceMemory() {
  return {"cuda",
          [](size_t bytes) -> void* {
            void* ptr = nullptr;
            if (cudaMalloc(&ptr, bytes) != cudaSuccess) {
              cudaGetLastError();  // an out-of-memory error is not sticky; clear it
              return nullptr;
            }
            return ptr;
          },
          [](void* ptr) { cudaFree(ptr); }};
}

MemorySource PinnedHostMemory() {
  return {"pinned host",
          [](size_t bytes) -> void* {
            void* ptr = nullptr;
            if (cudaMallocHost(&ptr, bytes) != cudaSuccess) {
              cudaGetLastError();
              return nullptr;
            }
            return ptr;
          },
          [](void* ptr) { cudaFreeHost(ptr); }};
}

Stream::Stream(std::string name) : name_(std::move(name)) {
  Check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate for stream " + name_);
}

Stream::~Stream() {
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

void Stream::Wait(const Event& event) {
  Check(cudaStreamWaitEvent(stream_, event.handle(), 0), "cudaStreamWaitEvent on stream " + name_);
}

void Stream::Synchronize() { Check(cudaStreamSynchronize(stream_), "work on stream " + name_); }

Event::Event() { Check(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming), "cudaEventCreate"); }

Event::~Event() {
  if (event_ != nullptr) cudaEventDestroy(event_);
}

void Event::Record(Stream& stream) {
  Check(cudaEventRecord(event_, stream.handle()), "cudaEventRecord on stream " + stream.name());
}

bool Event::Query() const {
  const cudaError_t status = cudaEventQuery(event_);
  if (status == cudaErrorNotReady) return false;
  Check(status, "cudaEventQuery");
  return true;
}

bool Event::Synchronize(std::chrono::milliseconds timeout) const {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto pause = std::chrono::microseconds(1);
  while (!Query()) {
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(1000));
  }
  return true;
}

}  // namespace meshtrain::runtime::cuda
