#include "worker/kernels/cuda/cuda_ops.h"

#include <cudnn_graph.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "api/engine_memory.h"
#include "worker/kernels/cuda/attention_blocks.h"
#include "worker/kernels/cuda/blas_lt.h"
#include "worker/kernels/cuda/cudnn_attention.h"
#include "worker/kernels/cuda/float8.h"
#include "worker/kernels/cuda/grouped_gemm.h"
#include "worker/kernels/cuda/launch.h"
#include "worker/runtime/cuda.h"
#include "worker/runtime/device_memory.h"
#include "worker/runtime/device_side.h"

namespace meshtrain::kernels::cuda {

void ThrowLaunchError(cudaError_t status, const char* kernel, const std::string& shape) {
  runtime::cuda::Check(status, std::string("launch of ") + kernel + " (" + shape + ")");
  throw runtime::cuda::CudaError(std::string("launch of ") + kernel + " (" + shape + ") failed");
}

namespace {

using runtime::CachingAllocator;
using runtime::DeviceArray;
using runtime::DeviceSide;
using runtime::MemoryCategory;
using runtime::cuda::CudaError;

static_assert(sizeof(Segment) == sizeof(ShardSegment) && offsetof(Segment, offset) == offsetof(ShardSegment, offset) &&
                  offsetof(Segment, size) == offsetof(ShardSegment, size) &&
                  offsetof(Segment, decay) == offsetof(ShardSegment, decay) &&
                  offsetof(Segment, in_norm) == offsetof(ShardSegment, in_norm),
              "launch.h's Segment must mirror kernels::ShardSegment");
static_assert(sizeof(runtime::bf16) == sizeof(bf16));

// Partial sums of LayerNorm's backward (2C a block) and of the bias gradient (OC a row
// range): 4 MiB each, enough for the largest rows the kernels take.
constexpr int64_t kPartialFloats = int64_t{1} << 20;
// The embedding's backward sorts a micro-batch's rows by token: up to this many rows.
constexpr int64_t kMaxEncoderRows = int64_t{1} << 18;

template <class T>
T* Raw(runtime::DevicePtr<T> p) {
  return DeviceSide::Address(p);
}
bf16* Raw(runtime::DevicePtr<runtime::bf16> p) { return reinterpret_cast<bf16*>(DeviceSide::Address(p)); }
const bf16* Raw(runtime::DevicePtr<const runtime::bf16> p) {
  return reinterpret_cast<const bf16*>(DeviceSide::Address(p));
}

std::string AttentionShape(int B, int T, int NH, int KVH, int HS) {
  return "B=" + std::to_string(B) + " T=" + std::to_string(T) + " NH=" + std::to_string(NH) +
         " KVH=" + std::to_string(KVH) + " HS=" + std::to_string(HS);
}

class CudaOps final : public Ops<Bf16> {
 public:
  CudaOps(runtime::Backend& backend, CachingAllocator* allocator, const CudaOpsOptions& options)
      : allocator_(allocator), options_(options) {
    const runtime::Device device = backend.device();
    if (!device.is_cuda()) {
      throw std::invalid_argument("MakeCudaOps: the backend " + backend.Describe() + " is not a CUDA backend");
    }
    runtime::cuda::UseDevice(device.index);
    runtime::cuda::Check(cudaDeviceGetAttribute(&multiprocessors_, cudaDevAttrMultiProcessorCount, device.index),
                         "cudaDeviceGetAttribute(multiprocessors)");
    cudaDeviceProp properties{};
    runtime::cuda::Check(cudaGetDeviceProperties(&properties, device.index), "cudaGetDeviceProperties");
    if (properties.major * 10 + properties.minor < kFloat8ComputeCapability) {
      float8_refusal_ = device.ToString() + " (" + properties.name + ", compute capability " +
                        std::to_string(properties.major) + "." + std::to_string(properties.minor) +
                        ") has no float8 tensor cores: float8 products need compute capability 8.9 or higher";
    }
    blas_ = std::make_unique<BlasLt>(allocator);
    grouped_ = std::make_unique<GroupedGemm>(allocator, backend.PinnedHostMemory(), blas_->Workspace(),
                                             BlasLt::kWorkspaceBytes);
    if (const cudnnStatus_t status = cudnnCreate(&cudnn_); status != CUDNN_STATUS_SUCCESS) {
      cudnn_ = nullptr;
      cudnn_missing_ = std::string("cudnnCreate: ") + cudnnGetErrorString(status);
    }
    layernorm_partials_ = DeviceArray<float>(allocator, kPartialFloats, MemoryCategory::kActivations);
    bias_partials_ = DeviceArray<float>(allocator, kPartialFloats, MemoryCategory::kActivations);
    norm_partials_ = DeviceArray<double>(allocator, kSumSquaresBlocks, MemoryCategory::kOptimizer);
    encoder_scratch_ = DeviceArray<std::byte>(allocator, int64_t(EncoderBackwardScratchBytes(kMaxEncoderRows)),
                                              MemoryCategory::kActivations);
    moe_plan_scratch_ = DeviceArray<int32_t>(allocator, MoePermutePlanScratchInts(kMaxMoeExperts),
                                             MemoryCategory::kActivations);
  }

  ~CudaOps() override {
    attention_.clear();
    if (cudnn_ != nullptr) cudnnDestroy(cudnn_);
  }

  std::string Describe() const override { return "cuda bf16 (cuBLASLt, cuDNN)"; }

  // --- Attention's memory ---

  AttentionKind Attention(int B, int T, int NH, int KVH, int HS) override {
    return AttentionFor(B, T, NH, KVH, HS, "Attention").fused != nullptr ? AttentionKind::kFused
                                                                         : AttentionKind::kScores;
  }

  int64_t AttentionStateElements(int B, int T, int NH, int KVH, int HS) override {
    const int64_t rows = int64_t(B) * NH * T;
    return AttentionFor(B, T, NH, KVH, HS, "AttentionStateElements").fused != nullptr ? rows : rows * T;
  }

  int64_t AttentionScratchBytes(int B, int T, int NH, int KVH, int HS) override {
    const AttentionPlan& plan = AttentionFor(B, T, NH, KVH, HS, "AttentionScratchBytes");
    if (plan.fused != nullptr) return plan.fused->BackwardScratchBytes();
    return ScoresScratch::Bytes(B, T, NH, KVH, HS);
  }

  // --- Embedding ---

  void EncoderForward(Out<Act> out, In<int32_t> tokens, In<Act> wte, In<Act> wpe, int B, int T, int C,
                      int64_t v_begin, int64_t v_rows, Stream& stream) override {
    cuda::EncoderForward(Raw(out), Raw(tokens), Raw(wte), Raw(wpe), B, T, C, v_begin, v_rows, Handle(stream));
  }

  void EncoderBackward(Out<Acc> dwte, Out<Acc> dwpe, In<Act> dout, In<int32_t> tokens, int B, int T, int C,
                       int64_t v_begin, int64_t v_rows, Stream& stream) override {
    cuda::EncoderBackward(Raw(dwte), Raw(dwpe), Raw(dout), Raw(tokens), B, T, C, v_begin, v_rows,
                          Raw(encoder_scratch_.get()), kMaxEncoderRows, Handle(stream));
  }

  // --- LayerNorm ---

  void LayerNormForward(Out<Act> out, Out<Acc> mean, Out<Acc> rstd, In<Act> inp, In<Act> weight, In<Act> bias,
                        int64_t N, int C, Stream& stream) override {
    cuda::LayerNormForward(nullptr, Raw(out), Raw(mean), Raw(rstd), Raw(inp), nullptr, Raw(weight), Raw(bias), N, C,
                           Handle(stream));
  }

  void ResidualLayerNormForward(Out<Act> residual, Out<Act> out, Out<Acc> mean, Out<Acc> rstd, In<Act> a, In<Act> b,
                                In<Act> weight, In<Act> bias, int64_t N, int C, Stream& stream) override {
    cuda::LayerNormForward(Raw(residual), Raw(out), Raw(mean), Raw(rstd), Raw(a), Raw(b), Raw(weight), Raw(bias), N,
                           C, Handle(stream));
  }

