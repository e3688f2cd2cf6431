// The GPU's kernel table (kernels/ops.h), part of the CUDA plugin: Ops<Bf16> on one CUDA
// device. Products are cuBLASLt with heuristics, a workspace and epilogues (bias, GELU
// with its pre-activation, and in backward its derivative and the bias gradient);
// attention (grouped-query heads included) is cuDNN's fused scaled-dot-product attention
// through its graph API, with plain kernels where cuDNN refuses a shape (said once in the
// log); attention by blocks (ring context parallelism) is plain kernels of its own
// (attention_blocks.h, checked by tests/gpu/cuda_attention_blocks_test.cc); the rest
// (norms, RoPE, SwiGLU, the mixture of experts' router and row moves,
// loss, optimizer) are meshtrain's own kernels; the experts' grouped products are a loop
// of cuBLASLt products, one per expert with rows. Each operation is checked against the
// CPU's Fp64 table by tests/gpu/cuda_ops_test.cc. The float8 products (compute capability
// 8.9 and up; below it each Float8 operation throws std::invalid_argument naming the
// device) are cuBLASLt's E4M3 and E5M2 products after the table's own amax, scale and
// cast kernels (float8.h), checked against the CPU's bf16 emulation by
// tests/gpu/cuda_float8_test.cc.
//
// Memory: the table takes its workspaces when it is built (cuBLASLt's 32 MiB, the
// partial sums of the deterministic reductions, the dispatch order's 1 MiB of counts)
// and attention's when a shape is first asked for (Attention and the two sizes; an
// operation on a shape never asked builds it then), and the float8 products' scratch when
// a product first needs more than before (it waits for the stream then, so that the old
// block is no longer read). No other operation allocates or synchronizes the host; a failure throws
// runtime::cuda::CudaError naming the operation and the shape.
// Thread-safety: as kernels/ops.h. The products, LayerNorm's and RMSNorm's backward, the
// bias gradient and attention's forward share the table's workspaces, so their calls
// must follow one another in stream order (the engine's compute stream); the shard
// operations have their own. MoePermutePlan's calls share its scratch likewise.

#pragma once

#include <cstdint>
#include <memory>

#include "worker/kernels/ops.h"
#include "worker/runtime/backend.h"
#include "worker/runtime/memory.h"

namespace meshtrain::kernels::cuda {

// The table on `backend`'s device (a CUDA backend); workspaces come from `allocator`.
std::unique_ptr<Ops<Bf16>> MakeCudaOps(runtime::Backend& backend, runtime::CachingAllocator* allocator);

// For tests: the same table with parts turned off.
struct CudaOpsOptions {
  bool fused_attention = true;  // false: attention always takes the scores path
  // false: products never take cuBLASLt's epilogues (bias, GELU and their gradients are
  // always the table's own kernels, as for shapes the epilogues refuse)
  bool fused_epilogues = true;
  // true: dweight's product sums the bias gradient (BGRADB) wherever cuBLASLt has an
  // algorithm for it, not only where that algorithm fills the device as the plain one's
  bool bias_gradient_wherever_possible = false;
  int64_t* bias_gradients_in_product = nullptr;  // counts the products that summed it
};
std::unique_ptr<Ops<Bf16>> MakeCudaOpsWith(runtime::Backend& backend, runtime::CachingAllocator* allocator,
                                           const CudaOpsOptions& options);

}  // namespace meshtrain::kernels::cuda
