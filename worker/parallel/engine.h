// The engine: one rank's part of the model and its optimizer state, on one device, as the
// Trainer drives it (docs/design.md, "The engine"). There is one implementation, the sharded engine
// (sharded_engine.h), for every device and layout: replicated training is its case
// S = T = 1. This header holds the interface and the types the Trainer and checkpoints
// exchange with it.
//
// A step is ZeroGrad, then ForwardBackward over the step's micro-batches (or, on one
// stage, a training Forward and a Backward per micro-batch), then Update; TakeLoss and
// GradNorm read the step's figures afterwards. Everything in between is enqueued on the
// device's streams without waiting for them: the host waits once, when it reads the
// figures. Token arrays are host memory.
// In a pipeline (EngineOptions::pipeline), every stage's engine is given every
// micro-batch of the step alike, and ForwardBackward runs the stage's part of the
// schedule for them (api/pipeline.h); a Forward without training goes through the
// stages at once. Every call is then collective over the pipeline group too, and
// TakeLoss, GradNorm and the results outside steps are the whole model's on every stage.
// Thread-safety: one thread drives an engine. An observer is called on host threads of
// the streams (stream.h, HostCallback).

#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <memory>
#include <string>
#include <vector>

#include "api/engine_memory.h"
#include "api/model_shape.h"
#include "api/pipeline.h"
#include "worker/kernels/float8.h"
#include "worker/runtime/device.h"

namespace meshtrain::model {
struct Documents;  // model/model.h
}  // namespace meshtrain::model

