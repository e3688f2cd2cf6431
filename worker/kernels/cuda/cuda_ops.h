// The GPU's kernel table (kernels/ops.h), part of the CUDA plugin: Ops<Bf16> on one CUDA
// device. Products are cuBLASLt with heuristics, a workspace and epilogues (bias, GELU
// with its pre-activation, and its derivative in backward); attention is cuDNN's fused
// scaled-dot-product attention through its graph API, with plain kernels where cuDNN
// refuses a shape (said once in the log); the rest are meshtrain's own kernels. Each
// operation is checked against the CPU's Fp64 table by tests/gpu/cuda_ops_test.cc.
// Thread-safety: as kernels/ops.h.

#pragma once

#include <memory>

#include "worker/kernels/ops.h"
#include "worker/runtime/backend.h"
#include "worker/runtime/memory.h"

namespace meshtrain::kernels::cuda {

// The table on `backend`'s device (a CUDA backend); workspaces come from `allocator`.
std::unique_ptr<Ops<Bf16>> MakeCudaOps(runtime::Backend& backend, runtime::CachingAllocator* allocator);

}  // namespace meshtrain::kernels::cuda
