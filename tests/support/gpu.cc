#include "tests/support/gpu.h"

#include <cuda_runtime.h>

namespace meshtrain::testing {

bool HaveGpu() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

}  // namespace meshtrain::testing
