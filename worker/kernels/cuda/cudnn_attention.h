// Causal self-attention through cuDNN's fused scaled-dot-product attention (flash
// attention), built with cuDNN's graph (backend) API for the bf16 table (cuda_ops.h).
//
// One object holds the forward and backward execution plans of one shape (B, T, NH, KVH,
// HS): q (NH heads), k and v (KVH heads each) are strided views of qkv
// (B,T,(NH+2*KVH)*HS), read where they lie; the output and the gradients are written in
// place in (B,T,NH*HS) and (B,T,(NH+2*KVH)*HS), the mask is causal, the scale
// 1/sqrt(HS), and the forward keeps one fp32 softmax statistic per row,
// log(sum(exp(s - max))) + max, as the state (B,NH,T) its backward reads. No (T,T)
// scores are stored.
//
// Grouped-query attention (KVH < NH) as cudnn-frontend's SDPA nodes build it
// (include/cudnn_frontend/node/scaled_dot_product_flash_attention.h): K and V are
// declared with KVH heads and the products broadcast them over each group of NH / KVH
// query heads (query head h reads key/value head h / (NH / KVH)); the backward's dK and
// dV products give a virtual full-head gradient (B,NH,T,HS) that a reduction (ADD) over
// each group writes into the KVH heads of dqkv. No K, V or their gradients are repeated
// in memory.
//
// Building throws CudnnRefused, with cuDNN's words, when cuDNN does not take the graph
// (an old GPU, a head size it has no kernel for); the table then runs its scores path.
// Building allocates the forward's workspace; the backward's comes from the caller
// (BackwardScratchBytes). Running allocates nothing and never synchronizes the host.
// Internal to kernels/cuda. Thread-safety: one host thread at a time; the work follows
// its stream, and forward calls share the forward workspace, so they run in stream order.

#pragma once

#include <cudnn_graph.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>

#include "worker/runtime/memory.h"

namespace meshtrain::kernels::cuda {

class CudnnRefused : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class CudnnAttention {
 public:
  // Throws CudnnRefused when cuDNN does not take the shape; runtime::cuda::CudaError when
  // something else fails.
  CudnnAttention(cudnnHandle_t handle, runtime::CachingAllocator* allocator, int B, int T, int NH, int KVH, int HS);
  ~CudnnAttention();
  CudnnAttention(const CudnnAttention&) = delete;
  CudnnAttention& operator=(const CudnnAttention&) = delete;

  int64_t BackwardScratchBytes() const;

  // out (B,T,NH*HS), stats (B,NH,T) from qkv (B,T,(NH+2*KVH)*HS); bf16 tensors.
  void Forward(void* out, float* stats, const void* qkv, cudaStream_t stream);
  // dqkv (B,T,(NH+2*KVH)*HS) from dout (B,T,NH*HS); scratch: BackwardScratchBytes.
  void Backward(void* dqkv, std::byte* scratch, const void* dout, const void* qkv, const void* out,
                const float* stats, cudaStream_t stream);

 private:
  struct Plan;

  std::string Shape() const;

  cudnnHandle_t handle_;
  int B_, T_, NH_, KVH_, HS_;
  std::unique_ptr<Plan> forward_, backward_;
  struct Buffers;
  std::unique_ptr<Buffers> buffers_;  // the forward's workspace, the sequence lengths
  // Values the graphs take by value; they live as long as the plans that read them.
  float scale_, negative_infinity_, one_ = 1.0f;
};

}  // namespace meshtrain::kernels::cuda
