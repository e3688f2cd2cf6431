// The CUDA device backend (runtime/backend.h), part of the CUDA plugin: streams and
// events are cudaStream_t and cudaEvent_t, device memory comes from cudaMalloc (taken
// once, when the engine is built, through a CachingAllocator), pinned host memory from
// cudaHostAlloc, and copies and fills are cudaMemcpyAsync and cudaMemsetAsync on the
// stream. Built only when CUDA is found (MESHTRAIN_HAVE_CUDA).
//
// It keeps the contract of stream.h: Synchronize is bounded (a hung device becomes a
// StreamTimeout naming the stream, not a hang), a failed kernel's error is thrown by the
// next Synchronize, and timers are pairs of timing events read once their stream has
// synchronized. Every failure throws CudaError naming the call, the device and CUDA's
// own words.
// Thread-safety: as backend.h; the current device is per host thread (UseDevice), and
// the backend makes its device current in every thread that calls it.

#pragma once

#include <cuda_runtime_api.h>

#include <memory>
#include <stdexcept>
#include <string>

#include "worker/runtime/backend.h"

namespace meshtrain::runtime::cuda {

class CudaError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Throws CudaError("<what> on device <d>: <CUDA's message> (<error name>)") unless
// `status` is cudaSuccess.
void Check(cudaError_t status, const std::string& what);

// Devices the CUDA runtime sees: 0 without a driver or a device (never throws).
int DeviceCount();

// Makes `index` this thread's current device. Throws CudaError naming the index and
// how many devices there are when it does not exist.
void UseDevice(int index);

// The backend of device `index` (UseDevice(index) first).
std::unique_ptr<Backend> MakeCudaBackend(int index);

// The cudaStream_t behind a stream of the CUDA backend, for the kernels and NCCL.
// Throws std::logic_error naming the stream when it belongs to another backend.
cudaStream_t StreamHandle(Stream& stream);

}  // namespace meshtrain::runtime::cuda