  void LayerNormBackward(Out<Act> dinp, Out<Acc> dweight, Out<Acc> dbias, In<Act> dout, In<Act> inp, In<Act> weight,
                         In<Acc> mean, In<Acc> rstd, int64_t N, int C, Stream& stream) override {
    cuda::LayerNormBackward(Raw(dinp), Raw(dweight), Raw(dbias), Raw(dout), Raw(inp), Raw(weight), Raw(mean),
                            Raw(rstd), N, C, Raw(layernorm_partials_.get()), layernorm_partials_.size(),
                            Handle(stream));
  }

  // --- RMSNorm ---

  void RmsNormForward(Out<Act> out, Out<Acc> rstd, In<Act> inp, In<Act> weight, int64_t N, int C, float eps,
                      Stream& stream) override {
    cuda::RmsNormForward(nullptr, Raw(out), Raw(rstd), Raw(inp), nullptr, Raw(weight), N, C, eps, Handle(stream));
  }

  void ResidualRmsNormForward(Out<Act> residual, Out<Act> out, Out<Acc> rstd, In<Act> a, In<Act> b, In<Act> weight,
                              int64_t N, int C, float eps, Stream& stream) override {
    cuda::RmsNormForward(Raw(residual), Raw(out), Raw(rstd), Raw(a), Raw(b), Raw(weight), N, C, eps, Handle(stream));
  }

  // Shares layernorm_partials_ with LayerNormBackward (stream order).
  void RmsNormBackward(Out<Act> dinp, Out<Acc> dweight, In<Act> dout, In<Act> inp, In<Act> weight, In<Acc> rstd,
                       int64_t N, int C, Stream& stream) override {
    cuda::RmsNormBackward(Raw(dinp), Raw(dweight), Raw(dout), Raw(inp), Raw(weight), Raw(rstd), N, C,
                          Raw(layernorm_partials_.get()), layernorm_partials_.size(), Handle(stream));
  }

  // Shares layernorm_partials_ with the norms' backwards (stream order).
  void HeadRmsNormForward(Out<Act> x, Out<Act> saved, Out<Acc> rstd, In<Act> weight, int64_t N, int heads, int HS,
                          int64_t stride, float eps, Stream& stream) override {
    cuda::HeadRmsNormForward(Raw(x), Raw(saved), Raw(rstd), Raw(weight), N, heads, HS, stride, eps, Handle(stream));
  }
  void HeadRmsNormBackward(Out<Act> dx, Out<Acc> dweight, In<Act> saved, In<Act> weight, In<Acc> rstd, int64_t N,
                           int heads, int HS, int64_t stride, Stream& stream) override {
    cuda::HeadRmsNormBackward(Raw(dx), Raw(dweight), Raw(saved), Raw(weight), Raw(rstd), N, heads, HS, stride,
                              Raw(layernorm_partials_.get()), layernorm_partials_.size(), Handle(stream));
  }

  // --- Products ---
  // cuBLASLt is column-major and a row-major (R,C) array is a column-major (C,R) one, so
  // each product is written transposed. Forward: out^T (OC,N) = weight (OC,K) inp^T
  // (K,N), A = weight stored (K,OC) and transposed, B = inp stored (K,N); the bias is
  // per row of D, as the BIAS epilogues add it.

  void MatmulForward(Out<Act> out, Out<Act> gelu_pre, In<Act> inp, In<Act> weight, In<Act> bias, In<Act> residual,
                     int64_t N, int K, int OC, Stream& stream) override {
    CheckMatmulForward(out, gelu_pre, residual);
    if (N == 0 || OC == 0) return;
    // The residual is C, with beta 1: the epilogue adds it to the fp32 sum.
    Gemm gemm{.transpose_a = true, .m = OC, .n = N, .k = K, .a = Raw(weight), .lda = K, .b = Raw(inp), .ldb = K,
              .d = Raw(out), .c = Raw(residual), .ldd = OC, .beta = residual ? 1.0f : 0.0f, .bias = Raw(bias)};
    if (gelu_pre) {
      gemm.epilogue = bias ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX;
      gemm.aux = Raw(gelu_pre);
      gemm.aux_ld = OC;
    } else {
      gemm.epilogue = bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
    }
    const cudaStream_t handle = Handle(stream);
    if (options_.fused_epilogues && blas_->Run(gemm, "MatmulForward", handle)) return;
    // No fused kernel for this shape: the product (and residual), then bias and GELU on
    // their own, from the sum as stored.
    gemm.epilogue = CUBLASLT_EPILOGUE_DEFAULT;
    gemm.bias = gemm.aux = nullptr;
    RunOrThrow(gemm, "MatmulForward", handle);
    BiasGelu(Raw(out), Raw(gelu_pre), Raw(bias), N, OC, handle);
  }

  // dinp^T (K,N) = weight^T (K,OC) dout^T (OC,N): A = weight stored (K,OC), B = dout
  // stored (OC,N); DGELU multiplies by gelu'(gelu_pre). dweight^T (K,OC) += inp^T (K,N)
  // dout (N,OC): A = inp stored (K,N), B = dout stored (OC,N) and transposed, into fp32
  // with beta 1. dbias: the column sums of dout, which are op(B)'s sums over k, so the
  // BGRADB epilogue of dweight's product computes them as it reads dout (into fp32
  // scratch: it writes, and dbias is added to); without dweight, or where that epilogue
  // would cost the product its spread over the device, our own kernels read dout again.
  void MatmulBackward(Out<Act> dinp, Out<Acc> dweight, Out<Acc> dbias, In<Act> dout, In<Act> inp, In<Act> weight,
                      In<Act> gelu_pre, int64_t N, int K, int OC, Stream& stream) override {
    if (N == 0 || OC == 0) return;
    const cudaStream_t handle = Handle(stream);
    if (K == 0) {  // no products, but dbias still sums dout
      dinp = {};
      dweight = {};
    }
    if (dinp) {
      Gemm gemm{.m = K, .n = N, .k = OC, .a = Raw(weight), .lda = K, .b = Raw(dout), .ldb = OC, .d = Raw(dinp),
                .ldd = K};
      if (gelu_pre) {
        gemm.epilogue = CUBLASLT_EPILOGUE_DGELU;
        gemm.aux = Raw(gelu_pre);
        gemm.aux_ld = K;
      }
      if (!options_.fused_epilogues || !blas_->Run(gemm, "MatmulBackward (dinp)", handle)) {
        gemm.epilogue = CUBLASLT_EPILOGUE_DEFAULT;
        gemm.aux = nullptr;
        RunOrThrow(gemm, "MatmulBackward (dinp)", handle);
        if (gelu_pre) GeluBackwardInPlace(Raw(dinp), Raw(gelu_pre), N * K, handle);
      }
    }
    if (dweight) {
      const Gemm gemm{.transpose_b = true, .m = K, .n = OC, .k = N, .a = Raw(inp), .lda = K, .b = Raw(dout),
                      .ldb = OC, .d = Raw(dweight), .d_type = CUDA_R_32F, .ldd = K, .beta = 1};
      if (dbias && BiasGradientInProduct(gemm, handle)) {
        AddBiasGradient(Raw(dbias), Raw(bias_partials_.get()), OC, handle);
        return;
      }
      RunOrThrow(gemm, "MatmulBackward (dweight)", handle);
    }
    if (dbias) {
      BiasBackward(Raw(dbias), Raw(dout), N, OC, Raw(bias_partials_.get()), bias_partials_.size(), handle);
    }
  }

