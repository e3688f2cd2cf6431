// A kernel built by nvcc through the project's CUDA settings, to check the toolchain end to end.

#pragma once

#include <cuda_runtime.h>

namespace meshtrain::testing {

// y = a * x + y on `stream`, for device arrays of n floats.
cudaError_t LaunchSaxpy(float a, const float* x, float* y, int n, cudaStream_t stream);

}  // namespace meshtrain::testing
