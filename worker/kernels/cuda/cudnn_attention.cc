#include "api/engine_memory.h"
#include "worker/kernels/cuda/cudnn_attention.h"

#include <array>
#include <cmath>
#include <deque>
#include <limits>
#include <map>
#include <utility>
#include <vector>

#include "worker/runtime/cuda.h"
#include "worker/runtime/device_memory.h"
#include "worker/runtime/device_side.h"

namespace meshtrain::kernels::cuda {
namespace {

using Dims = std::array<int64_t, 4>;

std::string LastCudnnError() {
  char message[1024] = {};
  cudnnGetLastErrorString(message, sizeof(message));
  return message;
}

// While a graph is being built, a failure is cuDNN refusing it.
void Refuse(cudnnStatus_t status, const char* call) {
  if (status == CUDNN_STATUS_SUCCESS) return;
  const std::string detail = LastCudnnError();
  throw CudnnRefused(std::string(call) + ": " + cudnnGetErrorString(status) + (detail.empty() ? "" : ": " + detail));
}

// An owned backend descriptor.
class Descriptor {
 public:
  explicit Descriptor(cudnnBackendDescriptorType_t type) {
    Refuse(cudnnBackendCreateDescriptor(type, &descriptor_), "cudnnBackendCreateDescriptor");
  }
  Descriptor(Descriptor&& other) noexcept : descriptor_(std::exchange(other.descriptor_, nullptr)) {}
  Descriptor& operator=(Descriptor&&) = delete;
  Descriptor(const Descriptor&) = delete;
  ~Descriptor() {
    if (descriptor_ != nullptr) cudnnBackendDestroyDescriptor(descriptor_);
  }
  cudnnBackendDescriptor_t get() const { return descriptor_; }

  template <class T>
  void Set(cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, int64_t count, const T* values) {
    Refuse(cudnnBackendSetAttribute(descriptor_, name, type, count, values), "cudnnBackendSetAttribute");
  }
  void Set(cudnnBackendAttributeName_t name, cudnnBackendDescriptor_t value) {
    Set(name, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &value);
  }
  void Finalize(const char* what) { Refuse(cudnnBackendFinalize(descriptor_), what); }

 private:
  cudnnBackendDescriptor_t descriptor_ = nullptr;
};

// The tensors every graph names, by unique id; virtual tensors take ids from kFirstVirtual.
enum Uid : int64_t {
  kQ = 1, kK, kV, kO, kStats, kScale, kNegativeInfinity, kOne, kDO, kDQ, kDK, kDV, kSoftmaxSum, kDQAccumulator,
  kSequenceQ, kSequenceKV, kFirstVirtual = 100
};

// A graph under construction: every descriptor it makes lives as long as it does.
class Graph {
 public:
  explicit Graph(cudnnHandle_t handle) : handle_(handle) {}

