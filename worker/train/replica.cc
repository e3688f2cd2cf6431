#include "worker/train/replica.h"

#include <stdexcept>

#include "worker/train/cuda_plugin.h"

namespace meshtrain::train {

std::unique_ptr<Replica> MakeCudaReplica(int device, const api::ModelShape& shape, int batch, int seq, uint64_t seed,
                                         runtime::MemoryAccounting* accounting) {
  std::string why;
  const CudaPlugin* cuda = CudaPluginOrNull(&why);
  if (cuda == nullptr) throw std::invalid_argument("device " + runtime::Device::Cuda(device).ToString() + ": " + why);
  return cuda->make_replica(device, shape, batch, seq, seed, accounting);
}

int CudaDeviceCount(std::string* why) {
  std::string failure;
  const CudaPlugin* cuda = CudaPluginOrNull(&failure);
  const int count = cuda ? cuda->device_count() : 0;
  if (count == 0 && why != nullptr) *why = cuda ? "the CUDA runtime sees no device" : failure;
  return count;
}

runtime::DeviceChoice ChooseDeviceHere(const std::string& precision, int local_rank) {
  std::string why_none;
  const int devices = CudaDeviceCount(&why_none);
  return runtime::ChooseDevice(precision, local_rank, devices, why_none);
}

}  // namespace meshtrain::train
