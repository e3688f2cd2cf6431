// The sharded engine (docs/design.md, "The engine"): FSDP with hybrid sharding and tensor
// parallelism, the one step schedule for every device, written over streams, events, the
// kernel table and stream-ordered collectives. Replicated training is its case S = T = 1.
//
// Units (model/parameters.h): the embedding, one per block and, when the head is untied,
// the head's, each a FlatUnit of this rank's TP slice (the vocabulary padded), sharded over
// the ranks of the same slice. The family's layers (model/model.h) compute; the engine
// names no family. Streams: compute, comm (gathers and gradient reduction) and the
// ActivationStore's copy stream.
//   Forward: the embedding unit is gathered into the edge slot, and the first block into a
//     block slot; while block l computes, the gather of block l+1 runs on the comm stream;
//     block gathers take turns in two slots, and a slot is reused only after the compute
//     stream has released its last unit, so at most two blocks are ever unsharded. An
//     untied head's unit is gathered into the edge slot while the last block computes, once
//     the embedding has left it; a tied head uses the embedding unit, which stays. The head
//     then computes the loss a chunk of logits at a time and, in training, its own backward
//     in the same pass (llm.c's fused classifier), and releases the edge slot: no
//     vocabulary-by-hidden matrix stays unsharded through the blocks. A training forward
//     keeps the last block for the backward, which starts with it.
//   Activations: an ActivationStore keeps what each block's forward leaves for its
//     backward: everything, only block inputs (checkpointing: the backward recomputes
//     the block first), or inputs within a loading horizon, the rest offloaded to host.
//   Backward: the same gathers in reverse, from the second-to-last block; when a unit's
//     backward ends, its gradients are reduce-scattered on the comm stream (overlapping
//     the next unit's backward) and added to the shard gradients, so micro-batches
//     accumulate; with S = 1 the backward adds into them directly. An untied head's are
//     reduce-scattered right after the head; the embedding's (a tied head's with them)
//     after the embedding's backward, which needs no parameters. The last micro-batch also
//     averages each unit's shard gradients over the replica group right after.
//   Update: the sum of squares of the shard gradients (a tensor every TP rank holds whole
//     counted once), all-reduced in fp64 over the shard and TP groups, the clip scale and
//     AdamW, all on the device.
//   Pipeline: a stage holds its chunks' blocks (api/pipeline.h), the first stage the
//     embedding's unit and the last the head's; with a tied head the last stage keeps a
//     copy of the embedding's unit, whose gradients are summed with the first stage's
//     before each update, so the two copies stay equal. The engine computes chunks: a
//     chunk's forward starts from a lane of the ActivationStore (or embeds the tokens)
//     and ends in the lane's output (or runs the head, whose gradient goes to the lane);
//     its backward runs in place on the lane's gradient. Its PipelineStage
//     (pipeline_stage.h) runs the stage's schedule over those chunks and moves the lanes'
//     activations and gradients between stages. On the last stage the head's gradients
//     are reduced right after its forward. Norms, losses and the whole model are summed
//     over the pipeline group, and so is a load-balancing loss's routing of each
//     micro-batch (PostRouterStats: an all-reduce in flight between the stage's forward
//     of it and its backward). With one stage, the same with one chunk and no transfers.
// Nothing is allocated after construction, and the host waits only when it reads a
// result (TakeLoss, GradNorm, and the calls outside steps).
//
// Thread-safety: one thread drives an engine. An observer is called on stream host threads.

#pragma once

#include <array>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "worker/kernels/ops.h"
#include "worker/model/model.h"
#include "worker/model/parameters.h"
#include "worker/parallel/activation_store.h"
#include "worker/parallel/engine.h"
#include "worker/parallel/flat_unit.h"
#include "worker/parallel/mesh.h"
#include "worker/parallel/pipeline_stage.h"
#include "worker/runtime/backend.h"
#include "worker/runtime/device_memory.h"
#include "worker/runtime/memory.h"

