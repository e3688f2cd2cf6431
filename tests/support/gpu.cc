#include "tests/support/gpu.h"

#include <cuda_runtime.h>

#include <cmath>

namespace meshtrain::testing {

double RelativeError(const std::vector<float>& got, const std::vector<float>& want) {
  double difference = 0, norm = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    difference += (double(got[i]) - want[i]) * (double(got[i]) - want[i]);
    norm += double(want[i]) * want[i];
  }
  return std::sqrt(difference / norm);
}

bool HaveGpu() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

}  // namespace meshtrain::testing
