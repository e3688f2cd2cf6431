// The CUDA plugin, libmeshtrain-cuda.so (cuda_plugin.h): its table of entry points over
// the CUDA backend, the bf16 kernel table, NCCL's collectives and the device probes.

#include "worker/comm/nccl/nccl_collectives.h"
#include "worker/kernels/cuda/cuda_ops.h"
#include "worker/runtime/cuda.h"
#include "worker/train/cuda_plugin.h"
#include "worker/train/cuda_probe.h"

namespace meshtrain::train {
namespace {

const CudaPlugin kPlugin{runtime::cuda::DeviceCount,          ProbeDeviceFacts, runtime::cuda::MakeCudaBackend,
                         kernels::cuda::MakeCudaOps,          comm::ConnectNcclCollectives, ProbeMatmulSeconds};

}  // namespace
}  // namespace meshtrain::train

extern "C" __attribute__((visibility("default"))) const char* MeshtrainCudaPluginBuild() { return MESHTRAIN_PLUGIN_BUILD; }

extern "C" __attribute__((visibility("default"))) const meshtrain::train::CudaPlugin* MeshtrainCudaPlugin() {
  return &meshtrain::train::kPlugin;
}
