// The engine's precisions (docs/design.md, "Mixed precision"): which element type the model's
// compute copies use (gathered parameters, activations and their gradients: Act) and
// which the rest use (parameter gradients, master weights, AdamW state, LayerNorm
// statistics, losses: Acc).
//
//   Fp32  fp32 everywhere: the CPU engine.
//   Bf16  bf16 compute copies over fp32: the GPU engine, and its CPU emulation.
//   Fp64  fp64 everywhere: the reference every other precision is checked against.
// Thread-safety: types only.

#pragma once

#include "worker/runtime/bf16.h"

namespace meshtrain::kernels {

struct Fp32 {
  using Act = float;
  using Acc = float;
  static constexpr const char* kName = "fp32";
};

struct Bf16 {
  using Act = runtime::bf16;
  using Acc = float;
  static constexpr const char* kName = "bf16";
};

struct Fp64 {
  using Act = double;
  using Acc = double;
  static constexpr const char* kName = "fp64";
};

}  // namespace meshtrain::kernels
