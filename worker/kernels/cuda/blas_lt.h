// Matrix products through cuBLASLt for the bf16 table (cuda_ops.h): bf16 A and B (or
// float8, with scales: the float8 products), fp32 compute, with epilogues. Each distinct
// product (shape, layouts, types, epilogue and the pointers' alignments) gets its
// descriptors and one heuristic query the first time, kept
// for every later call (up to kMaxPlans of them); the workspace is taken once, when the
// table is built. A call allocates nothing and never synchronizes the host. Internal to
// kernels/cuda.
//
// cuBLASLt is column-major: a row-major (R,C) array is a column-major (C,R) one with the
// same leading dimension, so callers describe the transposed product (see cuda_ops.cc).
// Thread-safety: one host thread at a time (the cache); the work follows its stream.

#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>

#include "worker/runtime/device_memory.h"
#include "worker/runtime/memory.h"

namespace meshtrain::kernels::cuda {

// D (m,n) = alpha op(A) op(B) + beta C, column-major, batched by strides; C is laid out
// as D, and is D itself unless given.
struct Gemm {
  bool transpose_a = false, transpose_b = false;
  int64_t m = 0, n = 0, k = 0;
  const void* a = nullptr;
  int64_t lda = 0, stride_a = 0;
  const void* b = nullptr;
  int64_t ldb = 0, stride_b = 0;
  void* d = nullptr;
  const void* c = nullptr;  // null: D
  cudaDataType d_type = CUDA_R_16BF;
  int64_t ldd = 0, stride_d = 0;
  int batch = 1;
  float alpha = 1, beta = 0;
  cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  // The BIAS epilogues read m elements here; BGRADB writes the n column sums of op(B)
  // (its sums over k) here.
  const void* bias = nullptr;
  cudaDataType bias_type = CUDA_R_16BF;
  const void* aux = nullptr;   // bf16 (m,n) with leading dimension aux_ld: the GELU input
  int64_t aux_ld = 0;
  // A and B's element types: bf16, or float8 (CUDA_R_8F_E4M3, CUDA_R_8F_E5M2; not both
  // E5M2). cuBLASLt's float8 products take A transposed and B not ("TN": both K-major),
  // leading dimensions and k multiples of 16, and accumulate in fp32 (no fast
  // accumulation). a_scale and b_scale (nullable: 1): device fp32 scalars cuBLASLt
  // multiplies the product by, D = alpha a_scale b_scale op(A) op(B) + beta C.
  cudaDataType a_type = CUDA_R_16BF, b_type = CUDA_R_16BF;
  const float* a_scale = nullptr;
  const float* b_scale = nullptr;
};

class BlasLt {
 public:
  static constexpr size_t kWorkspaceBytes = size_t{32} << 20;
  // The most plans kept; past it the cache is emptied (blas_lt.cc).
  static constexpr size_t kMaxPlans = 4096;

  // The workspace comes from `allocator` (activations).
  explicit BlasLt(runtime::CachingAllocator* allocator);
  ~BlasLt();
  BlasLt(const BlasLt&) = delete;
  BlasLt& operator=(const BlasLt&) = delete;

  // Enqueues the product. False, with nothing enqueued, when cuBLASLt has no algorithm for
  // it (an epilogue a shape does not allow): the caller runs the unfused form. Throws
  // runtime::cuda::CudaError naming `what` and the shape on any other failure.
  bool Run(const Gemm& gemm, const char* what, cudaStream_t stream);

  // How full the algorithm Run would take keeps the device: cuBLASLt's waves count (1: one
  // full wave of thread blocks); none when there is no algorithm.
  std::optional<float> Waves(const Gemm& gemm, const char* what);

  // The workspace (kWorkspaceBytes), lent to the table's cuBLAS calls (grouped_gemm.h):
  // stream order keeps them apart from these.
  void* Workspace() const;

 private:
  struct Plan;

  Plan& PlanFor(const Gemm& gemm, const char* what);

  cublasLtHandle_t handle_ = nullptr;
  runtime::DeviceArray<std::byte> workspace_;
  std::unordered_map<std::string, std::unique_ptr<Plan>> plans_;  // by Key(gemm)
};

}  // namespace meshtrain::kernels::cuda