  // Enqueues dweight's product with the BGRADB epilogue, its column sums of dout into
  // bias_partials_, where cuBLASLt has an algorithm for it that fills the device as the
  // plain product's does (its waves count, up to one full wave, within 10%): a product of
  // few output tiles (K x OC is small, N large) fills the device only by splitting k, and
  // an algorithm for the epilogue without that split would cost more than the read of
  // dout it saves. False, with nothing enqueued, otherwise.
  bool BiasGradientInProduct(const Gemm& plain, cudaStream_t handle) {
    if (!options_.fused_epilogues || plain.n > bias_partials_.size()) return false;
    Gemm fused = plain;
    fused.epilogue = CUBLASLT_EPILOGUE_BGRADB;
    fused.bias = Raw(bias_partials_.get());
    fused.bias_type = CUDA_R_32F;
    const char* what = "MatmulBackward (dweight, dbias)";
    const std::optional<float> fused_waves = blas_->Waves(fused, what);
    if (!fused_waves) return SummedApart(plain, "cuBLASLt has no BGRADB algorithm for it");
    const float plain_waves = blas_->Waves(plain, "MatmulBackward (dweight)").value_or(0);
    if (!options_.bias_gradient_wherever_possible && *fused_waves < 0.9f * std::min(plain_waves, 1.0f)) {
      char why[160];
      std::snprintf(why, sizeof why, "cuBLASLt's BGRADB algorithm fills %.2f waves of the device, the plain "
                    "product's %.2f", double(*fused_waves), double(plain_waves));
      return SummedApart(plain, why);
    }
    if (!blas_->Run(fused, what, handle)) return false;
    if (options_.bias_gradients_in_product != nullptr) ++*options_.bias_gradients_in_product;
    return true;
  }

  // Says once a table that a bias gradient is summed apart from its product, and why.
  bool SummedApart(const Gemm& plain, const char* why) {
    if (!said_bias_gradient_apart_) {
      said_bias_gradient_apart_ = true;
      std::fprintf(stderr, "meshtrain: the bias gradient of the product K=%lld OC=%lld over %lld rows is summed "
                   "apart: %s\n", static_cast<long long>(plain.m), static_cast<long long>(plain.n),
                   static_cast<long long>(plain.k), why);
    }
    return false;
  }

  // --- Float8 products (float8.h; kernels/ops.h, "Float8 products") ---
  // Each product casts its two bf16 operands into float8 codes in the table's float8
  // scratch, laid out K-major as cuBLASLt's float8 products take them ("TN": A transposed,
  // B not; described transposed as every product here, so A holds m rows and B n rows of
  // k codes): a cast that must also transpose (an operand contracted over its rows) does
  // so in the same kernel. Then one cuBLASLt product, E4M3 x E4M3 or E4M3 x E5M2, fp32
  // accumulation:
  //   forward      out^T (OC,N):  A = q(weight) (OC,K), B = q(inp) (N,K)
  //   grad input   dinp^T (K,N):  A = q(weight)^T (K,OC), cast transposed; B = q(dout) (N,OC)
  //   grad weight  dweight^T (K,OC) +=  A = q(inp)^T (K,N), B = q(dout)^T (OC,N), both cast
  //                transposed
  // Tensorwise: the scales' reciprocals are cuBLASLt's A and B scale pointers, and a
  // product with nothing after it writes out, dinp (bf16) or adds into dweight (fp32, beta
  // 1) itself. Rowwise: cuBLASLt multiplies unit-scaled codes into fp32 and Fp8Epilogue or
  // Fp8AccumulateScaled divides each sum by its row's and column's scales (exact: they
  // are powers of 2). That is correctness first: cuBLASLt's outer-vector scale mode
  // (CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F) would fold the division into the product,
  // but cuBLASLt does not say which devices take it. The forward's bias, residual and GELU
  // and the grad input's GELU derivative run in Fp8Epilogue after an fp32 product too,
  // from the sum in fp32 and rounded once, as MatmulForward's epilogue. Those fp32 sums
  // are taken api::kFloat8SumBytes of rows at a time.

  void Float8Amax(Out<float> amax, In<Act> x, int64_t rows, int cols, Float8Scaling scaling, Stream& stream) override {
    CheckFloat8("Float8Amax");
    if (rows < 0 || cols < 0) {
      throw std::invalid_argument("Float8Amax: a tensor of " + std::to_string(rows) + " x " + std::to_string(cols));
    }
    Fp8Amax(Raw(amax), Raw(x), rows, cols, AxisOf(scaling), Handle(stream));
  }

  void Float8Scales(Out<float> scale, In<float> amax, int64_t n, int copies, int64_t copy_stride, Float8 format,
                    bool power_of_2, Stream& stream) override {
    CheckFloat8("Float8Scales");
    if (n < 0 || copies < 1 || (copies > 1 && copy_stride < n)) {
      throw std::invalid_argument("Float8Scales: " + std::to_string(n) + " scales of " + std::to_string(copies) +
                                  " copies " + std::to_string(copy_stride) + " apart");
    }
    Fp8Scales(Raw(scale), Raw(amax), n, copies, copy_stride, FormatOf(format), power_of_2, Handle(stream));
  }

  void Float8MatmulForward(Out<Act> out, Out<Act> gelu_pre, In<Act> inp, In<float> inp_scale, In<Act> weight,
                           In<float> weight_scale, In<Act> bias, In<Act> residual, int64_t N, int K, int OC,
                           Float8Recipe recipe, Stream& stream) override {
    const char* what = "Float8MatmulForward";
    CheckFloat8(what);
    CheckMatmulForward(out, gelu_pre, residual);
    CheckFloat8Shape(what, N, K, OC);
    if (N == 0) return;
    const cudaStream_t handle = Handle(stream);
    const Float8Cast a = Float8CastOf(recipe, Float8Operand::kWeightForward);
    const Float8Cast b = Float8CastOf(recipe, Float8Operand::kInpForward);
    const bool tensorwise = IsTensorwise(a, b);
    const bool direct = !api::Float8KeepsSums(!tensorwise, bias || residual || gelu_pre);
    const Float8Codes codes = CastFloat8Operands({Raw(weight), OC, K, Raw(weight_scale), a, false},
                                                 {Raw(inp), N, K, Raw(inp_scale), b, false}, OC, N, K, !direct, handle);
    Gemm gemm = Float8Gemm(codes, a, b, OC, N, K);
    if (direct) {
      gemm.d = Raw(out);
      RunOrThrow(gemm, what, handle);
      return;
    }
    for (int64_t r0 = 0; r0 < N; r0 += codes.rows_per_sum) {
      const int64_t rows = std::min(codes.rows_per_sum, N - r0);
      RunFloat8Sum(gemm, codes, r0, rows, what, handle);
      Fp8Epilogue(Raw(out) + r0 * OC, gelu_pre ? Raw(gelu_pre) + r0 * OC : nullptr, codes.sum, rows, OC,
                  tensorwise ? nullptr : Raw(inp_scale) + r0, tensorwise ? nullptr : Raw(weight_scale), Raw(bias),
                  residual ? Raw(residual) + r0 * OC : nullptr, nullptr, handle);
    }
  }

  void Float8MatmulGradInput(Out<Act> dinp, In<Act> dout, In<float> dout_scale, In<Act> weight,
                             In<float> weight_scale, In<Act> gelu_pre, int64_t N, int K, int OC, Float8Recipe recipe,
                             Stream& stream) override {
    const char* what = "Float8MatmulGradInput";
    CheckFloat8(what);
    CheckFloat8Shape(what, N, K, OC);
    if (N == 0) return;
    const cudaStream_t handle = Handle(stream);
    const Float8Cast a = Float8CastOf(recipe, Float8Operand::kWeightForGradInput);
    const Float8Cast b = Float8CastOf(recipe, Float8Operand::kDoutForGradInput);
    const bool tensorwise = IsTensorwise(a, b);
    const bool direct = !api::Float8KeepsSums(!tensorwise, bool(gelu_pre));
    const Float8Codes codes = CastFloat8Operands({Raw(weight), OC, K, Raw(weight_scale), a, true},
                                                 {Raw(dout), N, OC, Raw(dout_scale), b, false}, K, N, OC, !direct,
                                                 handle);
    Gemm gemm = Float8Gemm(codes, a, b, K, N, OC);
    if (direct) {
      gemm.d = Raw(dinp);
      RunOrThrow(gemm, what, handle);
      return;
    }
    for (int64_t r0 = 0; r0 < N; r0 += codes.rows_per_sum) {
      const int64_t rows = std::min(codes.rows_per_sum, N - r0);
      RunFloat8Sum(gemm, codes, r0, rows, what, handle);
      Fp8Epilogue(Raw(dinp) + r0 * K, nullptr, codes.sum, rows, K, tensorwise ? nullptr : Raw(dout_scale) + r0,
                  tensorwise ? nullptr : Raw(weight_scale), nullptr, nullptr,
                  gelu_pre ? Raw(gelu_pre) + r0 * K : nullptr, handle);
    }
  }