namespace meshtrain::parallel {

using ActivationPolicy = api::ActivationPolicy;

struct OptimizerStep {
  float learning_rate = 0, beta1 = 0.9f, beta2 = 0.95f, epsilon = 1e-8f;
  float weight_decay = 0;  // on the tensors ParameterLayout marks for decay
  float max_norm = 0;      // global grad-norm clipping; 0: none
  int64_t t = 1;           // steps taken, this one included
};

// Seconds spent in collectives since the start, by operation, and the part of them the
// compute stream waited for (exposed communication); likewise for activation copies
// (offload and load) on the copy stream. In a pipeline, the seconds sending and receiving
// activations and gradients, and the seconds the compute stream stood waiting for the
// neighbouring stages' (the bubble, and any transfer not hidden).
struct CommStats {
  double all_gather = 0, reduce_scatter = 0, all_reduce = 0, exposed = 0;
  double copy = 0, copy_exposed = 0;
  double send = 0, recv = 0, neighbour_wait = 0;
  double ring = 0;        // context parallelism's key/value passes (sends and receives on the context group)
  double all_to_all = 0;  // its all-to-all (Ulysses) exchanges of q, k, v and the output, and their gradients
};
CommStats operator-(const CommStats& a, const CommStats& b);

// One rank's part of the training state, for a checkpoint: the model's elements of its
// shard of every unit (no padding), in unit order, of fp32 master weights and AdamW m and
// v, in host memory the engine owns (page-locked where the device has such memory); and
// the rank's place in the layout.
// In a pipeline, the state covers the units of the rank's stage, in unit order.
struct ShardState {
  int tp_rank = 0, shard_rank = 0, replica = 0;
  int64_t size = 0;  // elements of each of master, m and v
  float* master = nullptr;
  float* m = nullptr;
  float* v = nullptr;
  std::shared_ptr<void> storage;  // owns the three arrays
  int stage = 0;
  std::vector<int> units;  // the units (model::ParameterLayout) whose elements it holds, in order; empty: all
  // Expert parallelism: the rank's place in its expert group (of api::ParallelLayout::expert()),
  // whose experts its TP slice holds (model::ParameterLayout's ep_rank); 0 without.
  int expert_rank = 0;
};

// The whole model's optimizer state in the single-rank layout (ParameterLayout order,
// the user's vocabulary).
struct WholeState {
  std::vector<float> master, m, v;
};

// What Restore asks for a unit's shard: for each i, the fp32 master weight and AdamW m
// and v of the element at single-rank index whole_indices[i] (-1: vocabulary padding,
// which gets zeros), into master[i], m[i] and v[i]. A checkpoint reader answers it with
// only that rank's elements.
using ShardFill =
    std::function<void(int unit, const std::vector<int64_t>& whole_indices, float* master, float* m, float* v)>;

// The fill that takes each element from `whole` (which must outlive it). Throws
// std::invalid_argument when `whole` is not a model of `parameters` elements.
ShardFill FillFrom(const WholeState& whole, int64_t parameters);

// Which micro-batch of which step a training forward computes; it keys dropout masks.
struct MicroBatchKey {
  int64_t step = 0;   // 0-based
  int64_t micro = 0;  // within the step
};

// A micro-batch for ForwardBackward: inputs (B,T) and targets (B,T; -1: masked) in host
// memory that outlives the call, the key of its training forward and its targets' weight
// (Forward says what the weight means), and its documents (null: causal attention over
// each window; EngineOptions::documents), which outlive the call too.
struct MicroBatch {
  const int32_t* inputs = nullptr;
  const int32_t* targets = nullptr;
  int B = 0, T = 0;
  MicroBatchKey key;
  float target_weight = 0;
  const model::Documents* documents = nullptr;
};

// What a schedule observer sees: each operation on a unit as it begins and ends, on the
// stream that runs it (gathers and reduce-scatters on comm, the math on compute), and the
// moment a block's gathered copy is released (Begin and End together).
enum class Op { kGather, kForward, kRecompute, kBackward, kReduceScatter, kRelease };
const char* OpName(Op op);

class ScheduleObserver {
 public:
  virtual ~ScheduleObserver() = default;
  virtual void Begin(Op op, int unit) = 0;
  virtual void End(Op op, int unit) = 0;
};

struct EngineOptions {
  int64_t memory_limit = 0;  // bytes of device memory the allocator may hold; 0: no limit
  ActivationPolicy activations;
  float dropout = 0;          // model/model.h, DropoutSpec
  uint64_t dropout_seed = 0;  // spec.parallelism.tensorParallelSeed
  // How long a Drain waits for the streams before it fails naming them (a hung device or
  // a collective stuck past its own timeout).
  std::chrono::milliseconds timeout{600'000};
  // Each TP slice of the vocabulary is padded to a multiple of this (api::kVocabMultiple);
  // 1 gives the unpadded engine, which tests compare the padded one against.
  int vocab_multiple = api::kVocabMultiple;
  // Replicated (S = 1 only): every unit's compute copy is kept for the whole run and AdamW
  // refreshes it, instead of the FSDP life cycle of a gather before each use into two slots.
  // What the benchmark compares the sharded life cycle at world 1 against.
  bool keep_units_gathered = false;
  // The pipeline the engine is a stage of (the mesh says which), and the micro-batches of
  // a training step (ForwardBackward's), which flow through it as its schedule orders
  // them.
  api::Pipeline pipeline;
  int micro_batches = 1;
  // spec.data.attention: document: micro-batches may come with their documents
  // (model::Documents), and the family's buffers hold positions 0 to the whole sequence's
  // last (with context parallelism too), from which each document's rows take theirs.
  bool documents = false;
  // With a context group (the mesh's), its attention: all-to-all (Ulysses,
  // ulysses_attention.h) rather than the ring (ring_attention.h).
  bool context_all_to_all = false;
  // A mixture of experts' load-balancing loss (spec.training.routerAuxLossCoef; unset:
  // none): ForwardBackward adds coef x transformers' load_balancing_loss_func of each
  // micro-batch, over every data-parallel rank's tokens of that micro-step, divided by the
  // micro-batches of the step, to the loss and its gradient; across pipeline stages, of
  // every stage's blocks (the loss counted on the last stage).
  std::optional<float> router_aux_loss_coef;
  // Float8 training (spec.training.precision fp8; unset: none): the blocks' linear layers
  // multiply in float8 cast by this recipe (model::LinearForward), with fp32 or bf16
  // kernels. Not with a context group, whose activations' amaxes it does not reduce.
  std::optional<kernels::Float8Recipe> float8;
};

class Engine {
 public:
  virtual ~Engine() = default;

