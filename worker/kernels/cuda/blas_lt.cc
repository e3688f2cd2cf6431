#include "worker/kernels/cuda/blas_lt.h"

#include <array>
#include <cstdio>
#include <cstring>

#include "worker/runtime/cuda.h"
#include "worker/runtime/device_side.h"

namespace meshtrain::kernels::cuda {
namespace {

using runtime::cuda::CudaError;

// Throws naming the call, the operation and the product's shape.
void CheckLt(cublasStatus_t status, const char* call, const char* what, const Gemm& gemm) {
  if (status == CUBLAS_STATUS_SUCCESS) return;
  throw CudaError(std::string(call) + " for " + what + " (m=" + std::to_string(gemm.m) + " n=" +
                  std::to_string(gemm.n) + " k=" + std::to_string(gemm.k) + " batch=" + std::to_string(gemm.batch) +
                  "): " + cublasGetStatusString(status) + " (" + cublasGetStatusName(status) + ")");
}

// The largest power of two, up to 256, that divides every address the product touches
// in `p`'s matrix: its start and, when batched, each batch's.
int64_t AlignmentOf(const void* p, int64_t batch_stride_bytes, int batch) {
  uint64_t bits = reinterpret_cast<uintptr_t>(p) | 256;
  if (batch > 1) bits |= uint64_t(batch_stride_bytes);
  return int64_t(bits & (~bits + 1));
}

size_t ElementBytes(cudaDataType type) {
  return type == CUDA_R_32F ? 4 : (type == CUDA_R_8F_E4M3 || type == CUDA_R_8F_E5M2) ? 1 : 2;
}

bool IsFloat8(cudaDataType type) { return type == CUDA_R_8F_E4M3 || type == CUDA_R_8F_E5M2; }

}  // namespace

struct BlasLt::Plan {
  cublasLtMatmulDesc_t description = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algorithm{};
  bool supported = false;
  float waves = 0;