  cudnnBackendDescriptor_t Tensor(int64_t uid, cudnnDataType_t type, const Dims& dims, const Dims& strides,
                                  bool is_virtual = false, bool by_value = false) {
    Descriptor& tensor = Keep(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
    const int64_t alignment = 16;
    tensor.Set(CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid);
    tensor.Set(CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &type);
    tensor.Set(CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, dims.data());
    tensor.Set(CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, strides.data());
    tensor.Set(CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &alignment);
    tensor.Set(CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &is_virtual);
    if (by_value) tensor.Set(CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &by_value);
    tensor.Finalize("cudnnBackendFinalize(tensor)");
    return tensor.get();
  }
  cudnnBackendDescriptor_t Virtual(cudnnDataType_t type, const Dims& dims, const Dims& strides) {
    return Tensor(next_virtual_++, type, dims, strides, true);
  }
  // A float the execution passes by value; one descriptor per uid, shared by its uses.
  cudnnBackendDescriptor_t Scalar(int64_t uid) {
    cudnnBackendDescriptor_t& scalar = scalars_[uid];
    if (scalar == nullptr) scalar = Tensor(uid, CUDNN_DATA_FLOAT, {1, 1, 1, 1}, {1, 1, 1, 1}, false, true);
    return scalar;
  }

  // y = mode(x, b) with t for BINARY_SELECT (y = t ? x : b), axis for GEN_INDEX.
  void Pointwise(cudnnPointwiseMode_t mode, cudnnDataType_t math, cudnnBackendDescriptor_t x,
                 cudnnBackendDescriptor_t b, cudnnBackendDescriptor_t t, cudnnBackendDescriptor_t y,
                 int64_t axis = -1) {
    Descriptor& pointwise = Keep(CUDNN_BACKEND_POINTWISE_DESCRIPTOR);
    pointwise.Set(CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode);
    pointwise.Set(CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &math);
    if (axis >= 0) pointwise.Set(CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, 1, &axis);
    pointwise.Finalize("cudnnBackendFinalize(pointwise)");
    Descriptor& operation = Keep(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR);
    operation.Set(CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, pointwise.get());
    operation.Set(CUDNN_ATTR_OPERATION_POINTWISE_XDESC, x);
    if (b != nullptr) operation.Set(CUDNN_ATTR_OPERATION_POINTWISE_BDESC, b);
    if (t != nullptr) operation.Set(CUDNN_ATTR_OPERATION_POINTWISE_TDESC, t);
    operation.Set(CUDNN_ATTR_OPERATION_POINTWISE_YDESC, y);
    const float one = 1.0f;
    operation.Set(CUDNN_ATTR_OPERATION_POINTWISE_ALPHA1, CUDNN_TYPE_FLOAT, 1, &one);
    operation.Set(CUDNN_ATTR_OPERATION_POINTWISE_ALPHA2, CUDNN_TYPE_FLOAT, 1, &one);
    operation.Finalize("cudnnBackendFinalize(pointwise operation)");
    operations_.push_back(operation.get());
  }

  // c = a @ b over the last two dimensions; the overrides bound the sequence lengths.
  void Matmul(cudnnBackendDescriptor_t a, cudnnBackendDescriptor_t b, cudnnBackendDescriptor_t c,
              cudnnBackendDescriptor_t m_override = nullptr, cudnnBackendDescriptor_t n_override = nullptr,
              cudnnBackendDescriptor_t k_override = nullptr) {
    Descriptor& matmul = Keep(CUDNN_BACKEND_MATMUL_DESCRIPTOR);
    const cudnnDataType_t compute = CUDNN_DATA_FLOAT;
    matmul.Set(CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &compute);
    matmul.Finalize("cudnnBackendFinalize(matmul)");
    Descriptor& operation = Keep(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR);
    operation.Set(CUDNN_ATTR_OPERATION_MATMUL_ADESC, a);
    operation.Set(CUDNN_ATTR_OPERATION_MATMUL_BDESC, b);
    operation.Set(CUDNN_ATTR_OPERATION_MATMUL_CDESC, c);
    operation.Set(CUDNN_ATTR_OPERATION_MATMUL_DESC, matmul.get());
    if (m_override != nullptr) operation.Set(CUDNN_ATTR_OPERATION_MATMUL_GEMM_M_OVERRIDE_DESC, m_override);
    if (n_override != nullptr) operation.Set(CUDNN_ATTR_OPERATION_MATMUL_GEMM_N_OVERRIDE_DESC, n_override);
    if (k_override != nullptr) operation.Set(CUDNN_ATTR_OPERATION_MATMUL_GEMM_K_OVERRIDE_DESC, k_override);
    operation.Finalize("cudnnBackendFinalize(matmul operation)");
    operations_.push_back(operation.get());
  }

  void Reduction(cudnnReduceTensorOp_t mode, cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y) {
    Descriptor& reduction = Keep(CUDNN_BACKEND_REDUCTION_DESCRIPTOR);
    const cudnnDataType_t compute = CUDNN_DATA_FLOAT;
    reduction.Set(CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &mode);
    reduction.Set(CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &compute);
    reduction.Finalize("cudnnBackendFinalize(reduction)");
    Descriptor& operation = Keep(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR);
    operation.Set(CUDNN_ATTR_OPERATION_REDUCTION_XDESC, x);
    operation.Set(CUDNN_ATTR_OPERATION_REDUCTION_YDESC, y);
    operation.Set(CUDNN_ATTR_OPERATION_REDUCTION_DESC, reduction.get());
    operation.Finalize("cudnnBackendFinalize(reduction operation)");
    operations_.push_back(operation.get());
  }

  // y: the same elements as x under other dimensions and strides (a transposed view).
  void Reshape(cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y) {
    Descriptor& operation = Keep(CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR);
    operation.Set(CUDNN_ATTR_OPERATION_RESHAPE_XDESC, x);
    operation.Set(CUDNN_ATTR_OPERATION_RESHAPE_YDESC, y);
    operation.Finalize("cudnnBackendFinalize(reshape operation)");
    operations_.push_back(operation.get());
  }

  // The operation graph, the first engine configuration cuDNN's heuristics offer that
  // finalizes into an execution plan, and that plan's workspace.
  void Build(const char* which) {
    Descriptor& graph = Keep(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
    graph.Set(CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, int64_t(operations_.size()),
              operations_.data());
    graph.Set(CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle_);
    graph.Finalize(which);
    for (const cudnnBackendHeurMode_t mode : {CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_FALLBACK}) {
      Descriptor heuristics(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR);
      heuristics.Set(CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, graph.get());
      heuristics.Set(CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode);
      if (cudnnBackendFinalize(heuristics.get()) != CUDNN_STATUS_SUCCESS) continue;
      int64_t count = 0;
      if (cudnnBackendGetAttribute(heuristics.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, 0,
                                   &count, nullptr) != CUDNN_STATUS_SUCCESS ||
          count == 0) {
        continue;
      }
      std::vector<Descriptor> configurations;
      std::vector<cudnnBackendDescriptor_t> raw;
      for (int64_t i = 0; i < count; ++i) {
        configurations.emplace_back(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR);
        raw.push_back(configurations.back().get());
      }
      Refuse(cudnnBackendGetAttribute(heuristics.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR,
                                      count, &count, raw.data()),
             "cudnnBackendGetAttribute(engine heuristics)");
      for (int64_t i = 0; i < count; ++i) {
        Descriptor plan(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
        plan.Set(CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle_);
        plan.Set(CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, raw[size_t(i)]);
        if (cudnnBackendFinalize(plan.get()) != CUDNN_STATUS_SUCCESS) continue;
        int64_t found = 0;
        Refuse(cudnnBackendGetAttribute(plan.get(), CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1,
                                        &found, &workspace_bytes_),
               "cudnnBackendGetAttribute(workspace size)");
        descriptors_.push_back(std::move(configurations[size_t(i)]));
        descriptors_.push_back(std::move(plan));
        plan_ = descriptors_.back().get();
        return;
      }
    }
    throw CudnnRefused(std::string(which) + ": no engine of cuDNN " + std::to_string(cudnnGetVersion()) +
                       " takes the graph" + (LastCudnnError().empty() ? "" : " (" + LastCudnnError() + ")"));
  }

  cudnnBackendDescriptor_t plan() const { return plan_; }
  int64_t workspace_bytes() const { return workspace_bytes_; }

 private:
  Descriptor& Keep(cudnnBackendDescriptorType_t type) {
    descriptors_.emplace_back(type);
    return descriptors_.back();
  }

  cudnnHandle_t handle_;
  std::deque<Descriptor> descriptors_;  // a deque: references to them stay valid
  std::map<int64_t, cudnnBackendDescriptor_t> scalars_;
  std::vector<cudnnBackendDescriptor_t> operations_;
  int64_t next_virtual_ = kFirstVirtual;
  cudnnBackendDescriptor_t plan_ = nullptr;
  int64_t workspace_bytes_ = 0;
};

constexpr int64_t kAlignment = 256;
int64_t AlignUp(int64_t bytes) { return (bytes + kAlignment - 1) / kAlignment * kAlignment; }

}  // namespace

struct CudnnAttention::Plan {
  explicit Plan(cudnnHandle_t handle) : graph(handle) {}
  Graph graph;
};

struct CudnnAttention::Buffers {
  runtime::DeviceArray<std::byte> forward_workspace;
  runtime::DeviceArray<int32_t> sequence_lengths;  // B copies of T, for the padding mask
};

CudnnAttention::CudnnAttention(cudnnHandle_t handle, runtime::CachingAllocator* allocator, int B, int T, int NH,
                               int KVH, int HS)
    : handle_(handle),
      B_(B),
      T_(T),
      NH_(NH),
      KVH_(KVH),
      HS_(HS),
      buffers_(std::make_unique<Buffers>()),
      scale_(1.0f / std::sqrt(float(HS))),
      negative_infinity_(-std::numeric_limits<float>::infinity()) {
  if (HS % 8 != 0 || HS > 256) {
    throw CudnnRefused("the head size " + std::to_string(HS) + " is not a multiple of 8 up to 256");
  }
  const int64_t b = B, h = NH, hk = KVH, s = T, d = HS;
  // Rows of qkv hold W channels: q head i at i*HS, k head g at Q + g*HS and v head g at
  // Q + (KVH + g)*HS, Q = NH*HS (the pointers of k and v start at their first head); out
  // and dout rows hold Q.
  const int64_t W = (h + 2 * hk) * d, Q = h * d;
  const Dims q_dims = {b, h, s, d}, kv_dims = {b, hk, s, d}, row_major_strides = {s * W, d, W, 1};
  const Dims transposed_kv_dims = {b, hk, d, s}, transposed_strides = {s * W, d, 1, W};
  const Dims out_strides = {s * Q, d, Q, 1};
  const Dims full_head_strides = {h * s * d, s * d, d, 1};
  const bool grouped = hk != h;
  const Dims scores_dims = {b, h, s, s}, scores_strides = {h * s * s, s * s, s, 1};
  const Dims transposed_scores_strides = {h * s * s, s * s, 1, s};
  const Dims row_dims = {b, h, s, 1}, row_strides = {h * s, s, 1, 1};
  const cudnnDataType_t kBf16 = CUDNN_DATA_BFLOAT16, kFloat = CUDNN_DATA_FLOAT;

  // The causal mask: scores above the diagonal become -infinity.
  auto causal = [&](Graph& g, cudnnBackendDescriptor_t scores) {
    cudnnBackendDescriptor_t row = g.Virtual(CUDNN_DATA_INT32, scores_dims, scores_strides);
    cudnnBackendDescriptor_t column = g.Virtual(CUDNN_DATA_INT32, scores_dims, scores_strides);
    g.Pointwise(CUDNN_POINTWISE_GEN_INDEX, kFloat, scores, nullptr, nullptr, row, 2);
    g.Pointwise(CUDNN_POINTWISE_GEN_INDEX, kFloat, scores, nullptr, nullptr, column, 3);
    cudnnBackendDescriptor_t keep = g.Virtual(CUDNN_DATA_BOOLEAN, scores_dims, scores_strides);
    g.Pointwise(CUDNN_POINTWISE_CMP_GE, CUDNN_DATA_BOOLEAN, row, column, nullptr, keep);
    cudnnBackendDescriptor_t masked = g.Virtual(kFloat, scores_dims, scores_strides);
    g.Pointwise(CUDNN_POINTWISE_BINARY_SELECT, kFloat, scores, g.Scalar(kNegativeInfinity), keep, masked);
    return masked;
  };

  // Forward: S = scale Q K^T, causal, P = softmax(S) with stats = max + log(sum), O = P V.
  {
    forward_ = std::make_unique<Plan>(handle);
    Graph& g = forward_->graph;
    // K and V with KVH heads: the products broadcast each over its group of query heads.
    cudnnBackendDescriptor_t q = g.Tensor(kQ, kBf16, q_dims, row_major_strides);
    cudnnBackendDescriptor_t k = g.Tensor(kK, kBf16, transposed_kv_dims, transposed_strides);
    cudnnBackendDescriptor_t v = g.Tensor(kV, kBf16, kv_dims, row_major_strides);
    cudnnBackendDescriptor_t o = g.Tensor(kO, kBf16, q_dims, out_strides);
    cudnnBackendDescriptor_t stats = g.Tensor(kStats, kFloat, row_dims, row_strides);
    cudnnBackendDescriptor_t products = g.Virtual(kFloat, scores_dims, scores_strides);
    g.Matmul(q, k, products);
    cudnnBackendDescriptor_t scores = g.Virtual(kFloat, scores_dims, scores_strides);
    g.Pointwise(CUDNN_POINTWISE_MUL, kFloat, products, g.Scalar(kScale), nullptr, scores);
    cudnnBackendDescriptor_t masked = causal(g, scores);
    cudnnBackendDescriptor_t max = g.Virtual(kFloat, row_dims, row_strides);
    g.Reduction(CUDNN_REDUCE_TENSOR_MAX, masked, max);
    cudnnBackendDescriptor_t shifted = g.Virtual(kFloat, scores_dims, scores_strides);
    g.Pointwise(CUDNN_POINTWISE_SUB, kFloat, masked, max, nullptr, shifted);
    cudnnBackendDescriptor_t exponentials = g.Virtual(kFloat, scores_dims, scores_strides);
    g.Pointwise(CUDNN_POINTWISE_EXP, kFloat, shifted, nullptr, nullptr, exponentials);
    cudnnBackendDescriptor_t sum = g.Virtual(kFloat, row_dims, row_strides);
    g.Reduction(CUDNN_REDUCE_TENSOR_ADD, exponentials, sum);
    cudnnBackendDescriptor_t log_sum = g.Virtual(kFloat, row_dims, row_strides);
    g.Pointwise(CUDNN_POINTWISE_LOG, kFloat, sum, nullptr, nullptr, log_sum);
    g.Pointwise(CUDNN_POINTWISE_ADD, kFloat, max, log_sum, nullptr, stats);
    cudnnBackendDescriptor_t probabilities = g.Virtual(kBf16, scores_dims, scores_strides);
    g.Pointwise(CUDNN_POINTWISE_DIV, kFloat, exponentials, sum, nullptr, probabilities);
    g.Matmul(probabilities, v, o);
    g.Build("the attention forward graph");
  }

  // cuDNN up to 9.15 needs a padding mask in the backward when T is not a multiple of its
  // tile (128), as cudnn-frontend adds; with every length T it masks nothing.
  const bool padding_mask = T % 128 != 0 && cudnnGetVersion() <= 91500;
  if (padding_mask) {
    buffers_->sequence_lengths = runtime::DeviceArray<int32_t>(allocator, B, runtime::MemoryCategory::kActivations);
    const std::vector<int32_t> lengths(size_t(B), T);
    runtime::cuda::Check(cudaMemcpy(runtime::DeviceSide::Address(buffers_->sequence_lengths.get()), lengths.data(),
                                    lengths.size() * sizeof(int32_t), cudaMemcpyHostToDevice),
                         "cudaMemcpy (attention sequence lengths, " + Shape() + ")");
  }

  // Backward, as flash attention's: P is recomputed from the stats, never stored.
  {
    backward_ = std::make_unique<Plan>(handle);
    Graph& g = backward_->graph;
    cudnnBackendDescriptor_t q = g.Tensor(kQ, kBf16, q_dims, row_major_strides);
    cudnnBackendDescriptor_t k = g.Tensor(kK, kBf16, transposed_kv_dims, transposed_strides);
    cudnnBackendDescriptor_t v = g.Tensor(kV, kBf16, transposed_kv_dims, transposed_strides);
    cudnnBackendDescriptor_t o = g.Tensor(kO, kBf16, q_dims, out_strides);
    cudnnBackendDescriptor_t d_o = g.Tensor(kDO, kBf16, q_dims, out_strides);
    cudnnBackendDescriptor_t stats = g.Tensor(kStats, kFloat, row_dims, row_strides);
    cudnnBackendDescriptor_t d_q = g.Tensor(kDQ, kBf16, q_dims, row_major_strides);
    cudnnBackendDescriptor_t d_k = g.Tensor(kDK, kBf16, kv_dims, row_major_strides);
    cudnnBackendDescriptor_t d_v = g.Tensor(kDV, kBf16, kv_dims, row_major_strides);
    cudnnBackendDescriptor_t softmax_sum = g.Tensor(kSoftmaxSum, kFloat, row_dims, row_strides);
    cudnnBackendDescriptor_t d_q_accumulator = g.Tensor(kDQAccumulator, kFloat, q_dims, full_head_strides);
    cudnnBackendDescriptor_t sequence_q = nullptr, sequence_kv = nullptr;
    if (padding_mask) {
      sequence_q = g.Tensor(kSequenceQ, CUDNN_DATA_INT32, {b, 1, 1, 1}, {1, 1, 1, 1});
      sequence_kv = g.Tensor(kSequenceKV, CUDNN_DATA_INT32, {b, 1, 1, 1}, {1, 1, 1, 1});
    }

    // softmax_sum = rowsum(dO * O)
    cudnnBackendDescriptor_t d_o_o = g.Virtual(kFloat, q_dims, {h * s * d, s * d, h * d, 1});
    g.Pointwise(CUDNN_POINTWISE_MUL, kFloat, d_o, o, nullptr, d_o_o);
    cudnnBackendDescriptor_t row_sum = g.Virtual(kFloat, row_dims, row_strides);
    g.Reduction(CUDNN_REDUCE_TENSOR_ADD, d_o_o, row_sum);
    g.Pointwise(CUDNN_POINTWISE_MUL, kFloat, row_sum, g.Scalar(kOne), nullptr, softmax_sum);

    // P = exp(scale Q K^T - stats), causal
    cudnnBackendDescriptor_t products = g.Virtual(kFloat, scores_dims, scores_strides);
    g.Matmul(q, k, products, sequence_q, sequence_kv);
    cudnnBackendDescriptor_t scores = g.Virtual(kFloat, scores_dims, scores_strides);
    g.Pointwise(CUDNN_POINTWISE_MUL, kFloat, products, g.Scalar(kScale), nullptr, scores);
    if (padding_mask) {
      cudnnBackendDescriptor_t row = g.Virtual(CUDNN_DATA_INT32, scores_dims, scores_strides);
      cudnnBackendDescriptor_t column = g.Virtual(CUDNN_DATA_INT32, scores_dims, scores_strides);
      g.Pointwise(CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_INT32, scores, nullptr, nullptr, row, 2);
      g.Pointwise(CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_INT32, scores, nullptr, nullptr, column, 3);
      cudnnBackendDescriptor_t row_in = g.Virtual(CUDNN_DATA_BOOLEAN, scores_dims, scores_strides);
      cudnnBackendDescriptor_t column_in = g.Virtual(CUDNN_DATA_BOOLEAN, scores_dims, scores_strides);
      g.Pointwise(CUDNN_POINTWISE_CMP_LT, CUDNN_DATA_BOOLEAN, row, sequence_q, nullptr, row_in);
      g.Pointwise(CUDNN_POINTWISE_CMP_LT, CUDNN_DATA_BOOLEAN, column, sequence_kv, nullptr, column_in);
      cudnnBackendDescriptor_t inside = g.Virtual(CUDNN_DATA_BOOLEAN, scores_dims, scores_strides);
      g.Pointwise(CUDNN_POINTWISE_LOGICAL_AND, CUDNN_DATA_BOOLEAN, row_in, column_in, nullptr, inside);
      cudnnBackendDescriptor_t padded = g.Virtual(kFloat, scores_dims, scores_strides);
      g.Pointwise(CUDNN_POINTWISE_BINARY_SELECT, kFloat, scores, g.Scalar(kNegativeInfinity), inside, padded);
      scores = padded;
    }
    cudnnBackendDescriptor_t shifted = g.Virtual(kFloat, scores_dims, scores_strides);
    g.Pointwise(CUDNN_POINTWISE_SUB, kFloat, scores, stats, nullptr, shifted);
    cudnnBackendDescriptor_t masked = causal(g, shifted);
    cudnnBackendDescriptor_t probabilities = g.Virtual(kFloat, scores_dims, scores_strides);
    g.Pointwise(CUDNN_POINTWISE_EXP, kFloat, masked, nullptr, nullptr, probabilities);

    // With groups, dK and dV are products per query head (a virtual full-head gradient,
    // bf16 as cudnn-frontend declares it), reduced (ADD) over each group into their KVH
    // heads; without, the products write them.
    auto key_value_gradient = [&](cudnnBackendDescriptor_t a, cudnnBackendDescriptor_t b_operand,
                                  cudnnBackendDescriptor_t gradient) {
      if (!grouped) {
        g.Matmul(a, b_operand, gradient, sequence_kv, nullptr, sequence_q);
        return;
      }
      cudnnBackendDescriptor_t full_head = g.Virtual(kBf16, q_dims, full_head_strides);
      g.Matmul(a, b_operand, full_head, sequence_kv, nullptr, sequence_q);
      g.Reduction(CUDNN_REDUCE_TENSOR_ADD, full_head, gradient);
    };

    // dV = P^T dO
    cudnnBackendDescriptor_t probabilities_t = g.Virtual(kBf16, scores_dims, transposed_scores_strides);
    g.Reshape(probabilities, probabilities_t);
    key_value_gradient(probabilities_t, d_o, d_v);

    // dS = scale P (dO V^T - softmax_sum)
    cudnnBackendDescriptor_t d_p = g.Virtual(kFloat, scores_dims, scores_strides);
    g.Matmul(d_o, v, d_p, sequence_q, sequence_kv);
    cudnnBackendDescriptor_t d_p_shifted = g.Virtual(kFloat, scores_dims, scores_strides);
    g.Pointwise(CUDNN_POINTWISE_SUB, kFloat, d_p, softmax_sum, nullptr, d_p_shifted);
    cudnnBackendDescriptor_t d_p_scaled = g.Virtual(kFloat, scores_dims, scores_strides);
    g.Pointwise(CUDNN_POINTWISE_MUL, kFloat, d_p_shifted, probabilities, nullptr, d_p_scaled);
    cudnnBackendDescriptor_t d_s = g.Virtual(kFloat, scores_dims, scores_strides);
    g.Pointwise(CUDNN_POINTWISE_MUL, kFloat, d_p_scaled, g.Scalar(kScale), nullptr, d_s);

    // dK = dS^T Q
    cudnnBackendDescriptor_t d_s_t = g.Virtual(kBf16, scores_dims, transposed_scores_strides);
    g.Reshape(d_s, d_s_t);
    key_value_gradient(d_s_t, q, d_k);

    // dQ = dS K (K broadcast over each group), accumulated in fp32, then stored as bf16
    cudnnBackendDescriptor_t k_rows = g.Virtual(kBf16, kv_dims, row_major_strides);
    g.Reshape(k, k_rows);
    g.Matmul(d_s, k_rows, d_q_accumulator, sequence_q, nullptr, sequence_kv);
    g.Pointwise(CUDNN_POINTWISE_IDENTITY, kFloat, d_q_accumulator, nullptr, nullptr, d_q);
    g.Build("the attention backward graph");
  }

  const int64_t forward_bytes = forward_->graph.workspace_bytes();
  if (forward_bytes > 0) {
    buffers_->forward_workspace =
        runtime::DeviceArray<std::byte>(allocator, forward_bytes, runtime::MemoryCategory::kActivations);
  }
}

CudnnAttention::~CudnnAttention() = default;

std::string CudnnAttention::Shape() const {
  return "B=" + std::to_string(B_) + " T=" + std::to_string(T_) + " NH=" + std::to_string(NH_) +
         " KVH=" + std::to_string(KVH_) + " HS=" + std::to_string(HS_);
}

int64_t CudnnAttention::BackwardScratchBytes() const {
  // softmax_sum, the dQ accumulator, cuDNN's workspace, and room to align the start, as the
  // planner counts them. With groups, the full-head dK and dV are virtual tensors, as
  // cudnn-frontend declares them: whatever memory the plan needs for them is in the
  // workspace size it reports.
  static_assert(kAlignment == api::kCarveAlignment);
  return api::FusedAttentionScratchBytes(B_, T_, NH_, HS_, backward_->graph.workspace_bytes());
}

namespace {

void Execute(cudnnHandle_t handle, cudnnBackendDescriptor_t plan, const std::vector<int64_t>& uids,
             std::vector<void*>& pointers, void* workspace, cudaStream_t stream, const char* what,
             const std::string& shape) {
  auto check = [&](cudnnStatus_t status, const char* call) {
    if (status == CUDNN_STATUS_SUCCESS) return;
    throw runtime::cuda::CudaError(std::string(call) + " for " + what + " (" + shape +
                                   "): " + cudnnGetErrorString(status) + ": " + LastCudnnError());
  };
  check(cudnnSetStream(handle, stream), "cudnnSetStream");
  cudnnBackendDescriptor_t pack = nullptr;
  check(cudnnBackendCreateDescriptor(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, &pack), "cudnnBackendCreateDescriptor");
  struct Destroy {
    cudnnBackendDescriptor_t pack;
    ~Destroy() { cudnnBackendDestroyDescriptor(pack); }
  } destroy{pack};
  check(cudnnBackendSetAttribute(pack, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, int64_t(uids.size()),
                                 uids.data()),
        "cudnnBackendSetAttribute(unique ids)");
  check(cudnnBackendSetAttribute(pack, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR,
                                 int64_t(pointers.size()), pointers.data()),
        "cudnnBackendSetAttribute(data pointers)");
  check(cudnnBackendSetAttribute(pack, CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &workspace),
        "cudnnBackendSetAttribute(workspace)");
  check(cudnnBackendFinalize(pack), "cudnnBackendFinalize(variant pack)");
  check(cudnnBackendExecute(handle, plan, pack), "cudnnBackendExecute");
}

}  // namespace

namespace {

// Byte offsets of k's and v's first heads in a row of qkv (bf16): Q = NH*HS channels,
// then KVH*HS more.
int64_t KeyBytes(int NH, int HS) { return int64_t(NH) * HS * 2; }
int64_t ValueBytes(int NH, int KVH, int HS) { return (int64_t(NH) + KVH) * HS * 2; }

}  // namespace

void CudnnAttention::Forward(void* out, float* stats, const void* qkv, cudaStream_t stream) {
  auto* base = static_cast<std::byte*>(const_cast<void*>(qkv));
  const std::vector<int64_t> uids = {kQ, kK, kV, kO, kStats, kScale, kNegativeInfinity};
  std::vector<void*> pointers = {base, base + KeyBytes(NH_, HS_), base + ValueBytes(NH_, KVH_, HS_), out, stats,
                                 &scale_, &negative_infinity_};
  Execute(handle_, forward_->graph.plan(), uids, pointers,
          runtime::DeviceSide::Address(buffers_->forward_workspace.get()), stream, "AttentionForward", Shape());
}

void CudnnAttention::Backward(void* dqkv, std::byte* scratch, const void* dout, const void* qkv, const void* out,
                              const float* stats, cudaStream_t stream) {
  const int64_t rows = int64_t(B_) * NH_ * T_, key = KeyBytes(NH_, HS_), value = ValueBytes(NH_, KVH_, HS_);
  auto* base = static_cast<std::byte*>(const_cast<void*>(qkv));
  auto* d_base = static_cast<std::byte*>(dqkv);
  auto* start = reinterpret_cast<std::byte*>(AlignUp(int64_t(reinterpret_cast<uintptr_t>(scratch))));
  std::byte* softmax_sum = start;
  std::byte* d_q_accumulator = softmax_sum + AlignUp(rows * 4);
  std::byte* workspace = d_q_accumulator + AlignUp(rows * HS_ * 4);
  if (cudnnGetVersion() < 90600) {  // before 9.6 cuDNN expects the dQ accumulator zeroed
    runtime::cuda::Check(cudaMemsetAsync(d_q_accumulator, 0, size_t(rows) * HS_ * 4, stream),
                         "cudaMemsetAsync (AttentionBackward, " + Shape() + ")");
  }
  std::vector<int64_t> uids = {kQ, kK, kV, kO, kDO, kStats, kDQ, kDK, kDV, kSoftmaxSum, kDQAccumulator, kScale,
                               kNegativeInfinity, kOne};
  std::vector<void*> pointers = {base,
                                 base + key,
                                 base + value,
                                 const_cast<void*>(out),
                                 const_cast<void*>(dout),
                                 const_cast<float*>(stats),
                                 d_base,
                                 d_base + key,
                                 d_base + value,
                                 softmax_sum,
                                 d_q_accumulator,
                                 &scale_,
                                 &negative_infinity_,
                                 &one_};
  if (buffers_->sequence_lengths.size() > 0) {
    int32_t* lengths = runtime::DeviceSide::Address(buffers_->sequence_lengths.get());
    uids.insert(uids.end(), {kSequenceQ, kSequenceKV});
    pointers.insert(pointers.end(), {lengths, lengths});
  }
  Execute(handle_, backward_->graph.plan(), uids, pointers, workspace, stream, "AttentionBackward", Shape());
}

}  // namespace meshtrain::kernels::cuda