  void Float8MatmulGradWeight(Out<Acc> dweight, Out<Acc> dbias, In<Act> dout, In<float> dout_scale, In<Act> inp,
                              In<float> inp_scale, int64_t N, int K, int OC, Float8Recipe recipe,
                              Stream& stream) override {
    const char* what = "Float8MatmulGradWeight";
    CheckFloat8(what);
    CheckFloat8Shape(what, N, K, OC);
    if (N == 0) return;
    const cudaStream_t handle = Handle(stream);
    if (dweight) {
      const Float8Cast a = Float8CastOf(recipe, Float8Operand::kInpForGradWeight);
      const Float8Cast b = Float8CastOf(recipe, Float8Operand::kDoutForGradWeight);
      const bool tensorwise = IsTensorwise(a, b);
      const bool sums = api::Float8KeepsSums(!tensorwise, false);
      const Float8Codes codes = CastFloat8Operands({Raw(inp), N, K, Raw(inp_scale), a, true},
                                                   {Raw(dout), N, OC, Raw(dout_scale), b, true}, K, OC, N, sums,
                                                   handle);
      Gemm gemm = Float8Gemm(codes, a, b, K, OC, N);
      if (!sums) {
        gemm.d = Raw(dweight);
        gemm.d_type = CUDA_R_32F;
        gemm.beta = 1;
        RunOrThrow(gemm, what, handle);
      } else {
        for (int64_t r0 = 0; r0 < OC; r0 += codes.rows_per_sum) {
          const int64_t rows = std::min(codes.rows_per_sum, OC - r0);
          RunFloat8Sum(gemm, codes, r0, rows, what, handle);
          Fp8AccumulateScaled(Raw(dweight) + r0 * K, codes.sum, rows, K, Raw(dout_scale) + r0, Raw(inp_scale),
                              handle);
        }
      }
    }
    // The column sums of dout as stored (not cast), as MatmulBackward's own kernels sum them.
    if (dbias) BiasBackward(Raw(dbias), Raw(dout), N, OC, Raw(bias_partials_.get()), bias_partials_.size(), handle);
  }

  // --- Attention ---

  void AttentionForward(Out<Act> out, Out<Acc> state, In<Act> qkv, int B, int T, int NH, int KVH, int HS,
                        Stream& stream) override {
    if (int64_t(B) * T == 0) return;
    AttentionPlan& plan = AttentionFor(B, T, NH, KVH, HS, "AttentionForward");
    if (plan.fused != nullptr) {
      plan.fused->Forward(Raw(out), Raw(state), Raw(qkv), Handle(stream));
      return;
    }
    ScoresForward(plan, Raw(out), Raw(state), Raw(qkv), B, T, NH, KVH, HS, Handle(stream));
  }

  void AttentionBackward(Out<Act> dqkv, Out<std::byte> scratch, In<Act> dout, In<Act> qkv, In<Act> out,
                         In<Acc> state, int B, int T, int NH, int KVH, int HS, Stream& stream) override {
    if (int64_t(B) * T == 0) return;
    AttentionPlan& plan = AttentionFor(B, T, NH, KVH, HS, "AttentionBackward");
    if (plan.fused != nullptr) {
      plan.fused->Backward(Raw(dqkv), Raw(scratch), Raw(dout), Raw(qkv), Raw(out), Raw(state), Handle(stream));
      return;
    }
    ScoresBackward(Raw(dqkv), Raw(scratch), Raw(dout), Raw(qkv), Raw(state), B, T, NH, KVH, HS, Handle(stream));
  }

  // --- Attention by blocks (attention_blocks.h: plain kernels, not cuDNN) ---

  void AttentionBlockForward(Out<Acc> out, Out<Acc> lse, In<Act> q, In<Act> k, In<Act> v,
                             const AttentionBlock& shape, Stream& stream) override {
    cuda::AttentionBlockForward(Raw(out), Raw(lse), Raw(q), Raw(k), Raw(v), BlockShape(shape, "AttentionBlockForward"),
                                Handle(stream));
  }

  void AttentionMerge(Out<Acc> out, Out<Acc> lse, In<Acc> block_out, In<Acc> block_lse, const AttentionBlock& shape,
                      Stream& stream) override {
    cuda::AttentionMerge(Raw(out), Raw(lse), Raw(block_out), Raw(block_lse), BlockShape(shape, "AttentionMerge"),
                         Handle(stream));
  }

  void AttentionRowDot(Out<Acc> D, In<Act> dout, In<Act> out, const AttentionBlock& shape, Stream& stream) override {
    cuda::AttentionRowDot(Raw(D), Raw(dout), Raw(out), BlockShape(shape, "AttentionRowDot"), Handle(stream));
  }

  void AttentionBlockBackward(Out<Acc> dq, Out<Acc> dk, Out<Acc> dv, In<Act> dout, In<Act> q, In<Act> k, In<Act> v,
                              In<Acc> lse, In<Acc> D, const AttentionBlock& shape, Stream& stream) override {
    cuda::AttentionBlockBackward(Raw(dq), Raw(dk), Raw(dv), Raw(dout), Raw(q), Raw(k), Raw(v), Raw(lse), Raw(D),
                                 BlockShape(shape, "AttentionBlockBackward"), Handle(stream));
  }

  // The shape checked (Ops::CheckAttentionBlock, and a head the kernels' registers hold),
  // as the launchers take it.
  static AttentionBlockShape BlockShape(const AttentionBlock& s, const char* what) {
    CheckAttentionBlock(s, what);
    if (s.HS > kMaxAttentionBlockHeadSize) {
      throw std::invalid_argument(std::string(what) + ": heads of " + std::to_string(s.HS) +
                                  " channels (this table takes at most " +
                                  std::to_string(kMaxAttentionBlockHeadSize) + ")");
    }
    auto rows = [](AttentionRows r) { return BlockRows{r.row, r.batch}; };
    return {s.B, s.Tq, s.Tk, s.NH, s.KVH, s.HS, s.mask == AttentionMask::kCausal, rows(s.q), rows(s.k), rows(s.v),
            rows(s.out), BlockStats{s.stats.head, s.stats.batch}, rows(s.dout), rows(s.dq), rows(s.dk), rows(s.dv)};
  }

  // --- RoPE ---

  void RopeForward(Out<Act> qkv, In<Acc> cos, In<Acc> sin, int B, int T, int NH, int KVH, int HS,
                   Stream& stream) override {
    CheckRope(HS, "RopeForward");
    cuda::Rope(Raw(qkv), Raw(cos), Raw(sin), B, T, NH, KVH, HS, /*backward=*/false, Handle(stream));
  }

  void RopeBackward(Out<Act> dqkv, In<Acc> cos, In<Acc> sin, int B, int T, int NH, int KVH, int HS,
                    Stream& stream) override {
    CheckRope(HS, "RopeBackward");
    cuda::Rope(Raw(dqkv), Raw(cos), Raw(sin), B, T, NH, KVH, HS, /*backward=*/true, Handle(stream));
  }

  // --- SwiGLU ---

  void SwiGluForward(Out<Act> out, In<Act> gate_up, int64_t N, int H, Stream& stream) override {
    cuda::SwiGluForward(Raw(out), Raw(gate_up), N, H, Handle(stream));
  }

  void SwiGluBackward(Out<Act> dgate_up, In<Act> dout, In<Act> gate_up, int64_t N, int H, Stream& stream) override {
    cuda::SwiGluBackward(Raw(dgate_up), Raw(dout), Raw(gate_up), N, H, Handle(stream));
  }

  // --- Mixture of experts ---

  void RouterTopKForward(Out<Acc> probs, Out<int32_t> experts, Out<Acc> weights, In<Act> logits, int64_t N, int E,
                         int k, bool renormalize, Stream& stream) override {
    CheckRouter(E, k, "RouterTopKForward");
    cuda::RouterTopKForward(Raw(probs), Raw(experts), Raw(weights), Raw(logits), N, E, k, renormalize,
                            Handle(stream));
  }