  ~Plan() {
    if (a != nullptr) cublasLtMatrixLayoutDestroy(a);
    if (b != nullptr) cublasLtMatrixLayoutDestroy(b);
    if (d != nullptr) cublasLtMatrixLayoutDestroy(d);
    if (description != nullptr) cublasLtMatmulDescDestroy(description);
  }
};

BlasLt::BlasLt(runtime::CachingAllocator* allocator)
    : workspace_(allocator, int64_t(kWorkspaceBytes), runtime::MemoryCategory::kActivations) {
  CheckLt(cublasLtCreate(&handle_), "cublasLtCreate", "the bf16 kernel table", Gemm{});
}

BlasLt::~BlasLt() {
  plans_.clear();
  if (handle_ != nullptr) cublasLtDestroy(handle_);
}

BlasLt::Plan& BlasLt::PlanFor(const Gemm& gemm, const char* what) {
  const size_t a_bytes = ElementBytes(gemm.a_type), b_bytes = ElementBytes(gemm.b_type),
               d_bytes = ElementBytes(gemm.d_type);
  const std::array<int64_t, 27> fields = {
      gemm.transpose_a, gemm.transpose_b, gemm.m, gemm.n, gemm.k, gemm.lda, gemm.ldb, gemm.ldd, gemm.stride_a,
      gemm.stride_b, gemm.stride_d, gemm.d_type, gemm.batch, gemm.epilogue, gemm.aux_ld,
      AlignmentOf(gemm.a, gemm.stride_a * int64_t(a_bytes), gemm.batch),
      AlignmentOf(gemm.b, gemm.stride_b * int64_t(b_bytes), gemm.batch),
      AlignmentOf(gemm.d, gemm.stride_d * int64_t(d_bytes), gemm.batch),
      gemm.bias != nullptr ? AlignmentOf(gemm.bias, 0, 1) : 0, gemm.aux != nullptr ? AlignmentOf(gemm.aux, 0, 1) : 0,
      gemm.beta != 0, AlignmentOf(gemm.c != nullptr ? gemm.c : gemm.d, gemm.stride_d * int64_t(d_bytes), gemm.batch),
      gemm.bias_type, gemm.a_type, gemm.b_type, gemm.a_scale != nullptr, gemm.b_scale != nullptr};
  std::string key(sizeof(fields), '\0');
  std::memcpy(key.data(), fields.data(), sizeof(fields));
  if (const auto found = plans_.find(key); found != plans_.end()) return *found->second;
  // Shapes that change from call to call (the experts' row counts in GroupedMatmul) would
  // grow the cache without bound: past kMaxPlans it starts again. cuBLASLt keeps its own
  // cache of heuristics, so a plan made again is cheap, and no plan is held past a call.
  if (plans_.size() >= kMaxPlans) plans_.clear();
  std::unique_ptr<Plan>& slot = plans_[key];

  auto plan = std::make_unique<Plan>();
  CheckLt(cublasLtMatmulDescCreate(&plan->description, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate",
          what, gemm);
  auto set = [&](cublasLtMatmulDescAttributes_t attribute, const auto& value) {
    CheckLt(cublasLtMatmulDescSetAttribute(plan->description, attribute, &value, sizeof(value)),
            "cublasLtMatmulDescSetAttribute", what, gemm);
  };
  const cublasOperation_t op_a = gemm.transpose_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_b = gemm.transpose_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  set(CUBLASLT_MATMUL_DESC_TRANSA, op_a);
  set(CUBLASLT_MATMUL_DESC_TRANSB, op_b);
  set(CUBLASLT_MATMUL_DESC_EPILOGUE, gemm.epilogue);
  if (gemm.bias != nullptr) {
    set(CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, int32_t(gemm.bias_type));
    set(CUBLASLT_MATMUL_DESC_BIAS_POINTER, gemm.bias);
  }
  if (gemm.aux != nullptr) {
    set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE, int32_t(CUDA_R_16BF));
    set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, gemm.aux_ld);
    set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, gemm.aux);
  }
  if (IsFloat8(gemm.a_type) || IsFloat8(gemm.b_type)) {
    set(CUBLASLT_MATMUL_DESC_FAST_ACCUM, int8_t(0));  // fp32 accumulation throughout
    if (gemm.a_scale != nullptr) set(CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, static_cast<const void*>(gemm.a_scale));
    if (gemm.b_scale != nullptr) set(CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, static_cast<const void*>(gemm.b_scale));
  }

  // Stored column-major: op(A) is (m,k), so A is (m,k) or, transposed, (k,m).
  auto layout = [&](cublasLtMatrixLayout_t* out, cudaDataType type, int64_t rows, int64_t cols, int64_t ld,
                    int64_t stride) {
    CheckLt(cublasLtMatrixLayoutCreate(out, type, uint64_t(rows), uint64_t(cols), ld), "cublasLtMatrixLayoutCreate",
            what, gemm);
    if (gemm.batch > 1) {
      const int32_t batch = gemm.batch;
      CheckLt(cublasLtMatrixLayoutSetAttribute(*out, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &batch, sizeof(batch)),
              "cublasLtMatrixLayoutSetAttribute", what, gemm);
      CheckLt(cublasLtMatrixLayoutSetAttribute(*out, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride,
                                               sizeof(stride)),
              "cublasLtMatrixLayoutSetAttribute", what, gemm);
    }
  };
  layout(&plan->a, gemm.a_type, gemm.transpose_a ? gemm.k : gemm.m, gemm.transpose_a ? gemm.m : gemm.k, gemm.lda,
         gemm.stride_a);
  layout(&plan->b, gemm.b_type, gemm.transpose_b ? gemm.n : gemm.k, gemm.transpose_b ? gemm.k : gemm.n, gemm.ldb,
         gemm.stride_b);
  layout(&plan->d, gemm.d_type, gemm.m, gemm.n, gemm.ldd, gemm.stride_d);

  cublasLtMatmulPreference_t preference = nullptr;
  CheckLt(cublasLtMatmulPreferenceCreate(&preference), "cublasLtMatmulPreferenceCreate", what, gemm);
  auto prefer = [&](cublasLtMatmulPreferenceAttributes_t attribute, auto value) {
    const cublasStatus_t status = cublasLtMatmulPreferenceSetAttribute(preference, attribute, &value, sizeof(value));
    if (status != CUBLAS_STATUS_SUCCESS) cublasLtMatmulPreferenceDestroy(preference);
    CheckLt(status, "cublasLtMatmulPreferenceSetAttribute", what, gemm);
  };
  prefer(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, uint64_t(kWorkspaceBytes));
  prefer(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, uint32_t(fields[15]));
  prefer(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, uint32_t(fields[16]));
  prefer(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, uint32_t(fields[21]));
  prefer(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, uint32_t(fields[17]));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(handle_, plan->description, plan->a, plan->b, plan->d,
                                                               plan->d, preference, 1, &result, &found);
  cublasLtMatmulPreferenceDestroy(preference);
  // An epilogue a shape does not allow may come back as another status than NOT_SUPPORTED
  // (an aux leading dimension not a multiple of 8: the header does not say which); the
  // caller's own kernels serve it, so it is said, not thrown. A plain product must run.
  if (status != CUBLAS_STATUS_SUCCESS && status != CUBLAS_STATUS_NOT_SUPPORTED) {
    if (gemm.epilogue == CUBLASLT_EPILOGUE_DEFAULT) CheckLt(status, "cublasLtMatmulAlgoGetHeuristic", what, gemm);
    std::fprintf(stderr, "meshtrain: cuBLASLt refused the epilogue of %s (m=%lld n=%lld k=%lld): %s; it runs unfused\n",
                 what, static_cast<long long>(gemm.m), static_cast<long long>(gemm.n), static_cast<long long>(gemm.k),
                 cublasGetStatusName(status));
  }
  plan->supported = status == CUBLAS_STATUS_SUCCESS && found > 0;
  plan->algorithm = result.algo;
  plan->waves = result.wavesCount;
  slot = std::move(plan);
  return *slot;
}

