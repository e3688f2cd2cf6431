#include "worker/kernels/cuda/grouped_gemm.h"

#include <cublas_v2.h>

#include <algorithm>
#include <cstdio>
#include <string>

#include "worker/runtime/cuda.h"
#include "worker/runtime/device_side.h"

// cublasGemmGroupedBatchedEx came with cuBLAS 12.5.
#if defined(CUBLAS_VERSION) && CUBLAS_VERSION >= 120500
#define MESHTRAIN_HAVE_GROUPED_GEMM 1
#else
#define MESHTRAIN_HAVE_GROUPED_GEMM 0
#endif

namespace meshtrain::kernels::cuda {
namespace {

using runtime::cuda::CudaError;

// Throws naming the call and the operation (names of their own: a unity unit shares this
// anonymous namespace with blas_lt.cc's).
void CheckGroupedBlas(cublasStatus_t status, const char* call, const char* what) {
  if (status == CUBLAS_STATUS_SUCCESS) return;
  throw CudaError(std::string(call) + " for " + what + ": " + cublasGetStatusString(status) + " (" +
                  cublasGetStatusName(status) + ")");
}

bool GroupedAligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

GroupedGemm::GroupedGemm(runtime::CachingAllocator* allocator, runtime::MemorySource pinned, void* workspace,
                         size_t workspace_bytes)
    : workspace_(workspace),
      workspace_bytes_(workspace_bytes),
      pinned_(pinned),
      device_block_(allocator, int64_t(kSlots) * 3 * kCapacity, runtime::MemoryCategory::kActivations) {
  const char* what = "the bf16 kernel table's grouped products";
  constexpr size_t kSlotBytes = size_t(3) * kCapacity * sizeof(void*);
  pinned_block_ = pinned_.allocate(kSlots * kSlotBytes);
  if (pinned_block_ == nullptr) {
    throw CudaError(std::string("no ") + pinned_.name + " memory for " + what + " (" +
                    std::to_string(kSlots * kSlotBytes) + " bytes)");
  }
  auto* device = reinterpret_cast<void**>(runtime::DeviceSide::Address(device_block_.get()));
  for (int s = 0; s < kSlots; ++s) {
    slots_[size_t(s)].host = static_cast<void**>(pinned_block_) + size_t(s) * 3 * kCapacity;
    slots_[size_t(s)].device = device + size_t(s) * 3 * kCapacity;
  }
  try {
    for (Slot& slot : slots_) {
      runtime::cuda::Check(cudaEventCreateWithFlags(&slot.done, cudaEventDisableTiming),
                           std::string("cudaEventCreateWithFlags for ") + what);
    }
    CheckGroupedBlas(cublasCreate(&handle_), "cublasCreate", what);
    CheckGroupedBlas(cublasSetMathMode(handle_, cublasMath_t(CUBLAS_DEFAULT_MATH |
                                                             CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)),
                     "cublasSetMathMode", what);
  } catch (...) {
    for (Slot& slot : slots_) {
      if (slot.done != nullptr) cudaEventDestroy(slot.done);
    }
    if (handle_ != nullptr) cublasDestroy(handle_);
    pinned_.free(pinned_block_);
    throw;
  }
  for (auto* arrays : {&m_, &n_, &k_, &lda_, &ldb_, &ldd_, &group_size_}) arrays->reserve(kCapacity);
  transa_.reserve(kCapacity);
  transb_.reserve(kCapacity);
  alpha_.reserve(kCapacity);
  beta_.reserve(kCapacity);
}

GroupedGemm::~GroupedGemm() {
  // The host halves may not go while a copy from them is in flight.
  for (Slot& slot : slots_) {
    if (slot.pending) cudaEventSynchronize(slot.done);
    cudaEventDestroy(slot.done);
  }
  if (handle_ != nullptr) cublasDestroy(handle_);
  pinned_.free(pinned_block_);
}

bool GroupedGemm::Run(const GroupedLayout& layout, std::span<const GroupedProblem> problems, const char* what,
                      cudaStream_t stream) {
  if (problems.empty()) return true;
  if (!MESHTRAIN_HAVE_GROUPED_GEMM || refused_) return false;
  for (const GroupedProblem& p : problems) {
    if (!GroupedAligned(p.a) || !GroupedAligned(p.b) || !GroupedAligned(p.d)) return false;
  }
  // cublasSetStream sets the workspace back to cuBLAS's own pool: ours after it.
  CheckGroupedBlas(cublasSetStream(handle_, stream), "cublasSetStream", what);
  CheckGroupedBlas(cublasSetWorkspace(handle_, workspace_, workspace_bytes_), "cublasSetWorkspace", what);
  for (size_t first = 0; first < problems.size(); first += kCapacity) {
    const size_t count = std::min(problems.size() - first, size_t(kCapacity));
    // Refused only on the first: the types and the device are the same for every chunk.
    if (!Chunk(layout, problems.subspan(first, count), first == 0, what, stream)) return false;
  }
  return true;
}

bool GroupedGemm::Chunk(const GroupedLayout& layout, std::span<const GroupedProblem> problems, bool first,
                        const char* what, cudaStream_t stream) {
  Slot& slot = slots_[size_t(next_slot_)];
  next_slot_ = (next_slot_ + 1) % kSlots;
  if (slot.pending) {
    runtime::cuda::Check(cudaEventSynchronize(slot.done), std::string("cudaEventSynchronize for ") + what);
    slot.pending = false;
  }
  // One group per run of products of the same shape (group_size counts them); the
  // addresses in the order of the products.
  const size_t count = problems.size();
  for (auto* arrays : {&m_, &n_, &k_, &lda_, &ldb_, &ldd_, &group_size_}) arrays->clear();
  for (size_t i = 0; i < count; ++i) {
    const GroupedProblem& p = problems[i];
    slot.host[i] = const_cast<void*>(p.a);
    slot.host[count + i] = const_cast<void*>(p.b);
    slot.host[2 * count + i] = p.d;
    if (!m_.empty() && m_.back() == p.m && n_.back() == p.n && k_.back() == p.k) {
      ++group_size_.back();
      continue;
    }
    m_.push_back(p.m);
    n_.push_back(p.n);
    k_.push_back(p.k);
    group_size_.push_back(1);
  }
  const size_t groups = m_.size();
  lda_.assign(groups, layout.lda);
  ldb_.assign(groups, layout.ldb);
  ldd_.assign(groups, layout.ldd);
  transa_.assign(groups, layout.transpose_a ? CUBLAS_OP_T : CUBLAS_OP_N);
  transb_.assign(groups, layout.transpose_b ? CUBLAS_OP_T : CUBLAS_OP_N);
  alpha_.assign(groups, 1.0f);
  beta_.assign(groups, 0.0f);

  runtime::cuda::Check(cudaMemcpyAsync(slot.device, slot.host, 3 * count * sizeof(void*), cudaMemcpyHostToDevice,
                                       stream),
                       std::string("cudaMemcpyAsync of the addresses for ") + what);
#if MESHTRAIN_HAVE_GROUPED_GEMM
  const void* const* a = slot.device;
  const void* const* b = slot.device + count;
  void* const* d = slot.device + 2 * count;
  const cublasStatus_t status = cublasGemmGroupedBatchedEx(
      handle_, transa_.data(), transb_.data(), m_.data(), n_.data(), k_.data(), alpha_.data(), a, CUDA_R_16BF,
      lda_.data(), b, CUDA_R_16BF, ldb_.data(), beta_.data(), d, CUDA_R_16BF, ldd_.data(), int(groups),
      group_size_.data(), CUBLAS_COMPUTE_32F);
#else
  const cublasStatus_t status = CUBLAS_STATUS_NOT_SUPPORTED;
#endif
  // After the products, or after the copy alone when cuBLAS enqueued nothing: the slot is
  // in use until then either way.
  runtime::cuda::Check(cudaEventRecord(slot.done, stream), std::string("cudaEventRecord for ") + what);
  slot.pending = true;
  if (status == CUBLAS_STATUS_NOT_SUPPORTED && first) {
    refused_ = true;
    std::fprintf(stderr, "meshtrain: cuBLAS refused cublasGemmGroupedBatchedEx for %s (%s); the grouped products "
                 "run one cuBLASLt product at a time\n", what, cublasGetStatusName(status));
    return false;
  }
  CheckGroupedBlas(status, "cublasGemmGroupedBatchedEx", what);
  return true;
}

}  // namespace meshtrain::kernels::cuda

#undef MESHTRAIN_HAVE_GROUPED_GEMM
