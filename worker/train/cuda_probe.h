// What the CUDA plugin measures of a device, for the Trainer's MFU (cuda_plugin.h): its
// facts, and the rate its bf16 matrix products reach. Part of libmeshtrain-cuda.so only.
//
// Thread-safety: each call makes `device` the calling thread's current device.

#pragma once

#include "worker/runtime/device_peak.h"

namespace meshtrain::train {

// Name, SMs, clock and compute capability; throws runtime::cuda::CudaError for a missing device.
runtime::CudaDeviceFacts ProbeDeviceFacts(int device);

// Seconds that one bf16 product (tokens x k)(k x n)^T and its two backward products take
// on `device`, measured there: the matrix rate a step's products could reach.
double ProbeMatmulSeconds(int device, int tokens, int k, int n);

}  // namespace meshtrain::train
