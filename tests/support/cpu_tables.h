// The CPU's three kernel tables as the typed conformance suites take them
// (ops_conformance.h, moe_conformance.h, attention_blocks_conformance.h): each on the
// strict backend (new device memory poisoned, streams jittered), with the bound its
// results are held to against the Fp64 reference.

#pragma once

#include <gtest/gtest.h>

#include <memory>

#include "worker/kernels/cpu/cpu_ops.h"
#include "worker/kernels/ops.h"
#include "worker/runtime/cpu_backend.h"
#include "worker/runtime/device_memory.h"

namespace meshtrain::testing {

template <class P, int kToleranceExponent>
struct CpuTable {
  using Precision = P;
  static bool Available() { return true; }
  static const char* Unavailable() { return ""; }
  static std::unique_ptr<runtime::Backend> MakeBackend() {
    return std::make_unique<runtime::CpuBackend>(runtime::CpuBackendOptions{11, true});
  }
  static std::unique_ptr<kernels::Ops<P>> MakeOps(runtime::Backend&, runtime::CachingAllocator*) {
    return kernels::MakeCpuOps<P>();
  }
  static constexpr double kTolerance = [] {
    double t = 1;
    for (int i = 0; i < -kToleranceExponent; ++i) t /= 10;
    return t;
  }();
};

// fp32: sums of up to 3072 products carry a relative error near 1e-7 * sqrt(3072); 1e-5
// leaves room (and is the bound the ring's blocks must meet against whole-sequence
// attention) and still fails a wrong index or a missing term.
using CpuFp32 = CpuTable<kernels::Fp32, -5>;
// bf16: every stored value is rounded to 8 significant bits (relative 2^-9 = 2e-3), so
// outputs land within a few 1e-3 of fp64; 1e-2 is the bound the GPU's kernels are held to.
using CpuBf16 = CpuTable<kernels::Bf16, -2>;
// fp64 against itself: the same code on the same numbers, but through a strict backend.
using CpuFp64 = CpuTable<kernels::Fp64, -12>;

using CpuTables = ::testing::Types<CpuFp32, CpuBf16, CpuFp64>;

}  // namespace meshtrain::testing