  void RouterTopKBackward(Out<Act> dlogits, In<Acc> dweights, In<Acc> dprobs, In<Acc> probs, In<int32_t> experts,
                          int64_t N, int E, int k, bool renormalize, Stream& stream) override {
    CheckRouter(E, k, "RouterTopKBackward");
    cuda::RouterTopKBackward(Raw(dlogits), Raw(dweights), Raw(dprobs), Raw(probs), Raw(experts), N, E, k, renormalize,
                             Handle(stream));
  }

  // Shares moe_plan_scratch_ with every other plan (stream order).
  void MoePermutePlan(Out<int32_t> counts, Out<int32_t> positions, In<int32_t> experts, int64_t N, int k, int E,
                      Stream& stream) override {
    if (E < 0 || E > kMaxMoeExperts || k < 0 || N < 0 || N * k > int64_t(INT32_MAX)) {
      throw std::invalid_argument("MoePermutePlan: " + std::to_string(N) + " tokens to " + std::to_string(k) +
                                  " of " + std::to_string(E) + " experts (at most " +
                                  std::to_string(kMaxMoeExperts) + " experts and 2^31 - 1 copies)");
    }
    cuda::MoePermutePlan(Raw(counts), Raw(positions), Raw(experts), N, k, E, Raw(moe_plan_scratch_.get()),
                         Handle(stream));
  }

  void MoePermute(Out<Act> xs, In<Act> x, In<int32_t> positions, int64_t N, int k, int C, Stream& stream) override {
    cuda::MoePermute(Raw(xs), Raw(x), Raw(positions), N, k, C, Handle(stream));
  }

  void MoePermuteBackward(Out<Act> dx, In<Act> dxs, In<int32_t> positions, int64_t N, int k, int C,
                          Stream& stream) override {
    cuda::MoePermuteBackward(Raw(dx), Raw(dxs), Raw(positions), N, k, C, Handle(stream));
  }

  void MoeCombineForward(Out<Act> out, In<Act> ys, In<Acc> weights, In<int32_t> positions, In<Act> residual,
                         int64_t N, int k, int C, Stream& stream) override {
    cuda::MoeCombineForward(Raw(out), Raw(ys), Raw(weights), Raw(positions), Raw(residual), N, k, C, Handle(stream));
  }

  void MoeCombineBackward(Out<Act> dys, Out<Acc> dweights, In<Act> dout, In<Act> ys, In<Acc> weights,
                          In<int32_t> positions, int64_t N, int k, int C, Stream& stream) override {
    cuda::MoeCombineBackward(Raw(dys), Raw(dweights), Raw(dout), Raw(ys), Raw(weights), Raw(positions), N, k, C,
                             Handle(stream));
  }

  // The experts' products, one per expert with rows, each described as MatmulForward's
  // and MatmulBackward's (no epilogues). out and dinp: one cublasGemmGroupedBatchedEx
  // call for all of them (grouped_gemm.h). dweight: a loop of cuBLASLt products, one per
  // expert, because the grouped API takes no bf16 A and B into an fp32 C (cuBLAS
  // documents, for CUBLAS_COMPUTE_32F, only A/B/C all bf16, all fp16 or all fp32), and
  // dweight is summed into fp32 with beta 1; their plans are cached by shape as every
  // product's (blas_lt.h bounds the cache, as the row counts change from step to step).
  // The same loop serves out and dinp where the grouped API cannot (an expert's rows
  // that do not start on 16 bytes, as K or OC not a multiple of 8 leaves them; a cuBLAS
  // that refuses it).
  void GroupedMatmulForward(Out<Act> out, In<Act> inp, In<Act> weight, const int32_t* counts, int E, int K, int OC,
                            Stream& stream) override {
    CheckCounts(counts, E, "GroupedMatmulForward");
    if (K == 0 || OC == 0) return;
    const cudaStream_t handle = Handle(stream);
    // out_e^T (OC,m) = weight_e (OC,K) inp_e^T (K,m): A = weight_e stored (K,OC) and
    // transposed, B = inp_e stored (K,m).
    grouped_problems_.clear();
    int64_t row = 0;
    for (int e = 0; e < E; ++e) {
      const int m = counts[e];
      if (m == 0) continue;
      grouped_problems_.push_back({.a = Raw(weight + int64_t(e) * OC * K), .b = Raw(inp + row * K),
                                   .d = Raw(out + row * OC), .m = OC, .n = m, .k = K});
      row += m;
    }
    const char* what = "GroupedMatmulForward";
    if (grouped_->Run({.transpose_a = true, .lda = K, .ldb = K, .ldd = OC}, grouped_problems_, what, handle)) return;
    for (const GroupedProblem& p : grouped_problems_) {
      const Gemm gemm{.transpose_a = true, .m = OC, .n = p.n, .k = K, .a = p.a, .lda = K, .b = p.b, .ldb = K,
                      .d = p.d, .ldd = OC};
      RunOrThrow(gemm, what, handle);
    }
  }

  void GroupedMatmulBackward(Out<Act> dinp, Out<Acc> dweight, In<Act> dout, In<Act> inp, In<Act> weight,
                             const int32_t* counts, int E, int K, int OC, Stream& stream) override {
    CheckCounts(counts, E, "GroupedMatmulBackward");
    if (K == 0 || OC == 0) return;
    const cudaStream_t handle = Handle(stream);
    if (dinp) {
      // dinp_e^T (K,m) = weight_e^T (K,OC) dout_e^T (OC,m): A = weight_e stored (K,OC),
      // B = dout_e stored (OC,m).
      grouped_problems_.clear();
      int64_t row = 0;
      for (int e = 0; e < E; ++e) {
        const int m = counts[e];
        if (m == 0) continue;
        grouped_problems_.push_back({.a = Raw(weight + int64_t(e) * OC * K), .b = Raw(dout + row * OC),
                                     .d = Raw(dinp + row * K), .m = K, .n = m, .k = OC});
        row += m;
      }
      const char* what = "GroupedMatmulBackward (dinp)";
      if (!grouped_->Run({.lda = K, .ldb = OC, .ldd = K}, grouped_problems_, what, handle)) {
        for (const GroupedProblem& p : grouped_problems_) {
          const Gemm gemm{.m = K, .n = p.n, .k = OC, .a = p.a, .lda = K, .b = p.b, .ldb = OC, .d = p.d, .ldd = K};
          RunOrThrow(gemm, what, handle);
        }
      }
    }
    if (dweight) {
      // dweight_e^T (K,OC) += inp_e^T (K,m) dout_e (m,OC): A = inp_e stored (K,m), B =
      // dout_e stored (OC,m) and transposed, into fp32 with beta 1 (see above).
      int64_t row = 0;
      for (int e = 0; e < E; ++e) {
        const int64_t m = counts[e];
        if (m == 0) continue;
        const Gemm gemm{.transpose_b = true, .m = K, .n = OC, .k = m, .a = Raw(inp + row * K), .lda = K,
                        .b = Raw(dout + row * OC), .ldb = OC, .d = Raw(dweight + int64_t(e) * OC * K),
                        .d_type = CUDA_R_32F, .ldd = K, .beta = 1};
        RunOrThrow(gemm, "GroupedMatmulBackward (dweight)", handle);
        row += m;
      }
    }
  }

  // --- Elementwise ---

  void Add(Out<Act> out, In<Act> a, In<Act> b, int64_t n, Stream& stream) override {
    cuda::Add(Raw(out), Raw(a), Raw(b), n, Handle(stream));
  }

  void Dropout(Out<Act> out, In<Act> in, int64_t rows, int width, float p, uint64_t key, int64_t first_row,
               int64_t row_stride, int64_t first_column, Stream& stream) override {
    cuda::Dropout(Raw(out), Raw(in), rows, width, p, key, first_row, row_stride, first_column, Handle(stream));
  }

  // --- Loss ---

  void CrossEntropy(Out<Acc> losses, Out<Act> dlogits, In<Act> logits, In<int32_t> targets, int64_t R,
                    int64_t v_rows, int64_t Vp, float dloss, Stream& stream) override {
    cuda::CrossEntropy(Raw(losses), Raw(dlogits), Raw(logits), Raw(targets), R, v_rows, Vp, dloss, Handle(stream));
  }

