#include "worker/runtime/device_peak.h"

#include <cstdio>
#include <string_view>

namespace meshtrain::runtime {
namespace {

// Dense bf16 tensor-core TFLOP/s from NVIDIA's datasheets, the sparse figure halved.
// More specific names come first: "H100 PCIe" before "H100", "L40S" before "L4".
struct NamedPeak {
  std::string_view name_part;
  double tflops;
};
constexpr NamedPeak kDatasheet[] = {
    {"H100 PCIe", 756.0}, {"H100 NVL", 835.5}, {"H100", 989.4}, {"H200", 989.4}, {"A100", 312.0},
    {"L40S", 362.05},     {"L40", 181.05},     {"L4", 121.0},
};

// Dense bf16 FLOP per clock per SM, by compute capability.
int FlopsPerClockPerSm(int major, int minor) {
  if (major == 8 && minor == 0) return 2048;  // A100: 108 SMs x 1410 MHz x 2048 = 312 TFLOP/s
  if (major == 8) return 1024;                // 8.6, 8.7, 8.9: A10, L4, L40
  if (major == 9) return 4096;                // H100, H200: 132 SMs x 1830 MHz x 4096 = 989 TFLOP/s
  return 0;
}

}  // namespace

DensePeak DenseBf16Peak(const CudaDeviceFacts& d) {
  for (const NamedPeak& known : kDatasheet) {
    if (d.name.find(known.name_part) != std::string::npos) {
      return {known.tflops * 1e12, "the datasheet figure for " + std::string(known.name_part)};
    }
  }
  const int per_clock = FlopsPerClockPerSm(d.compute_major, d.compute_minor);
  const std::string capability = std::to_string(d.compute_major) + "." + std::to_string(d.compute_minor);
  if (per_clock == 0 || d.multiprocessors <= 0 || d.clock_khz <= 0) {
    return {0, "no dense bf16 rate is known for " + d.name + " (compute capability " + capability + ")"};
  }
  char source[160];
  std::snprintf(source, sizeof source, "%d SMs x %d MHz x %d dense bf16 FLOP per clock (compute capability %s)",
                d.multiprocessors, d.clock_khz / 1000, per_clock, capability.c_str());
  return {double(d.multiprocessors) * d.clock_khz * 1e3 * per_clock, source};
}

}  // namespace meshtrain::runtime
