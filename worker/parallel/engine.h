// The sharded engine (DESIGN.md, "Engine"): FSDP with hybrid sharding and tensor
// parallelism on the CPU, the schedule written once over streams and events, driven by
// the Trainer through the Replica interface. Replicated training is its case S = T = 1.
//
// Units: the root (embeddings, final LayerNorm) and one per block, each a FlatUnit of
// this rank's TP slice (model/parameters.h), sharded over the ranks of the same slice.
// The layers' TP all-reduces run inside the compute tasks (model/blocks.h).
//   Forward: the root is gathered for the whole forward (and, in training, kept for the
//     backward); while block l computes, the
//     gather of block l+1 runs on the comm stream; a block is freed after its forward.
//     Block gathers take turns in two slots, and a slot is reused only after the compute
//     stream has freed its last unit, so at most two blocks are ever unsharded.
//   Activations: an ActivationStore keeps what each block's forward leaves for its
//     backward: everything, only block inputs (checkpointing: the backward recomputes
//     the block first), or inputs within a loading horizon, the rest offloaded to host.
//   Backward: the same gathers in reverse; when a unit's backward ends, its gradients
//     are reduce-scattered on the comm stream (overlapping the next unit's backward)
//     and added to the fp32 shard gradients, so micro-batches accumulate.
//   ReduceGradients: the shard gradients are averaged over the replica group, unit by
//     unit on the comm stream; the last micro-batch's Backward already queues each
//     unit's average right after its reduce-scatter, overlapping the next unit's backward.
//   GradNorm sums squares over the shard and TP groups (replicas hold equal shards; a
//     tensor every TP rank holds whole counts once); clipping and AdamW run on the shards.
// Forward and Backward return when both streams have drained, so the host reads results
// without other synchronisation; inside them only events order the work.
//
// Thread-safety: one thread drives an engine. An observer is called on the stream threads.

#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "worker/model/blocks.h"
#include "worker/parallel/activation_store.h"
#include "worker/parallel/flat_unit.h"
#include "worker/parallel/mesh.h"
#include "worker/runtime/memory.h"
#include "worker/runtime/stream.h"
#include "worker/train/replica.h"

namespace meshtrain::parallel {

// What a schedule observer sees: each operation on a unit as it begins and ends, on
// the stream that runs it (gathers and reduce-scatters on comm, the math on compute).
enum class Op { kGather, kForward, kRecompute, kBackward, kReduceScatter };
const char* OpName(Op op);

class ScheduleObserver {
 public:
  virtual ~ScheduleObserver() = default;
  virtual void Begin(Op op, int unit) = 0;
  virtual void End(Op op, int unit) = 0;
};

struct EngineOptions {
  int64_t memory_limit = 0;  // bytes the allocator may hold; 0: no limit
  ActivationPolicy activations;
  float dropout = 0;          // model/blocks.h, DropoutSpec
  uint64_t dropout_seed = 0;  // spec.parallelism.tensorParallelSeed
};

class ShardedEngine final : public train::Replica {
 public:
  // The model of `shape` for micro-batches of batch x seq, sharded as `mesh` says,
  // memory from an allocator counting into `accounting`. Each rank initialises only its
  // shards from `seed`. Throws runtime::OutOfMemory when the memory limit is too small,
  // std::invalid_argument for an activation policy ActivationStore refuses or a TP
  // degree ParameterLayout refuses.
  ShardedEngine(const api::ModelShape& shape, std::shared_ptr<const Mesh> mesh, int batch, int seq, uint64_t seed,
                runtime::MemoryAccounting* accounting, const EngineOptions& options = {});
  ~ShardedEngine() override;

  runtime::Device device() const override { return runtime::Device::Cpu(); }
  double Forward(const int32_t* inputs, const int32_t* targets, int B, int T,
                 const train::MicroBatchKey* training = nullptr) override;
  void Backward(float loss_scale, bool last) override;
  void ZeroGrad() override;
  void ReduceGradients(comm::Communicator* data_parallel) override;
  double GradNorm() override;
  void Update(const train::OptimizerStep& step) override;
  std::vector<float> NextTokenProbabilities(const int32_t* tokens, int n) override;
  // Collective over the shard and TP groups: every member calls it. The whole model in
  // the single-rank layout.
  std::vector<float> Weights() override;
  train::CommStats comm_stats() const override;
  void Snapshot(train::ShardState* into) override;
  void Restore(const train::WholeState& whole) override;
  std::string Describe() const override;

  // For tests: called on the stream threads from now on (null: none).
  void set_observer(ScheduleObserver* observer) { observer_ = observer; }
  // The most block units unsharded at once so far.
  int peak_unsharded_blocks() const { return peak_unsharded_blocks_.load(); }
  const std::vector<std::unique_ptr<FlatUnit>>& units() const { return units_; }
  const ActivationStore& activations() const { return *acts_; }

 private:
  FlatUnit& Block(int l) { return *units_[size_t(l) + 1]; }
  // Gathers the root unit (observed as unit 0).
  void GatherRoot();
  // Gathers block l into slot l % 2 once the slot's last unit is freed.
  void GatherBlock(int l);
  // Frees block l's parameters after what the compute stream has queued, freeing its slot.
  void ReleaseBlock(int l);
  // Runs `f` on the compute stream between the observer's Begin and End of (op, unit).
  template <class F>
  void Compute(Op op, int unit, F&& f);
  void Drain();
  // Frees the root a training forward kept, if its backward did not come.
  void ReleaseRoot();

  // The TP group's collectives for the layers, timed (they run on the compute stream).
  class TensorParallel : public model::TensorParallelGroup {
   public:
    explicit TensorParallel(comm::Communicator* group) : group_(group) {}
    int rank() const override { return group_->rank(); }
    int size() const override { return group_->size(); }
    void AllReduceSum(float* data, int64_t n) override;
    void AllGather(const float* in, float* out, int64_t n) override;
    double seconds = 0;

   private:
    comm::Communicator* group_;
  };
  // The dims of the current micro-batch (B x Tn, dropout as its forward said).
  model::Dims DimsOf(int B, int Tn);

  model::ParameterLayout layout_;
  std::shared_ptr<const Mesh> mesh_;
  std::unique_ptr<TensorParallel> tp_;  // null without tensor parallelism
  int batch_, seq_;
  runtime::CachingAllocator allocator_;
  std::vector<std::unique_ptr<FlatUnit>> units_;
  std::unique_ptr<ActivationStore> acts_;
  model::MicroBatch batch_tokens_;
  float dropout_;
  uint64_t dropout_seed_;
  std::optional<train::MicroBatchKey> training_;  // of the last Forward; empty: evaluation
  double loss_ = 0;
  bool root_held_ = false;  // a training forward's root, kept gathered for its backward
  bool replicas_reduced_ = false;  // the last Backward averaged the shard gradients over replicas
  bool norm_current_ = false;
  double norm_ = 0;

  runtime::Stream compute_{"compute"}, comm_{"comm"};
  runtime::Event slot_free_[2];
  std::vector<runtime::Event> grads_done_;  // per unit: its backward has ended
  train::CommStats comm_seconds_;  // written on the comm stream
  double exposed_seconds_ = 0;  // the compute stream blocked on communication
  ScheduleObserver* observer_ = nullptr;
  std::atomic<int> unsharded_blocks_{0}, peak_unsharded_blocks_{0};
};

}  // namespace meshtrain::parallel
