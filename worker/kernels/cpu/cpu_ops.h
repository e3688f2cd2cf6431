// The CPU's kernel tables (kernels/ops.h): each operation is a task on a CPU stream
// (runtime/cpu_stream.h) running the loops and OpenBLAS products of kernels.h.
//
//   MakeCpuOps<Fp32>()  the CPU engine: fp32 throughout.
//   MakeCpuOps<Fp64>()  the reference: fp64 throughout; every other table, on every
//                       device, is checked against it.
//   MakeCpuOps<Bf16>()  the GPU's numerics on the CPU: activations, gathered parameters
//                       and their gradients stored in bf16 (rounded to nearest-even, as
//                       the GPU rounds them), computed in fp32 from the stored values,
//                       with fp32 parameter gradients, statistics and losses. Mixed
//                       precision is tested with it here, without a GPU.
// Thread-safety: as kernels/ops.h.

#pragma once

#include <memory>

#include "worker/kernels/ops.h"

namespace meshtrain::kernels {

template <class P>
std::unique_ptr<Ops<P>> MakeCpuOps();

}  // namespace meshtrain::kernels