  virtual runtime::Device device() const = 0;
  // Enqueues the forward of inputs (B,T) against targets (B,T; -1: a masked position,
  // which adds no loss and no gradient) and adds target_weight times the sum of their
  // cross-entropies to the engine's loss sum: the caller's weight makes it a mean (1/(B*T)
  // for this micro-batch's, or the data-parallel size over the global batch's unmasked
  // targets, since the replicas' gradients are averaged). With `training`, dropout (if the
  // model has any) drops what that micro-batch's masks say, and the head's backward runs
  // too (llm.c's fused classifier), for the gradient of that weighted sum.
  // Throws std::invalid_argument for a micro-batch larger than the engine was built for,
  // std::out_of_range for a token outside the vocabulary, and std::logic_error for a
  // training forward in a pipeline (which trains through ForwardBackward only).
  // `documents` (null: causal; needs EngineOptions::documents) is copied.
  virtual void Forward(const int32_t* inputs, const int32_t* targets, int B, int T, const MicroBatchKey* training,
                       float target_weight, const model::Documents* documents = nullptr) = 0;
  // The rest of the last training Forward's backward: grads += the gradient of its
  // weighted loss. `last`: the step's last micro-batch, whose gradients are averaged over
  // the replicas as each unit's become final. Throws std::logic_error when no training
  // Forward came before it.
  virtual void Backward(bool last) = 0;
  // The training forward and backward of each of a step's micro-batches (the step's
  // last is the last of them), in the order of the stage's schedule: what a training
  // Forward and a Backward of each do in turn. Throws what Forward does, before any
  // work, for a micro-batch it cannot take; in a pipeline, std::invalid_argument for a
  // number of micro-batches the schedule cannot take (api::StageActions) and
  // std::logic_error for more than the engine has activation lanes for
  // (EngineOptions::micro_batches).
  virtual void ForwardBackward(const std::vector<MicroBatch>& micro_batches) = 0;
  virtual void ZeroGrad() = 0;
  // The gradients' global L2 norm (a replicated tensor counted once), clipping to
  // step.max_norm and one AdamW step, all on the device.
  virtual void Update(const OptimizerStep& step) = 0;
  // Waits for the engine's work and returns the loss sum since the last call.
  virtual double TakeLoss() = 0;
  // The gradient norm before clipping that the last Update computed (waits for it).
  virtual double GradNorm() = 0;
  // Probabilities (V) of the token that follows tokens[0..n); collective over the TP and
  // shard groups.
  virtual std::vector<float> NextTokenProbabilities(const int32_t* tokens, int n) = 0;
  // The fp32 master weights, whole, in ParameterLayout order (the user's vocabulary);
  // collective over the shard and TP groups.
  virtual std::vector<float> Weights() = 0;
  // Waits for the engine's streams.
  virtual CommStats comm_stats() = 0;
  // The tokens each expert of each mixture-of-experts block on this rank received in the
  // training forwards since the last call (by block, E counts each; empty for a dense
  // model), and starts counting again.
  virtual std::map<int, std::vector<int64_t>> TakeExpertCounts() { return {}; }
  // With a load-balancing loss: the mean of load_balancing_loss_func over the training
  // micro-batches since the last call (before its coefficient), and starts again; else none.
  virtual std::optional<double> TakeAuxLoss() { return std::nullopt; }
  // Copies this rank's optimizer state into `into`, reusing its memory when it is the
  // engine's (checkpoints write it in the background). Waits for the copies.
  virtual void Snapshot(ShardState* into) = 0;
  // This rank's optimizer state, one unit's shard at a time from `fill`: the one place
  // all of the state is replaced (a checkpoint of any layout, or a model's weights).
  virtual void RestoreShards(const ShardFill& fill) = 0;
  // This rank's elements of `whole` as its optimizer state.
  virtual void Restore(const WholeState& whole) = 0;
  // How the model is laid out on this rank, for the startup lines.
  virtual std::string Describe() const = 0;
  // EngineOptions::vocab_multiple: checkpoints record it.
  virtual int vocab_multiple() const = 0;
  // For tests: called from now on (null: none).
  virtual void set_observer(ScheduleObserver* observer) = 0;
};

}  // namespace meshtrain::parallel