  void VocabSliceStats(Out<Acc> stats, In<Act> logits, In<int32_t> targets, int64_t R, int64_t v_rows, int64_t Vp,
                       int64_t v_begin, Stream& stream) override {
    cuda::VocabSliceStats(Raw(stats), Raw(logits), Raw(targets), R, v_rows, Vp, v_begin, Handle(stream));
  }

  void VocabSliceCrossEntropy(Out<Acc> losses, Out<Act> dlogits, In<Act> logits, In<Acc> all_stats, int slices,
                              In<int32_t> targets, int64_t R, int64_t v_rows, int64_t Vp, int64_t v_begin,
                              float dloss, Stream& stream) override {
    cuda::VocabSliceCrossEntropy(Raw(losses), Raw(dlogits), Raw(logits), Raw(all_stats), slices, Raw(targets), R,
                                 v_rows, Vp, v_begin, dloss, Handle(stream));
  }

  void AddLoss(Out<double> sum, In<Acc> losses, int64_t R, double scale, Stream& stream) override {
    cuda::AddLoss(Raw(sum), Raw(losses), R, scale, Handle(stream));
  }

  // --- Shard operations ---

  void Accumulate(Out<Acc> into, In<Acc> from, int64_t n, float scale, Stream& stream) override {
    cuda::Accumulate(Raw(into), Raw(from), n, scale, Handle(stream));
  }

  void Cast(Out<Act> to, In<Acc> from, int64_t n, Stream& stream) override {
    cuda::Cast(Raw(to), Raw(from), n, Handle(stream));
  }

  void SumSquares(Out<double> sum, In<Acc> grads, In<ShardSegment> segments, int count, Stream& stream) override {
    cuda::SumSquares(Raw(sum), Raw(grads), reinterpret_cast<const Segment*>(Raw(segments)), count,
                     Raw(norm_partials_.get()), Handle(stream));
  }

  void ClipScale(Out<float> scale, In<double> sum_of_squares, float max_norm, Stream& stream) override {
    cuda::ClipScale(Raw(scale), Raw(sum_of_squares), max_norm, Handle(stream));
  }

  void AdamW(Out<Acc> master, Out<Act> params, In<Acc> grads, Out<Acc> m, Out<Acc> v, In<ShardSegment> segments,
             int count, const AdamWStep& step, In<float> clip_scale, Stream& stream) override {
    AdamWConstants constants{};
    constants.learning_rate = step.learning_rate;
    constants.beta1 = step.beta1;
    constants.beta2 = step.beta2;
    constants.epsilon = step.epsilon;
    constants.weight_decay = step.weight_decay;
    constants.correction1 = 1.0f - std::pow(step.beta1, float(step.t));
    constants.correction2 = 1.0f - std::pow(step.beta2, float(step.t));
    cuda::AdamW(Raw(master), Raw(params), Raw(grads), Raw(m), Raw(v), reinterpret_cast<const Segment*>(Raw(segments)),
                count, constants, Raw(clip_scale), multiprocessors_, Handle(stream));
  }

 private:
  // The scores path's backward scratch: dP (fp32), dS and P (bf16), each (B,NH,T,T); and
  // with groups of query heads (KVH < NH), dK and dV summed over each group in fp32,
  // (B,T,2*KVH*HS) laid out as dqkv's k and v channels.
  struct ScoresScratch {
    static constexpr int64_t kAlignment = 256;
    static int64_t Up(int64_t bytes) { return (bytes + kAlignment - 1) / kAlignment * kAlignment; }
    static int64_t KeyValueElements(int B, int T, int NH, int KVH, int HS) {
      return NH == KVH ? 0 : int64_t(B) * T * 2 * KVH * HS;
    }
    static int64_t Bytes(int B, int T, int NH, int KVH, int HS) {
      const int64_t elements = int64_t(B) * NH * T * T;
      return Up(elements * 4) + 2 * Up(elements * 2) + Up(KeyValueElements(B, T, NH, KVH, HS) * 4) + kAlignment;
    }
    ScoresScratch(std::byte* scratch, int B, int T, int NH) {
      const int64_t elements = int64_t(B) * NH * T * T;
      auto* start = reinterpret_cast<std::byte*>(Up(int64_t(reinterpret_cast<uintptr_t>(scratch))));
      dprobs = reinterpret_cast<float*>(start);
      dscores = reinterpret_cast<bf16*>(start + Up(elements * 4));
      probs = reinterpret_cast<bf16*>(start + Up(elements * 4) + Up(elements * 2));
      key_value = reinterpret_cast<float*>(start + Up(elements * 4) + 2 * Up(elements * 2));
    }
    float* dprobs;
    bf16 *dscores, *probs;
    float* key_value;  // only when KVH < NH
  };

  // cuDNN's plans, or the scores path's forward scratch (P as bf16) where cuDNN refuses.
  struct AttentionPlan {
    std::unique_ptr<CudnnAttention> fused;
    DeviceArray<bf16> probs;
  };

  static cudaStream_t Handle(Stream& stream) { return runtime::cuda::StreamHandle(stream); }

  static void CheckHeads(int NH, int KVH, int HS, const char* what) {
    if (NH <= 0 || KVH <= 0 || HS <= 0 || NH % KVH != 0) {
      throw std::invalid_argument(std::string(what) + ": " + std::to_string(NH) +
                                  " query heads do not make groups of " + std::to_string(KVH) +
                                  " key/value heads of " + std::to_string(HS) + " channels");
    }
  }

  static void CheckRouter(int E, int k, const char* what) {
    if (E < 1 || k < 1 || k > E || k > kMaxMoeTopK) {
      throw std::invalid_argument(std::string(what) + ": the top " + std::to_string(k) + " of " + std::to_string(E) +
                                  " experts (this table takes 1 <= k <= " + std::to_string(kMaxMoeTopK) + ")");
    }
  }

  static void CheckCounts(const int32_t* counts, int E, const char* what) {
    for (int e = 0; e < E; ++e) {
      if (counts[e] < 0) {
        throw std::invalid_argument(std::string(what) + ": expert " + std::to_string(e) + " has " +
                                    std::to_string(counts[e]) + " rows");
      }
    }
  }

  static void CheckRope(int HS, const char* what) {
    if (HS <= 0 || HS % 2 != 0) {
      throw std::invalid_argument(std::string(what) + ": the head size " + std::to_string(HS) +
                                  " is not even, so its halves cannot rotate");
    }
  }

  // --- Float8 helpers ---

  // Compute capability 8.9 (Ada) and up have float8 tensor cores.
  static constexpr int kFloat8ComputeCapability = 89;

  std::string Float8Refusal() const override { return float8_refusal_; }
  int64_t Float8ScratchBytes(int64_t m, int64_t n, int64_t k, bool sums) const override {
    return api::Float8ProductBytes({m, n, k}, sums);
  }
  // Throws, before anything is enqueued, on a device without float8 tensor cores.
  void CheckFloat8(const char* what) const {
    if (!float8_refusal_.empty()) throw std::invalid_argument(std::string(what) + ": " + float8_refusal_);
  }

  // cuBLASLt's float8 products take k, m and n, and so K, OC and N, in multiples of 16
  // (the engine refuses other widths before it gets here).
  static void CheckFloat8Shape(const char* what, int64_t N, int K, int OC) {
    if (N < 0 || K <= 0 || OC <= 0 || N % 16 != 0 || K % 16 != 0 || OC % 16 != 0) {
      throw std::invalid_argument(std::string(what) + ": N=" + std::to_string(N) + " K=" + std::to_string(K) +
                                  " OC=" + std::to_string(OC) +
                                  " (cuBLASLt's float8 products take positive K and OC and N >= 0, "
                                  "each a multiple of 16)");
    }
  }

  static Fp8Format FormatOf(Float8 format) { return format == Float8::kE4M3 ? Fp8Format::kE4M3 : Fp8Format::kE5M2; }
  static cudaDataType TypeOf(Float8 format) { return format == Float8::kE4M3 ? CUDA_R_8F_E4M3 : CUDA_R_8F_E5M2; }
  static Fp8Axis AxisOf(Float8Scaling scaling) {
    return scaling == Float8Scaling::kTensor ? Fp8Axis::kTensor
           : scaling == Float8Scaling::kRow  ? Fp8Axis::kRow
                                             : Fp8Axis::kColumn;
  }
  static bool IsTensorwise(const Float8Cast& a, const Float8Cast& b) {
    if ((a.scaling == Float8Scaling::kTensor) != (b.scaling == Float8Scaling::kTensor)) {
      throw std::logic_error("a float8 product of one tensorwise and one rowwise operand");
    }
    return a.scaling == Float8Scaling::kTensor;
  }

