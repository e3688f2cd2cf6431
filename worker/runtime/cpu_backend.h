// The CPU as a device backend (backend.h): streams are task queues on threads
// (cpu_stream.h), device memory and "pinned" memory are the system heap, and copies and
// fills are tasks on the stream.
//
// Strict mode, for tests: streams jitter (cpu_stream.h), and new device memory is
// poisoned (every byte 0xFF, a NaN in fp32, bf16 and fp64), so a kernel that reads what
// nothing wrote, or a schedule that misses an event, gives a wrong result rather than a
// lucky zero. Together with the typed handles (device_ptr.h) and the bf16 emulation
// (kernels/cpu/cpu_ops.h) it makes the CPU a device as strict as a GPU.
// Thread-safety: may be used from any thread.

#pragma once

#include <atomic>
#include <memory>
#include <string>

#include "worker/runtime/backend.h"
#include "worker/runtime/cpu_stream.h"

namespace meshtrain::runtime {

struct CpuBackendOptions {
  uint64_t jitter_seed = 0;  // 0: no jitter; otherwise each stream's seed derives from it
  bool poison = false;       // fill new device memory with 0xFF
};

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(CpuBackendOptions options = {}) : options_(options) {}

  Device device() const override { return Device::Cpu(); }
  std::string Describe() const override;
  std::unique_ptr<Stream> NewStream(const std::string& name) override;
  std::unique_ptr<Event> NewEvent() override { return std::make_unique<CpuEvent>(); }
  std::unique_ptr<StreamTimer> NewTimer() override { return std::make_unique<CpuStreamTimer>(); }
  MemorySource DeviceMemory() override;
  MemorySource PinnedHostMemory() override { return HostMemory(); }
  void Copy(DeviceBytes to, ConstDeviceBytes from, size_t bytes, Stream& stream) override;
  void Copy2D(DeviceBytes to, size_t to_pitch, ConstDeviceBytes from, size_t from_pitch, size_t width, size_t rows,
              Stream& stream) override;
  void CopyToHost(void* to, ConstDeviceBytes from, size_t bytes, Stream& stream) override;
  void CopyFromHost(DeviceBytes to, const void* from, size_t bytes, Stream& stream) override;
  void Fill(DeviceBytes to, uint8_t value, size_t bytes, Stream& stream) override;

 private:
  CpuBackendOptions options_;
  std::atomic<uint64_t> streams_made_{0};
};

}  // namespace meshtrain::runtime