namespace meshtrain::parallel {

// Makes the engine's kernel table, whose own device memory comes from the allocator.
template <class P>
using OpsFactory = std::function<std::unique_ptr<kernels::Ops<P>>(runtime::Backend&, runtime::CachingAllocator*)>;

template <class P>
class ShardedEngine final : public Engine, private ChunkCompute {
 public:
  using A = typename P::Act;
  using G = typename P::Acc;
  template <class T>
  using Ptr = runtime::DevicePtr<T>;

  // The model of `shape` for micro-batches of up to batch x seq, sharded as `mesh` says,
  // on `backend` with the kernel table `make_ops` makes; device memory from an allocator
  // counting into `accounting`. Each rank initialises only its shards from `seed`.
  // Throws runtime::OutOfMemory when the memory limit is too small, std::invalid_argument
  // for an activation policy ActivationStore refuses or a TP degree ParameterLayout refuses.
  ShardedEngine(const api::ModelShape& shape, std::shared_ptr<const Mesh> mesh, int batch, int seq, uint64_t seed,
                runtime::MemoryAccounting* accounting, const EngineOptions& options,
                std::shared_ptr<runtime::Backend> backend, const OpsFactory<P>& make_ops);
  ~ShardedEngine() override;

  runtime::Device device() const override { return backend_->device(); }
  void Forward(const int32_t* inputs, const int32_t* targets, int B, int T, const MicroBatchKey* training,
               float target_weight, const model::Documents* documents = nullptr) override;
  void Backward(bool last) override;
  void ForwardBackward(const std::vector<MicroBatch>& micro_batches) override;
  void ZeroGrad() override;
  void Update(const OptimizerStep& step) override;
  double TakeLoss() override;
  double GradNorm() override;
  std::vector<float> NextTokenProbabilities(const int32_t* tokens, int n) override;
  std::vector<float> Weights() override;
  CommStats comm_stats() override;
  std::map<int, std::vector<int64_t>> TakeExpertCounts() override { return std::exchange(expert_counts_, {}); }
  std::optional<double> TakeAuxLoss() override;
  void Snapshot(ShardState* into) override;
  void Restore(const WholeState& whole) override;
  void RestoreShards(const ShardFill& fill) override;
  std::string Describe() const override;
  void set_observer(ScheduleObserver* observer) override { observer_ = observer; }
  int vocab_multiple() const override { return layout_.vocab_multiple(); }

  const std::vector<std::unique_ptr<FlatUnit<P>>>& units() const { return units_; }
  const model::ParameterLayout& layout() const { return layout_; }
  const ActivationStore<P>& activations() const { return *store_; }