  // A bf16 operand as stored (rows,cols), its scales and cast; `transpose`: its codes are
  // laid out (cols,rows).
  struct Float8Source {
    const bf16* x;
    int64_t rows;
    int64_t cols;
    const float* scale;
    Float8Cast cast;
    bool transpose;
  };

  // A product's operands in the float8 scratch: a (m rows of k codes), b (n rows of k),
  // the tensorwise descales (A's, B's), and room for rows_per_sum x m fp32 sums.
  struct Float8Codes {
    const uint8_t* a = nullptr;
    const uint8_t* b = nullptr;
    const float* descale = nullptr;  // tensorwise only
    float* sum = nullptr;            // when asked for
    int64_t m = 0, k = 0, rows_per_sum = 0;
  };

  // Casts both operands of a product D (m,n) = A^T B over k into the float8 scratch (grown
  // first when this product needs more than any before it: see float8_scratch_).
  Float8Codes CastFloat8Operands(const Float8Source& a, const Float8Source& b, int64_t m, int64_t n, int64_t k,
                                 bool with_sums, cudaStream_t stream) {
    // Carved as api::Float8ProductBytes counts it (the memory model's).
    constexpr int64_t kAlign = 256;
    auto up = [](int64_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; };
    Float8Codes codes;
    codes.m = m;
    codes.k = k;
    codes.rows_per_sum = with_sums ? api::Float8SumRows(m, n) : 0;
    const int64_t a_bytes = up(m * k), b_bytes = up(n * k), descale_bytes = kAlign;
    std::byte* start = Float8Scratch(api::Float8ProductBytes({m, n, k}, with_sums), stream);
    start = reinterpret_cast<std::byte*>(up(int64_t(reinterpret_cast<uintptr_t>(start))));
    auto* a_codes = reinterpret_cast<uint8_t*>(start);
    auto* b_codes = reinterpret_cast<uint8_t*>(start + a_bytes);
    auto* descale = reinterpret_cast<float*>(start + a_bytes + b_bytes);
    codes.a = a_codes;
    codes.b = b_codes;
    if (with_sums) codes.sum = reinterpret_cast<float*>(start + a_bytes + b_bytes + descale_bytes);
    for (const auto& [source, q] : {std::pair{&a, a_codes}, std::pair{&b, b_codes}}) {
      Fp8Cast(q, source->x, source->scale, source->rows, int(source->cols), FormatOf(source->cast.format),
              AxisOf(source->cast.scaling), source->transpose, stream);
    }
    if (IsTensorwise(a.cast, b.cast)) {
      Fp8Descales(descale, a.scale, b.scale, stream);
      codes.descale = descale;
    }
    return codes;
  }

  // The product over the codes, written nowhere yet (the caller sets d, or RunFloat8Sum).
  static Gemm Float8Gemm(const Float8Codes& codes, const Float8Cast& a, const Float8Cast& b, int64_t m, int64_t n,
                         int64_t k) {
    Gemm gemm{.transpose_a = true, .m = m, .n = n, .k = k, .a = codes.a, .lda = k, .b = codes.b, .ldb = k, .ldd = m};
    gemm.a_type = TypeOf(a.format);
    gemm.b_type = TypeOf(b.format);
    if (codes.descale != nullptr) {
      gemm.a_scale = codes.descale;
      gemm.b_scale = codes.descale + 1;
    }
    return gemm;
  }

  // Rows [r0, r0 + rows) of the product (its n axis) into codes.sum, fp32.
  void RunFloat8Sum(Gemm gemm, const Float8Codes& codes, int64_t r0, int64_t rows, const char* what,
                    cudaStream_t stream) {
    gemm.n = rows;
    gemm.b = codes.b + r0 * codes.k;
    gemm.d = codes.sum;
    gemm.d_type = CUDA_R_32F;
    gemm.beta = 0;
    RunOrThrow(gemm, what, stream);
  }

  // The float8 scratch, at least `bytes`. It grows, to what is asked, only when a product
  // needs more than any before it, so it ends as large as the largest product's
  // (api::Float8ProductBytes, which the memory model counts): the old block may still be
  // read by work enqueued before, and the allocator does not follow streams, so the stream
  // is waited for first (once a shape, in the first step).
  std::byte* Float8Scratch(int64_t bytes, cudaStream_t stream) {
    if (float8_scratch_.size() < bytes) {
      if (float8_scratch_.size() > 0) {
        runtime::cuda::Check(cudaStreamSynchronize(stream), "cudaStreamSynchronize (growing the float8 scratch)");
      }
      float8_scratch_ = DeviceArray<std::byte>();
      float8_scratch_ = DeviceArray<std::byte>(allocator_, bytes, MemoryCategory::kActivations);
    }
    return Raw(float8_scratch_.get());
  }

  void RunOrThrow(const Gemm& gemm, const char* what, cudaStream_t stream) {
    if (!blas_->Run(gemm, what, stream)) {
      throw CudaError(std::string("cuBLASLt has no algorithm for ") + what + " (m=" + std::to_string(gemm.m) +
                      " n=" + std::to_string(gemm.n) + " k=" + std::to_string(gemm.k) + ")");
    }
  }

  // Built when a shape is first asked for (the engine asks before its first step).
  AttentionPlan& AttentionFor(int B, int T, int NH, int KVH, int HS, const char* what) {
    CheckHeads(NH, KVH, HS, what);
    AttentionPlan& plan = attention_[{B, T, NH, KVH, HS}];
    if (plan.fused != nullptr || plan.probs.size() > 0) return plan;
    std::string why = cudnn_missing_;
    if (!options_.fused_attention) why = "turned off (CudaOpsOptions)";
    if (why.empty()) {
      try {
        plan.fused = std::make_unique<CudnnAttention>(cudnn_, allocator_, B, T, NH, KVH, HS);
        return plan;
      } catch (const CudnnRefused& refused) {
        why = refused.what();
      }
    }
    if (!warned_about_scores_) {
      warned_about_scores_ = true;
      std::fprintf(stderr,
                   "meshtrain: cuDNN fused attention is not used for %s (%s); attention runs on cuBLASLt and "
                   "softmax kernels and keeps its (B,NH,T,T) probabilities\n",
                   AttentionShape(B, T, NH, KVH, HS).c_str(), why.c_str());
    }
    plan.probs = DeviceArray<bf16>(allocator_, int64_t(B) * NH * T * T, MemoryCategory::kActivations);
    return plan;
  }

  // Element offsets of a product's A, B and D.
  struct Offsets {
    int64_t a = 0, b = 0, d = 0;
  };

  // The scores path's products: for each sequence, and for each position j in a group of
  // query heads (h = g * group + j), one product strided-batched over the KVH key/value
  // heads g. `gemm` describes sequence 0 and position 0; `sequence` and `position` say how
  // far A, B and D move for the next of each. With `accumulate`, the positions after the
  // first add into D (beta 1, D in fp32): the group's sum, in the order of j.
  void HeadProducts(Gemm gemm, int B, int group, Offsets sequence, Offsets position, bool accumulate,
                    const char* what, cudaStream_t stream) {
    const auto* a = static_cast<const bf16*>(gemm.a);
    const auto* b = static_cast<const bf16*>(gemm.b);
    auto* d = static_cast<std::byte*>(gemm.d);
    const int64_t d_bytes = gemm.d_type == CUDA_R_32F ? 4 : 2;
    for (int s = 0; s < B; ++s) {
      for (int j = 0; j < group; ++j) {
        gemm.a = a + s * sequence.a + j * position.a;
        gemm.b = b + s * sequence.b + j * position.b;
        gemm.d = d + (s * sequence.d + j * position.d) * d_bytes;
        gemm.beta = accumulate && j > 0 ? 1.0f : 0.0f;
        RunOrThrow(gemm, what, stream);
      }
    }
  }