void* BlasLt::Workspace() const { return runtime::DeviceSide::Address(workspace_.get()); }

std::optional<float> BlasLt::Waves(const Gemm& gemm, const char* what) {
  const Plan& plan = PlanFor(gemm, what);
  if (!plan.supported) return std::nullopt;
  return plan.waves;
}

bool BlasLt::Run(const Gemm& gemm, const char* what, cudaStream_t stream) {
  Plan& plan = PlanFor(gemm, what);
  if (!plan.supported) return false;
  // The cached description keeps the pointers of the call that built it.
  if (gemm.bias != nullptr) {
    CheckLt(cublasLtMatmulDescSetAttribute(plan.description, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &gemm.bias,
                                           sizeof(gemm.bias)),
            "cublasLtMatmulDescSetAttribute", what, gemm);
  }
  if (gemm.aux != nullptr) {
    CheckLt(cublasLtMatmulDescSetAttribute(plan.description, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &gemm.aux,
                                           sizeof(gemm.aux)),
            "cublasLtMatmulDescSetAttribute", what, gemm);
  }
  auto repoint = [&](cublasLtMatmulDescAttributes_t attribute, const float* pointer) {
    if (pointer == nullptr) return;
    const void* value = pointer;
    CheckLt(cublasLtMatmulDescSetAttribute(plan.description, attribute, &value, sizeof(value)),
            "cublasLtMatmulDescSetAttribute", what, gemm);
  };
  repoint(CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, gemm.a_scale);
  repoint(CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, gemm.b_scale);
  const void* c = gemm.c != nullptr ? gemm.c : gemm.d;
  CheckLt(cublasLtMatmul(handle_, plan.description, &gemm.alpha, gemm.a, plan.a, gemm.b, plan.b, &gemm.beta, c, plan.d,
                         gemm.d, plan.d, &plan.algorithm, runtime::DeviceSide::Address(workspace_.get()),
                         kWorkspaceBytes, stream),
          "cublasLtMatmul", what, gemm);
  return true;
}

}  // namespace meshtrain::kernels::cuda
