// Where a rank computes (docs/design.md, "The engine"): the CPU, or one CUDA device.
//
// The engine is written once against Stream, Event and the memory pools; a Device
// says which implementation serves them. ChooseDevice decides where a job trains
// from its precision and what this build and machine offer.
// Thread-safety: plain values.

#pragma once

#include <string>

namespace meshtrain::runtime {

struct Device {
  enum class Kind { kCpu, kCuda };
  Kind kind = Kind::kCpu;
  int index = 0;  // CUDA device ordinal; 0 on the CPU

  static Device Cpu() { return {}; }
  static Device Cuda(int index) { return {Kind::kCuda, index}; }
  bool is_cuda() const { return kind == Kind::kCuda; }
  std::string ToString() const;  // "cpu", "cuda:1"
  friend bool operator==(const Device&, const Device&) = default;
};

// Where a job with `precision` (auto | fp32 | bf16 | fp8) trains, and in what precision.
struct DeviceChoice {
  Device device;
  std::string precision;  // "fp32" on the CPU, "bf16" on CUDA; fp8 names both
  std::string note;       // why the job's precision was not honoured; empty when it was
};

// bf16 on CUDA device local_rank % cuda_devices when there is one and precision is
// auto, bf16 or fp8 (float8 products over bf16). Everything else trains in fp32 on the CPU: fp32 (the CUDA engine
// computes in bf16 only), and bf16 without a device, with a note that says why there
// is none (`why_none`: no CUDA in this build, a plugin that does not load, no device).
DeviceChoice ChooseDevice(const std::string& precision, int local_rank, int cuda_devices,
                          const std::string& why_none);

}  // namespace meshtrain::runtime
