// A device backend: what the engine needs of a device besides its kernels (docs/design.md,
// "The device seam"). It makes streams, events and timers; it is where device memory and
// page-locked host memory come from; and it copies and fills on a stream.
//
// Host memory passed to a copy must stay valid and unchanged until the stream has passed
// the copy (page-locked host memory, from PinnedHostMemory, lets the copy overlap
// compute on a GPU). Device memory comes through a CachingAllocator over DeviceMemory(),
// as DeviceArray<T> (device_memory.h), and every buffer of a step is taken when the
// engine is built.
//
// Implementations: cpu_backend.h, and the CUDA plugin's. Thread-safety: a backend may be
// used from any thread.

#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "worker/runtime/device.h"
#include "worker/runtime/device_ptr.h"
#include "worker/runtime/memory.h"
#include "worker/runtime/stream.h"

namespace meshtrain::runtime {

class Backend {
 public:
  virtual ~Backend() = default;

  virtual Device device() const = 0;
  // "cpu", "cpu (strict: jitter 7, poisoned memory)", "cuda:0 (NVIDIA H100 80GB HBM3)"
  virtual std::string Describe() const = 0;

  virtual std::unique_ptr<Stream> NewStream(const std::string& name) = 0;
  virtual std::unique_ptr<Event> NewEvent() = 0;
  virtual std::unique_ptr<StreamTimer> NewTimer() = 0;

  virtual MemorySource DeviceMemory() = 0;
  virtual MemorySource PinnedHostMemory() = 0;

  // Stream-ordered; the ranges must not overlap.
  virtual void Copy(DeviceBytes to, ConstDeviceBytes from, size_t bytes, Stream& stream) = 0;
  // `rows` rows of `width` bytes: row i from from + i * from_pitch to to + i * to_pitch
  // (cudaMemcpy2DAsync's). Stream-ordered; the ranges must not overlap.
  virtual void Copy2D(DeviceBytes to, size_t to_pitch, ConstDeviceBytes from, size_t from_pitch, size_t width,
                      size_t rows, Stream& stream) = 0;
  virtual void CopyToHost(void* to, ConstDeviceBytes from, size_t bytes, Stream& stream) = 0;
  virtual void CopyFromHost(DeviceBytes to, const void* from, size_t bytes, Stream& stream) = 0;
  // Every byte of [to, to + bytes) = `value`.
  virtual void Fill(DeviceBytes to, uint8_t value, size_t bytes, Stream& stream) = 0;

  // Typed forms, counts in elements.
  template <class T>
  void Zero(DevicePtr<T> to, int64_t n, Stream& stream) {
    Fill(to, 0, size_t(n) * sizeof(T), stream);
  }
  template <class T>
  void Upload(DevicePtr<T> to, const T* from, int64_t n, Stream& stream) {
    CopyFromHost(to, from, size_t(n) * sizeof(T), stream);
  }
  template <class T>
  void Download(T* to, DevicePtr<const T> from, int64_t n, Stream& stream) {
    CopyToHost(to, from, size_t(n) * sizeof(T), stream);
  }
  template <class T>
  void CopyElements(DevicePtr<T> to, DevicePtr<const T> from, int64_t n, Stream& stream) {
    Copy(to, from, size_t(n) * sizeof(T), stream);
  }
};

}  // namespace meshtrain::runtime
