// Grouped matrix products through cuBLAS's cublasGemmGroupedBatchedEx (cuBLAS 12.5 and
// later) for the bf16 table (cuda_ops.h): many products of their own shapes in one call,
// as the mixture of experts' GroupedMatmul has one product per expert with rows. bf16 A,
// B and D, fp32 compute, alpha 1 and beta 0. Internal to kernels/cuda.
//
// Column-major, as BlasLt's Gemm (blas_lt.h): callers describe the transposed product.
//
// The API reads the matrices' addresses from arrays in device memory. A call writes them
// into a page-locked host slot, copies that to the slot's device twin on the stream and
// enqueues the products after the copy; an event recorded after the products marks the
// slot in use. The slots make a ring of kSlots, and a slot is written again only once its
// event has passed (the host waits for it then: the host runs at most kSlots grouped
// calls ahead of the device, and the engine waits on its stream for each layer's row
// counts in the forward anyway), so a copy still in flight never sees its host memory
// change and products still in flight never see their addresses change, on whatever
// stream the next call comes. A call of more than kCapacity products makes one cuBLAS
// call, and takes one slot, per kCapacity.
//
// cuBLAS's handle is this object's own (cublasCreate when it is built, on the device
// current then: the table's), with the stream and a workspace set on every call:
// BlasLt's, which the products of the table share in stream order. Its math mode keeps
// every reduction in fp32 (CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION), as the
// products through cuBLASLt accumulate.
// Thread-safety: one host thread at a time (the handle, the ring); the work follows its
// stream.

#pragma once

#include <cublas_api.h>
#include <cuda_runtime_api.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "worker/runtime/device_memory.h"
#include "worker/runtime/memory.h"

namespace meshtrain::kernels::cuda {

// One product of a group: D (m,n) = op(A) (m,k) op(B) (k,n), bf16, column-major.
struct GroupedProblem {
  const void* a = nullptr;
  const void* b = nullptr;
  void* d = nullptr;
  int m = 0, n = 0, k = 0;
};

// What every product of a call shares: the transposes and the leading dimensions.
struct GroupedLayout {
  bool transpose_a = false, transpose_b = false;
  int lda = 0, ldb = 0, ldd = 0;
};

class GroupedGemm {
 public:
  static constexpr int kSlots = 16;  // 24 KiB each, pinned and on the device
  // The most products one cuBLAS call takes (and a slot holds the addresses of).
  static constexpr int kCapacity = 1024;

  // The slots' device halves come from `allocator` (activations), their host halves from
  // `pinned` (the backend's PinnedHostMemory). cuBLAS works in `workspace`
  // (workspace_bytes, 256-byte aligned), which must outlive this object.
  GroupedGemm(runtime::CachingAllocator* allocator, runtime::MemorySource pinned, void* workspace,
              size_t workspace_bytes);
  ~GroupedGemm();
  GroupedGemm(const GroupedGemm&) = delete;
  GroupedGemm& operator=(const GroupedGemm&) = delete;

  // Enqueues every product of `problems` (in any order; the Ds must not overlap, and no D
  // may overlap an A or a B). True, with nothing left to do, for none. False, with
  // nothing enqueued, where the grouped API cannot take them: an address not a multiple
  // of 16 bytes (what cuBLAS asks of bf16 matrices, short of rules on k that this does
  // not rely on), a cuBLAS older than 12.5, or one that refused
  // (CUBLAS_STATUS_NOT_SUPPORTED, said once, then never asked again): the caller runs
  // its products apart. Throws
  // runtime::cuda::CudaError naming `what` on any other failure.
  bool Run(const GroupedLayout& layout, std::span<const GroupedProblem> problems, const char* what,
           cudaStream_t stream);

 private:
  struct Slot {
    void** host = nullptr;    // 3 kCapacity addresses: the As, the Bs, the Ds
    void** device = nullptr;  // its copy on the device, which cuBLAS reads
    cudaEvent_t done = nullptr;
    bool pending = false;  // `done` recorded and maybe not yet passed
  };

  bool Chunk(const GroupedLayout& layout, std::span<const GroupedProblem> problems, bool first, const char* what,
             cudaStream_t stream);

  cublasHandle_t handle_ = nullptr;
  void* workspace_;
  size_t workspace_bytes_;
  runtime::MemorySource pinned_;
  void* pinned_block_ = nullptr;
  runtime::DeviceArray<uintptr_t> device_block_;
  std::array<Slot, kSlots> slots_{};
  int next_slot_ = 0;
  bool refused_ = false;
  // The per-group arrays cuBLAS reads on the host during the call, kept to allocate
  // nothing per call.
  std::vector<cublasOperation_t> transa_, transb_;
  std::vector<int> m_, n_, k_, lda_, ldb_, ldd_, group_size_;
  std::vector<float> alpha_, beta_;
};

}  // namespace meshtrain::kernels::cuda
