// GPT-2 on the CPU, whole on one device: pre-LayerNorm blocks, learned positions, GELU
// MLP, tied LM head. The reference the sharded engine is checked against; both run the
// per-unit math of blocks.h.
//
// Forward keeps every activation for Backward (llm.c style); Backward accumulates
// parameter gradients into grads(), so gradient accumulation is a loop of
// Forward/Backward between ZeroGrad() calls. T is float for training and double
// for reference checks. Not thread-safe: one model per training thread (the kernels
// inside use OpenMP).

#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "worker/model/blocks.h"
#include "worker/model/parameters.h"
#include "worker/runtime/memory.h"

namespace meshtrain::model {

template <class T>
class Gpt2 {
 public:
  // Sized for micro-batches of at most `max_batch` sequences of at most `max_seq` (<= shape.seq_len) tokens.
  // Memory comes from `allocator` (params, grads, activations), or from the model's own when null.
  Gpt2(const api::ModelShape& shape, int max_batch, int max_seq, runtime::CachingAllocator* allocator = nullptr);

  const ParameterLayout& layout() const { return layout_; }
  runtime::Buffer<T>& params() { return params_; }
  const runtime::Buffer<T>& params() const { return params_; }
  runtime::Buffer<T>& grads() { return grads_; }

  // Runs the model on inputs (B,Tn). With targets (B,Tn) it returns the mean
  // cross-entropy loss; without, it returns 0 and only probabilities are computed.
  double Forward(const int32_t* inputs, const int32_t* targets, int B, int Tn);

  // Backward of the last Forward (which needs targets): grads += loss_scale * d(mean loss)/d(params).
  void Backward(T loss_scale);

  void ZeroGrad();

  // Next-token probabilities (V) at position t of sequence b of the last Forward.
  const T* Probabilities(int b, int t) const;

 private:
  ParameterLayout layout_;
  int max_batch_, max_seq_;
  runtime::MemoryAccounting own_accounting_;
  std::unique_ptr<runtime::CachingAllocator> own_allocator_;
  runtime::Buffer<T> params_, grads_, acts_buffer_;
  ModelActivations<T> acts_;
  MicroBatch batch_tokens_;
};

}  // namespace meshtrain::model