 private:
  int chunks() const { return int(first_.size()) - 1; }
  FlatUnit<P>& Embedding() { return *units_[0]; }
  FlatUnit<P>& Block(int l) { return *units_[size_t(l) + 1]; }
  FlatUnit<P>& HeadUnit() { return *units_[size_t(layout_.head_unit())]; }
  int BlockSlotIndex(int l) const { return l % int(block_params_.size()); }
  Ptr<A> BlockSlot(int l) const {
    return options_.keep_units_gathered ? block_params_[size_t(l)].get() : block_params_[size_t(BlockSlotIndex(l))].get();
  }
  // Where unit u (the embedding's or the head's) is gathered: the edge slot, or its own kept copy.
  Ptr<A> EdgeSlot(int u) const;
  Ptr<G> BlockGrads(int l);
  // Whether a block's backward writes unsharded gradients that ReduceGrads then reduces
  // (else it adds into the shard's own), and the group that shards the unit.
  static bool ReducesUnsharded(const FlatUnit<P>& unit) { return unit.shard_size() > 1 || unit.experts_split(); }
  comm::StreamCollectives* ShardGroup(const FlatUnit<P>& unit) const;
  // Where unit u's (the embedding's or the head's) unsharded gradients go.
  Ptr<G> EdgeGrads(int u);
  model::Context<P> Context(const model::Documents* documents = nullptr) {
    model::Context<P> k{*ops_, *compute_, tp_.get(), family_buffers_, cp_.get(), backend_.get(), documents, nullptr,
                        ep_.get()};
    if (options_.float8) k.float8 = &float8_;
    return k;
  }
  // The dims of a micro-batch: its shape and, in training with dropout, its masks.
  model::Dims DimsOf(int B, int T, const MicroBatchKey* training) const;
  // Throws what Forward documents for tokens or targets it cannot take.
  void CheckTokens(const int32_t* inputs, const int32_t* targets, int B, int T) const;
  // Throws std::invalid_argument for documents the engine cannot take (EngineOptions::documents).
  void CheckDocuments(const model::Documents* documents, int B, int T) const;
  // ChunkCompute, which the stage's program calls.
  void LoadTokens(const MicroBatch& m) override;
  void Unshard(int c, bool forward) override;
  void Reshard() override { ReleaseHeld(); }
  void ChunkForward(int c, int lane, const MicroBatch& m, HeadWork head, bool keep) override;
  void ReduceHead(bool last) override;
  void ChunkBackward(int c, int lane, const MicroBatch& m, bool last) override;
  // The probabilities of the logits the head left (HeadLogits), of the whole vocabulary.
  std::vector<float> Probabilities();
  void GatherEdge(int u);
  void GatherBlock(int l);
  void ReleaseBlock(int l);
  void ReleaseEdge();
  // Unit u's (the embedding's or the head's) gradients, complete in the edge buffer:
  // reduce-scattered, and with `last` averaged over the replicas.
  void ReduceEdge(int u, bool last);
  void ReleaseHeld();  // the last block a training forward kept, if it kept it
  // The load-balancing loss of the micro-batch of N tokens whose training forward just
  // ran (one stage): its statistics summed over the data-parallel ranks, its value, and
  // its gradient by each router probability, uploaded for the backward.
  void FinishRouterStats(int64_t N);
  // s's counts (E), then its probabilities' sums (E), summed over the data-parallel ranks
  // of this stage and TP rank (a host all-reduce, every such rank at the same micro-batch).
  std::vector<double> SumOverDataRanks(const model::RouterStats& s);
  // From `both` summed over every rank of a micro-step of N tokens a rank and its `blocks`:
  // adds the loss's value (and with counts_loss the loss), and sets dprobs (N,E) to its
  // gradient by each router probability.
  void AddAuxLoss(const std::vector<double>& both, int blocks, int64_t N, bool counts_loss, std::vector<G>* dprobs);
  // Across pipeline stages: when this stage's last chunk of micro-batch `micro` has run
  // forward, its routing summed over the data ranks, and an all-reduce over the stages
  // started; the first backward of it here waits for that, and every backward of it here
  // uploads the gradient by each router probability.
  void PostRouterStats(int64_t micro);
  void UploadStagedDprobs(int64_t micro, int64_t N);
  // Forgets the last step's (after its uploads and all-reduces have finished).
  void DropStagedStats();
  // Replicated: the kept compute copies no longer match the masters (built, restored).
  void RefreshKept();
  // Runs `enqueue` between the observer's Begin and End of (op, unit) on `stream`.
  template <class F>
  void Observed(runtime::Stream& stream, Op op, int unit, F&& enqueue);
  void WaitTimed(runtime::Event& event);
  // Units this rank holds: its stage's; `counted` leaves out the last stage's copy of a
  // tied embedding (its elements are the first stage's).
  std::vector<FlatUnit<P>*> Held(bool counted);
  void Drain();

  class TensorParallel;
  class ExpertParallel;

