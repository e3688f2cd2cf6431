// A model of any family whole on one rank: the reference the sharded engine is checked against
// (tests/unit/engine_test.cc: one rank of the engine equals the whole model, bit for bit;
// tests/unit/model_test.cc: its gradients against finite differences, fp32 against fp64).
//
// It is the engine with everything the engine adds taken away: one stream on a CPU
// backend, the kernel table of precision P, and the whole model in one parameter buffer
// laid out by ParameterLayout(shape, 0, 1, vocab_multiple) (no shards, no TP, no slots,
// no activation store). It runs the same family's layers (model/model.h) in the same
// order as the engine does on one rank (model/model.h): EmbedForward, BlockForward per block, then
// HeadForward, which in a training forward also runs the head's backward (llm.c's fused
// classifier); Backward runs the blocks' backward in reverse, then EmbedBackward.
//
// Like the engine, it keeps fp32 (Acc) master weights and a compute copy in P::Act, cast
// from them; parameter gradients accumulate between ZeroGrad() calls, so micro-batches
// are a loop of training Forward and Backward. Every activation is kept (llm.c style).
// Not thread-safe: one thread drives it (the kernels inside use OpenMP).

#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "api/engine_memory.h"
#include "api/model_shape.h"
#include "worker/kernels/ops.h"
#include "worker/model/model.h"
#include "worker/model/parameters.h"
#include "worker/runtime/cpu_backend.h"
#include "worker/runtime/device_memory.h"
#include "worker/runtime/memory.h"

namespace meshtrain::testing {

template <class P>
class ModelReference {
 public:
  using A = typename P::Act;
  using G = typename P::Acc;

  // What a training forward adds: the weight of its mean loss, and dropout's masks (as
  // the engine keys them: model::DropoutSpec).
  struct Training {
    float loss_weight = 1;
    model::DropoutSpec dropout{};
  };

  // Sized for micro-batches of at most max_batch x max_seq (<= shape.seq_len), with
  // parameters initialised from `seed` as the engine initialises its shards. Throws
  // std::invalid_argument for a max_seq past the model's. `documents`: room for document
  // attention (set_documents).
  ModelReference(const api::ModelShape& shape, int max_batch, int max_seq, uint64_t seed, int vocab_multiple = 1,
                runtime::CpuBackendOptions backend = {}, bool documents = false);
  ~ModelReference();
  ModelReference(const ModelReference&) = delete;
  ModelReference& operator=(const ModelReference&) = delete;

  const model::ParameterLayout& layout() const { return layout_; }

  // The model on inputs (B,T) against targets (B,T). Returns what it adds to a loss sum:
  // the mean cross-entropy times training->loss_weight (1 without training). With
  // `training`, the head's backward runs too and Backward() may follow. Throws
  // std::invalid_argument for a micro-batch larger than the model was built for and
  // std::out_of_range for a token outside the vocabulary.
  double Forward(const int32_t* inputs, const int32_t* targets, int B, int T, const Training* training = nullptr);
  // grads += the gradient of the last training Forward's weighted mean loss. Throws
  // std::logic_error without one.
  void Backward();
  void ZeroGrad();
  // The documents of the forwards and backwards that follow (null: causal attention over
  // each window), which outlive them. REQUIRES: built with `documents`.
  void set_documents(const model::Documents* documents) { documents_ = documents; }

  // Host copies, in this layout's order (padding rows included).
  std::vector<G> Params();
  std::vector<G> Grads();
  // Replaces the master weights (and their compute copy). REQUIRES: layout().total() elements.
  void SetParams(const std::vector<G>& params);
  // The model's elements of `layout_order` (a Params() or Grads()), without the padding:
  // the single-rank, unpadded order of the engine's Weights() and of checkpoints.
  std::vector<G> ModelElements(const std::vector<G>& layout_order) const;

  // Probabilities (V) of the token that follows tokens[0..n), in fp64 from the logits.
  std::vector<double> NextTokenProbabilities(const int32_t* tokens, int n);

  const runtime::MemoryAccounting& accounting() const { return accounting_; }

 private:
  // Checks the micro-batch and copies it to the device.
  void Stage(const int32_t* inputs, const int32_t* targets, int B, int T);
  model::Dims DimsOf(int B, int T) const;
  // Embedding and blocks, into blocks_'s activations; the head's input is the last output.
  void RunTrunk(const model::Dims& d);
  runtime::DevicePtr<A> Input(int l) const;
  model::Context<P> Context();

  model::ParameterLayout layout_;
  int max_batch_, max_seq_;
  std::shared_ptr<runtime::CpuBackend> backend_;
  runtime::MemoryAccounting accounting_;
  runtime::CachingAllocator allocator_;
  std::unique_ptr<model::Model<P>> model_;
  std::unique_ptr<kernels::Ops<P>> ops_;
  std::unique_ptr<runtime::Stream> stream_;
  api::EngineTypes types_;
  runtime::DeviceArray<G> master_, grads_;
  runtime::DeviceArray<std::byte> family_memory_;  // the family's buffers (RoPE's table)
  model::Carving family_buffers_;
  runtime::DeviceArray<A> params_, encoded_;
  runtime::DeviceArray<int32_t> tokens_, targets_;
  runtime::DeviceArray<double> loss_;
  runtime::DeviceArray<std::byte> blocks_memory_, head_memory_, scratch_memory_;
  std::vector<model::BlockActivations<P>> blocks_;
  model::HeadActivations<P> head_{};
  model::BlockScratch<P> scratch_{};
  model::Dims trained_{};  // the last training Forward's dims
  bool can_backward_ = false;
  const model::Documents* documents_ = nullptr;
};

}  // namespace meshtrain::testing