  // qkv rows of W = (NH + 2 KVH) HS channels: q head h at h HS, k head g at Q + g HS and v
  // head g at Q + (KVH + g) HS, Q = NH HS; out rows of Q channels. Query head h = g group
  // + j reads key/value head g.
  //
  // probs (state, B,NH,T,T) = causal softmax(scale q k^T), then out = P v, head by head.
  void ScoresForward(AttentionPlan& plan, bf16* out, float* probs, const bf16* qkv, int B, int T, int NH, int KVH,
                     int HS, cudaStream_t stream) {
    const int group = NH / KVH;
    const int64_t W = int64_t(NH + 2 * KVH) * HS, Q = int64_t(NH) * HS, TT = int64_t(T) * T;
    bf16* probs_bf16 = Raw(plan.probs.get());
    const bf16 *q = qkv, *k = qkv + Q, *v = qkv + Q + int64_t(KVH) * HS;
    // S^T (T,T) = K (T,HS) Q^T: A = k stored (HS,T), transposed; B = q stored (HS,T).
    const Gemm scores{.transpose_a = true, .m = T, .n = T, .k = HS, .a = k, .lda = W, .stride_a = HS, .b = q,
                      .ldb = W, .stride_b = group * HS, .d = probs, .d_type = CUDA_R_32F, .ldd = T,
                      .stride_d = group * TT, .batch = KVH, .alpha = 1.0f / std::sqrt(float(HS))};
    HeadProducts(scores, B, group, {T * W, T * W, NH * TT}, {0, HS, TT}, false, "AttentionForward (scores)", stream);
    CausalSoftmaxForward(probs, probs_bf16, int64_t(B) * NH * T, T, stream);
    // out^T (HS,T) = V^T (HS,T) P^T: A = v stored (HS,T); B = P stored (T,T).
    const Gemm values{.m = HS, .n = T, .k = T, .a = v, .lda = W, .stride_a = HS, .b = probs_bf16, .ldb = T,
                      .stride_b = group * TT, .d = out, .ldd = Q, .stride_d = group * HS, .batch = KVH};
    HeadProducts(values, B, group, {T * W, NH * TT, T * Q}, {0, TT, HS}, false, "AttentionForward (values)", stream);
  }

  // dK and dV of a group's key/value head sum its query heads': written straight into dqkv
  // when each has one (KVH = NH), else summed in fp32 scratch and then stored.
  void ScoresBackward(bf16* dqkv, std::byte* scratch_bytes, const bf16* dout, const bf16* qkv, const float* probs,
                      int B, int T, int NH, int KVH, int HS, cudaStream_t stream) {
    const int group = NH / KVH;
    const int64_t W = int64_t(NH + 2 * KVH) * HS, Q = int64_t(NH) * HS, TT = int64_t(T) * T;
    const ScoresScratch scratch(scratch_bytes, B, T, NH);
    const bf16 *q = qkv, *k = qkv + Q, *v = qkv + Q + int64_t(KVH) * HS;
    // dK and dV: into dqkv (rows of W), or into the fp32 sums (rows of 2 KVH HS).
    const bool summed = group > 1;
    void* dk_at = summed ? static_cast<void*>(scratch.key_value) : static_cast<void*>(dqkv + Q);
    void* dv_at = summed ? static_cast<void*>(scratch.key_value + int64_t(KVH) * HS)
                         : static_cast<void*>(dqkv + Q + int64_t(KVH) * HS);
    const cudaDataType kv_type = summed ? CUDA_R_32F : CUDA_R_16BF;
    const int64_t kv_ld = summed ? 2 * int64_t(KVH) * HS : W;
    // dP^T (T,T) = V (T,HS) dO^T: A = v stored (HS,T), transposed; B = dout stored (HS,T).
    const Gemm dprobs{.transpose_a = true, .m = T, .n = T, .k = HS, .a = v, .lda = W, .stride_a = HS, .b = dout,
                      .ldb = Q, .stride_b = group * HS, .d = scratch.dprobs, .d_type = CUDA_R_32F, .ldd = T,
                      .stride_d = group * TT, .batch = KVH};
    HeadProducts(dprobs, B, group, {T * W, T * Q, NH * TT}, {0, HS, TT}, false, "AttentionBackward (dP)", stream);
    CausalSoftmaxBackward(scratch.dscores, scratch.probs, scratch.dprobs, probs, int64_t(B) * NH * T, T,
                          1.0f / std::sqrt(float(HS)), stream);
    // dV^T (HS,T) += dO^T (HS,T) P: A = dout stored (HS,T); B = P stored (T,T), transposed.
    const Gemm dv{.transpose_b = true, .m = HS, .n = T, .k = T, .a = dout, .lda = Q, .stride_a = group * HS,
                  .b = scratch.probs, .ldb = T, .stride_b = group * TT, .d = dv_at, .d_type = kv_type, .ldd = kv_ld,
                  .stride_d = HS, .batch = KVH};
    HeadProducts(dv, B, group, {T * Q, NH * TT, T * kv_ld}, {HS, TT, 0}, summed, "AttentionBackward (dV)", stream);
    // dQ^T (HS,T) = K^T (HS,T) dS^T: A = k stored (HS,T); B = dS stored (T,T).
    const Gemm dq{.m = HS, .n = T, .k = T, .a = k, .lda = W, .stride_a = HS, .b = scratch.dscores, .ldb = T,
                  .stride_b = group * TT, .d = dqkv, .ldd = W, .stride_d = group * HS, .batch = KVH};
    HeadProducts(dq, B, group, {T * W, NH * TT, T * W}, {0, TT, HS}, false, "AttentionBackward (dQ)", stream);
    // dK^T (HS,T) += Q^T (HS,T) dS: A = q stored (HS,T); B = dS stored (T,T), transposed.
    const Gemm dk{.transpose_b = true, .m = HS, .n = T, .k = T, .a = q, .lda = W, .stride_a = group * HS,
                  .b = scratch.dscores, .ldb = T, .stride_b = group * TT, .d = dk_at, .d_type = kv_type, .ldd = kv_ld,
                  .stride_d = HS, .batch = KVH};
    HeadProducts(dk, B, group, {T * W, NH * TT, T * kv_ld}, {HS, TT, 0}, summed, "AttentionBackward (dK)", stream);
    if (summed) StoreRows(dqkv + Q, W, scratch.key_value, int64_t(B) * T, int(2 * KVH * HS), stream);
  }

  CachingAllocator* allocator_;
  CudaOpsOptions options_;
  int multiprocessors_ = 0;
  std::unique_ptr<BlasLt> blas_;
  std::unique_ptr<GroupedGemm> grouped_;          // the experts' products, in BlasLt's workspace
  std::vector<GroupedProblem> grouped_problems_;  // GroupedMatmul's, kept from call to call
  cudnnHandle_t cudnn_ = nullptr;
  std::string cudnn_missing_;  // why there is no cuDNN handle; empty when there is one
  std::map<std::tuple<int, int, int, int, int>, AttentionPlan> attention_;  // by (B, T, NH, KVH, HS)
  bool warned_about_scores_ = false;
  bool said_bias_gradient_apart_ = false;  // once a table
  DeviceArray<float> layernorm_partials_, bias_partials_;
  DeviceArray<double> norm_partials_;
  DeviceArray<std::byte> encoder_scratch_;
  DeviceArray<int32_t> moe_plan_scratch_;  // MoePermutePlan's per-chunk counts
  std::string float8_refusal_;  // why this device takes no float8 products; empty when it does
  DeviceArray<std::byte> float8_scratch_;  // the float8 products' codes and fp32 sums (CastFloat8Operands)
};

}  // namespace

std::unique_ptr<Ops<Bf16>> MakeCudaOps(runtime::Backend& backend, runtime::CachingAllocator* allocator) {
  return std::make_unique<CudaOps>(backend, allocator, CudaOpsOptions{});
}

std::unique_ptr<Ops<Bf16>> MakeCudaOpsWith(runtime::Backend& backend, runtime::CachingAllocator* allocator,
                                           const CudaOpsOptions& options) {
  return std::make_unique<CudaOps>(backend, allocator, options);
}

}  // namespace meshtrain::kernels::cuda