  model::ParameterLayout layout_;
  std::unique_ptr<model::Model<P>> model_;
  std::shared_ptr<runtime::Backend> backend_;  // outlives the mesh, whose groups may use it
  std::shared_ptr<const Mesh> mesh_;
  int batch_, seq_;
  EngineOptions options_;
  // The pipeline, and every chunk's first block (and L after the last).
  api::Pipeline pipeline_;
  std::vector<int> first_;
  runtime::CachingAllocator allocator_, pinned_;
  std::unique_ptr<kernels::Ops<P>> ops_;
  std::unique_ptr<runtime::Stream> compute_, comm_;
  std::unique_ptr<runtime::StreamTimer> exposed_;
  std::unique_ptr<TensorParallel> tp_;  // null without tensor parallelism
  std::unique_ptr<ExpertParallel> ep_;  // null without expert parallelism
  std::unique_ptr<model::ContextParallelGroup<P>> cp_;  // null without context parallelism
  model::ExpertCounts expert_counts_;  // the training forwards' since TakeExpertCounts
  // The load-balancing loss (EngineOptions::router_aux_loss_coef): the training forward's
  // routing, its weight (coef / the step's micro-batches), the gradient by each router
  // probability (N,E) on the host and on the device, and the loss since TakeLoss and
  // TakeAuxLoss.
  model::RouterStats router_stats_;
  float aux_weight_ = 0;
  std::vector<G> aux_dprobs_host_;
  runtime::DeviceArray<G> aux_dprobs_;
  // With pipeline stages: each micro-batch's routing on this stage, its sum over the data
  // ranks and blocks (2E + 1) in the stages' all-reduce, and then its gradient (N,E), kept
  // until the next step (the uploads read them); and the stage's last chunk.
  struct StagedRouterStats {
    model::RouterStats stats;
    std::vector<double> both;
    std::shared_ptr<comm::Work> summed;
    std::vector<G> dprobs;
  };
  std::map<int64_t, StagedRouterStats> staged_stats_;
  int last_chunk_ = -1;
  double aux_loss_sum_ = 0, aux_value_sum_ = 0;
  int aux_micro_batches_ = 0;
  // The step buffer (api::StepBuffers): tokens, targets, scalars, segment tables, RoPE's table.
  runtime::DeviceArray<std::byte> step_;
  // With documents under context parallelism: the family's buffers for every position of
  // the whole sequence (the step buffer's hold this rank's rows only).
  runtime::DeviceArray<std::byte> document_buffers_;
  Ptr<int32_t> tokens_, targets_;
  Ptr<double> loss_sum_, squares_;
  Ptr<float> clip_scale_;
  model::Carving family_buffers_;  // the family's (RoPE's table), in the step buffer
  model::Float8Linear float8_;     // with EngineOptions::float8: its scratch in the step buffer
  std::vector<std::unique_ptr<FlatUnit<P>>> units_;  // every unit of the layout; null where another stage holds it
  // Compute copies and, with S > 1, unsharded gradients: the edge slot (the embedding's or
  // the head's; kept: one each) and two block slots.
  std::vector<runtime::DeviceArray<A>> edge_params_;   // one, or when kept the embedding's and the head's
  std::vector<runtime::DeviceArray<A>> block_params_;  // two slots, or one per block when kept
  runtime::DeviceArray<G> edge_grads_, reduced_;
  std::array<runtime::DeviceArray<G>, 2> block_grads_;
  std::unique_ptr<ActivationStore<P>> store_;
  // Events: the compute stream released a param slot (or the edge slot); the comm stream
  // has reduced a grad slot (or the edge's); comm's work before the optimizer; the squares
  // of the gradients are summed.
  std::array<std::unique_ptr<runtime::Event>, 2> param_slot_free_, grad_slot_free_;
  std::unique_ptr<runtime::Event> edge_free_, edge_grads_free_, comm_done_, squares_done_;
  std::unique_ptr<PipelineStage<P>> stage_;  // runs this stage's schedule over the chunks
  // Page-locked staging of the tokens, two micro-batches deep, and the events that say a
  // micro-batch's copy has left; and of the scalars read back.
  std::array<std::unique_ptr<runtime::Event>, 2> staged_;
  int32_t* staging_ = nullptr;
  double* readback_ = nullptr;
  int staging_slot_ = 0;

  MicroBatch forwarded_;  // the last training Forward's shape and key, for its Backward
  model::Documents forwarded_documents_;  // and its documents (forwarded_.documents points here)
  bool held_ = false;  // a training forward's last block, kept gathered for its backward
  int held_block_ = 0;
  bool replicas_reduced_ = false;  // the last Backward averaged the shard gradients over replicas
  std::optional<double> norm_;     // the last Update's, once read
  bool updated_ = false;
  bool kept_stale_ = true;  // replicated: the next forward casts every unit into its kept copy
  ScheduleObserver* observer_ = nullptr;
};

}  // namespace meshtrain::parallel
