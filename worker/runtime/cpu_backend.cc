#include "worker/runtime/cpu_backend.h"

#include <cstdlib>
#include <cstring>
#include <stdexcept>

#include "worker/runtime/device_side.h"

namespace meshtrain::runtime {

std::string CpuBackend::Describe() const {
  if (options_.jitter_seed == 0 && !options_.poison) return "cpu";
  std::string strict = "cpu (strict:";
  if (options_.jitter_seed != 0) strict += " jitter seed " + std::to_string(options_.jitter_seed);
  if (options_.poison) strict += options_.jitter_seed != 0 ? ", poisoned memory" : " poisoned memory";
  return strict + ")";
}

std::unique_ptr<Stream> CpuBackend::NewStream(const std::string& name) {
  CpuJitter jitter;
  if (options_.jitter_seed != 0) jitter.seed = options_.jitter_seed * 1000003 + ++streams_made_;
  return std::make_unique<CpuStream>(name, jitter);
}

MemorySource CpuBackend::DeviceMemory() {
  if (!options_.poison) return HostMemory();
  return {"host (poisoned)",
          [](size_t bytes) -> void* {
            void* p = std::aligned_alloc(64, bytes);
            if (p != nullptr) std::memset(p, 0xFF, bytes);
            return p;
          },
          [](void* p) { std::free(p); }};
}

void CpuBackend::Copy(DeviceBytes to, ConstDeviceBytes from, size_t bytes, Stream& stream) {
  CpuStream::Of(stream).Enqueue([to = DeviceSide::Address(to), from = DeviceSide::Address(from), bytes] {
    std::memcpy(to, from, bytes);
  });
}

void CpuBackend::Copy2D(DeviceBytes to, size_t to_pitch, ConstDeviceBytes from, size_t from_pitch, size_t width,
                        size_t rows, Stream& stream) {
  CpuStream::Of(stream).Enqueue([to = DeviceSide::Address(to), from = DeviceSide::Address(from), to_pitch, from_pitch,
                                 width, rows] {
    for (size_t i = 0; i < rows; ++i) {
      std::memcpy(static_cast<std::byte*>(to) + i * to_pitch, static_cast<const std::byte*>(from) + i * from_pitch,
                  width);
    }
  });
}

void CpuBackend::CopyToHost(void* to, ConstDeviceBytes from, size_t bytes, Stream& stream) {
  CpuStream::Of(stream).Enqueue([to, from = DeviceSide::Address(from), bytes] { std::memcpy(to, from, bytes); });
}

void CpuBackend::CopyFromHost(DeviceBytes to, const void* from, size_t bytes, Stream& stream) {
  CpuStream::Of(stream).Enqueue([to = DeviceSide::Address(to), from, bytes] { std::memcpy(to, from, bytes); });
}

void CpuBackend::Fill(DeviceBytes to, uint8_t value, size_t bytes, Stream& stream) {
  CpuStream::Of(stream).Enqueue([to = DeviceSide::Address(to), value, bytes] { std::memset(to, value, bytes); });
}

}  // namespace meshtrain::runtime
