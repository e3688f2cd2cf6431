#include "worker/runtime/device.h"

namespace meshtrain::runtime {

std::string Device::ToString() const { return is_cuda() ? "cuda:" + std::to_string(index) : "cpu"; }

DeviceChoice ChooseDevice(const std::string& precision, int local_rank, int cuda_devices,
                          const std::string& why_none) {
  const bool fp8 = precision == "fp8";  // float8 products over the precision auto chooses
  if (cuda_devices > 0 && precision != "fp32") return {Device::Cuda(local_rank % cuda_devices), fp8 ? "fp8 over bf16" : "bf16", ""};
  DeviceChoice cpu{Device::Cpu(), fp8 ? "fp8 over fp32 (the float8 products emulated)" : "fp32", ""};
  if (precision == "fp32" && cuda_devices > 0) {
    cpu.note = "precision fp32: the CUDA engine computes in bf16 only, so this run trains in fp32 on the CPU";
  } else if (precision == "bf16") {
    cpu.note = "precision bf16 needs a CUDA device, but " + (why_none.empty() ? "none is visible" : why_none) +
               "; this run trains in fp32 on the CPU";
  }
  return cpu;
}

}  // namespace meshtrain::runtime
