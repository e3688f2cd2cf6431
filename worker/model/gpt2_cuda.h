// GPT-2 on one CUDA device in mixed precision (DESIGN.md, "Mixed precision"): bf16
// parameters and activations, fp32 master weights, gradients and AdamW state. The same
// architecture, parameter layout and initialisation as the CPU Gpt2, so a run can be
// checked against it.
//
// Forward keeps what backward needs; backward walks the layers with a handful of
// reused gradient buffers (llm.c's approach), so activation gradients cost a few
// layers' worth, not the whole model's. All work is enqueued on one stream; Forward,
// GradNorm, Logits and the gradient copies synchronise to return their results.
// Not thread-safe: one model per host thread, on the thread's current device.

#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "worker/kernels/cuda/kernels.h"
#include "worker/model/parameters.h"
#include "worker/runtime/cuda.h"
#include "worker/runtime/memory.h"

namespace meshtrain::model {

class Gpt2Cuda {
 public:
  using bf16 = kernels::cuda::bf16;

  // Sized for micro-batches of at most max_batch x max_seq tokens; parameters from
  // InitParameters(seed). Device memory is counted in `accounting`.
  Gpt2Cuda(const api::ModelShape& shape, int max_batch, int max_seq, uint64_t seed,
           runtime::MemoryAccounting* accounting);

  const ParameterLayout& layout() const { return layout_; }

  // Mean cross-entropy of inputs (B,Tn) against targets (B,Tn), host arrays. Without
  // targets it returns 0 and only the logits are computed (see Logits).
  double Forward(const int32_t* inputs, const int32_t* targets, int B, int Tn);
  // grads += loss_scale * d(mean loss)/d(params) of the last Forward (which needs targets).
  void Backward(float loss_scale);
  void ZeroGrad();
  // The global L2 norm of the gradients.
  double GradNorm();
  // AdamW on the fp32 masters, gradients first clipped to max_norm (0: no clipping),
  // then the bf16 parameters refreshed from them; t counts steps from 1. Weight decay
  // applies to the tensors ParameterLayout marks. Reuses the sum of squares of a
  // GradNorm() on the same gradients rather than computing it again.
  void Update(float lr, float beta1, float beta2, float eps, float weight_decay, float max_norm, int64_t t);

  // Logits (V) at position t of sequence b of the last Forward without targets.
  std::vector<float> Logits(int b, int t);

  // The gradients to and from host memory (layout().total() floats), e.g. to average
  // them over ranks through a host communicator.
  void CopyGradientsTo(float* host);
  void CopyGradientsFrom(const float* host);

  // Host copies, for tests and checkpoints.
  std::vector<float> MasterWeights();
  std::vector<float> Gradients();

 private:
  template <class T>
  T* Take(int64_t n, runtime::MemoryCategory category);
  // scalars_[0] = the sum of squares of the gradients, unless it already holds it.
  void SumSquares();
  bf16* P(Param kind, int layer = -1) { return params_ + layout_.Offset(kind, layer); }
  float* G(Param kind, int layer = -1) { return grads_ + layout_.Offset(kind, layer); }

  ParameterLayout layout_;
  int max_batch_, max_seq_;
  runtime::CachingAllocator allocator_;  // owns every buffer below; they go with the model
  runtime::cuda::Stream stream_{"compute"};
  kernels::cuda::Blas blas_;
  bf16* params_;
  float *master_, *grads_, *m_, *v_, *scalars_;  // scalars_: sum of squares, clip scale
  int32_t *inputs_, *targets_;
  // Kept for backward, per layer l at [l * size of one layer].
  struct Layers {
    bf16 *ln1, *qkv, *qkvr, *att, *atty, *residual2, *ln2, *fch, *fch_gelu, *residual3;
    float *ln1_mean, *ln1_rstd, *ln2_mean, *ln2_rstd;
  } kept_{};
  bf16 *encoded_, *lnf_, *logits_, *scratch_, *heads_;  // scratch_: attproj and fcproj outputs
  float *lnf_mean_, *lnf_rstd_, *losses_;
  // Backward's reused buffers.
  bf16 *dresidual_, *dln_, *datty_, *dqkv_, *dfch_, *dfch_gelu_, *dqkvr_, *datt_, *dy_;
  int B_ = 0, Tn_ = 0;
  bool has_targets_ = false;   // the last Forward had targets: Backward may follow
  bool squares_current_ = false;  // scalars_[0] holds the sum of squares of the current gradients
  std::vector<float> host_losses_;
};

}  // namespace meshtrain::model
