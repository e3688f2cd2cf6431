// A CUDA plugin from another build: compiled against a modified copy of
// worker/train/cuda_plugin.h (tests/unit/CMakeLists.txt adds a member to CudaPlugin) and
// carrying that header set's fingerprint. The loader must refuse it before it reads the
// struct, whose layout this program does not share.

#include "worker/train/cuda_plugin.h"

namespace {

int NoDevices() { return 0; }

const meshtrain::train::CudaPlugin kForeign{.device_count = NoDevices};

}  // namespace

extern "C" __attribute__((visibility("default"))) const char* MeshtrainCudaPluginBuild() { return MESHTRAIN_PLUGIN_BUILD; }

extern "C" __attribute__((visibility("default"))) const meshtrain::train::CudaPlugin* MeshtrainCudaPlugin() {
  return &kForeign;
}
