// A CUDA device's dense bf16 peak: the denominator of MFU (model FLOPs utilisation) as
// llm.c and torchtitan count it, achieved model FLOP/s over what the device's tensor
// cores do without sparsity. A measured matrix rate is a different, lower figure; MFU
// against it would flatter the engine.
//
// Known devices come from a table of NVIDIA's datasheet figures, found by name. Others
// are derived as SMs x clock x dense bf16 FLOP per clock per SM of their compute
// capability; that uses the peak boost clock, so it can overstate a datasheet figure
// (an H100 SXM: 1070 against the datasheet's 989 TFLOP/s).
// Thread-safety: pure functions of plain values.

#pragma once

#include <string>

namespace meshtrain::runtime {

// What the CUDA runtime says of a device (cudaDeviceGetAttribute).
struct CudaDeviceFacts {
  std::string name;  // "NVIDIA H100 80GB HBM3"
  int multiprocessors = 0;
  int clock_khz = 0;  // peak SM clock
  int compute_major = 0;
  int compute_minor = 0;
};

struct DensePeak {
  double flops = 0;    // FLOP/s; 0 when unknown
  std::string source;  // how it was found, or why it is unknown
};

DensePeak DenseBf16Peak(const CudaDeviceFacts& device);

}  // namespace meshtrain::runtime
