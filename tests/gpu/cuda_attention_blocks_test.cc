// Attention by blocks on the GPU's table (kernels/cuda/attention_blocks.h) against the
// CPU's Fp64 table: the shared suite (tests/support/attention_blocks_conformance.h:
// blocks strided into packed buffers, merges with empty results, the ring against
// whole-sequence attention), and the head sizes the kernels' registers hold.

#include <gtest/gtest.h>

#include <memory>
#include <stdexcept>

#include "tests/support/attention_blocks_conformance.h"
#include "tests/support/gpu.h"
#include "worker/kernels/cuda/cuda_ops.h"
#include "worker/runtime/cuda.h"

namespace meshtrain::testing {

// This binary runs the block suite only; OpsConformance, whose fixture it builds on, is
// instantiated by the tables' own binaries.
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(OpsConformance);

namespace cuda_attention_blocks_test {

struct CudaTable {
  using Precision = kernels::Bf16;
  static bool Available() { return HaveGpu(); }
  static const char* Unavailable() { return "skipped: no GPU"; }
  static std::unique_ptr<runtime::Backend> MakeBackend() { return runtime::cuda::MakeCudaBackend(0); }
  static std::unique_ptr<kernels::Ops<kernels::Bf16>> MakeOps(runtime::Backend& backend,
                                                              runtime::CachingAllocator* allocator) {
    return kernels::cuda::MakeCudaOps(backend, allocator);
  }
  // Against fp64 on the same bf16 inputs the blocks keep every intermediate in fp32 (a few
  // 1e-6); the table's own whole-sequence attention stores bf16 (a few 1e-3): 1e-2, the
  // bound of every bf16 table.
  static constexpr double kTolerance = 1e-2;
};

INSTANTIATE_TYPED_TEST_SUITE_P(Cuda, AttentionBlocksConformance, ::testing::Types<CudaTable>);

// Heads of more than kMaxAttentionBlockHeadSize (256) channels are refused when the call
// is made.
TEST(CudaAttentionBlocks, RefusesHeadsTooWide) {
  MESHTRAIN_SKIP_WITHOUT_GPU();
  auto backend = runtime::cuda::MakeCudaBackend(0);
  runtime::MemoryAccounting accounting;
  runtime::CachingAllocator allocator(&accounting, backend->DeviceMemory());
  auto stream = backend->NewStream("refusals");
  auto ops = kernels::cuda::MakeCudaOps(*backend, &allocator);
  const auto shape = kernels::AttentionBlock::Contiguous(1, 4, 4, 2, 1, 512, kernels::AttentionMask::kNone);
  EXPECT_THROW(ops->AttentionBlockForward(nullptr, nullptr, nullptr, nullptr, nullptr, shape, *stream),
               std::invalid_argument);
  EXPECT_THROW(ops->AttentionBlockBackward(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                                           nullptr, shape, *stream),
               std::invalid_argument);
  stream->Synchronize();
}

}  // namespace cuda_attention_blocks_test
}  // namespace meshtrain::testing
