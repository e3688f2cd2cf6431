// Training of a TrainingJob: gradient accumulation over micro-batches, global grad-norm
// clipping, AdamW with decoupled weight decay on matrices and embeddings, the
// learning-rate schedule, validation losses and checkpoints. The model is the sharded
// engine (parallel/engine.h) on the rank's device: fp32 on the CPU, where the same seed
// gives bitwise-identical losses run after run, or bf16 compute with fp32 master weights
// on a GPU. The engine is the same on both.
//
// With a world communicator, every data-parallel rank reads its own slice of each
// global batch (the ranks of a TP group the same one): layers split over TP groups of
// tensorParallelDegree ranks, units over shard groups of hybridShardDegree ranks,
// gradients reduce-scattered and averaged over replicas, so the run matches the
// single-rank run of the same global batch up to summation order.
// Not thread-safe: one Trainer drives its model from one thread.

#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "api/layout.h"
#include "api/training_job.h"
#include "worker/comm/communicator.h"
#include "worker/comm/stream_collectives.h"
#include "worker/model/model.h"
#include "worker/parallel/engine.h"
#include "worker/runtime/device.h"
#include "worker/runtime/memory.h"
#include "worker/train/checkpoint.h"
#include "worker/train/data_loader.h"
#include "worker/train/devices.h"
#include "worker/train/sampler.h"

namespace meshtrain::train {

struct StepReport {
  int64_t step = 0;  // 1-based, of `steps`
  int64_t steps = 0;
  double loss = 0;   // mean training loss over the step's micro-batches
  double learning_rate = 0;
  double grad_norm = 0;  // before clipping
  double tokens_per_second = 0;  // of the whole job
  double seconds = 0;            // wall time of the step
  std::optional<double> validation_loss;  // on evaluation steps
  parallel::CommStats comm;  // seconds in collectives during the step, and the exposed part
  std::optional<double> checkpoint_stall;  // on checkpoint steps: seconds the step waited for the snapshot
  // In a pipeline: each stage's bubble, the share of the step its compute stream stood
  // waiting for its neighbours (the mean over the stage's ranks), and the schedule's model
  // of it (api::BubbleFraction).
  std::vector<double> stage_bubbles;
  double bubble_model = 0;
  // A mixture of experts: each of this rank's sparse blocks (by block; its stage's in a
  // pipeline), its busiest expert's tokens this step and the mean over its experts.
  struct ExpertLoad {
    double max = 0, mean = 0;
    double imbalance() const { return mean > 0 ? max / mean : 0; }
  };
  std::map<int, ExpertLoad> expert_load;
  // With a load-balancing loss: its mean over the micro-batches, before its coefficient
  // (the loss above includes coefficient x it).
  std::optional<double> aux_loss;
};

// "step    12/300 | loss 3.1234 | lr 3.00e-03 | norm 1.234 | 14000 tok/s[ | val loss 3.0123]"
// then with a load-balancing loss "[ | aux 1.0312]", in a pipeline "[ | bubble by stage 31% 22% 14% 6% (model 27%)]", and for a mixture
// of experts "[ | experts max/mean 1.42]" (the most imbalanced block's).
std::string FormatStepReport(const StepReport& report);

// Peak bytes held, by the categories of docs/design.md's memory accounting ("The device seam").
struct MemoryReport {
  int64_t params = 0, grads = 0, optimizer = 0, activations = 0, gathered = 0, offload = 0;
};

// "params 1.2 MiB, grads 1.2 MiB, optimizer 2.4 MiB, activations 9.0 MiB, gathered 0.8 MiB"
// and, when activations are offloaded, ", offload 4.0 MiB"
std::string FormatMemory(const MemoryReport& memory);

// Throws what Trainer's constructor would for `job` on `ranks` ranks (as data-parallel
// rank `rank`): std::invalid_argument for a layout it cannot run, TokenFileError or
// std::invalid_argument for bad data. Cheap (the token files are only mapped), so every
// rank can find a configuration error before it waits for the others.
void CheckTrainable(const api::TrainingJob& job, int rank, int ranks);

// A step whose loss or gradient norm is not finite: the run stops there, for a model that
// has diverged only gets worse.
class TrainingDiverged : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// How Trainer::Run ended: at spec.training.steps, or stopped early because a rank was
// told to stop.
struct RunEnd {
  // The ranks agreed to stop after `step`, before spec.training.steps: `asked` (world
  // ranks) were told to (Run's `stop_requested`).
  bool stopped = false;
  int64_t step = 0;  // the last step trained
  std::vector<int> asked;
  // Stopped with spec.checkpoint.path set and `step` > 0: a checkpoint of `step` exists,
  // written on the way out or already there (`wrote` says which).
  bool checkpointed = false, wrote = false;
};

// Whether any rank of `world` (null: this one alone) passed `mine` true: the world ranks
// that did, in order; empty when none did. Collective: every rank calls it at the same
// point, over the host communicator.
std::vector<int> RanksThatAsked(comm::Communicator* world, bool mine);

class Trainer {
 public:
  // REQUIRES: `job` is defaulted and valid; `world`, if given, is the job's world and
  // outlives the Trainer, as does `device_world` (the world's stream-ordered collectives on
  // the device, NCCL; null: the host's, through `world`); every rank constructs its
  // Trainer at the same point (the TP, shard and replica groups form here). Trains on
  // `device` (ChooseDevice picks it from the job's precision), within
  // spec.resources.memoryLimitMiB of device memory, or else $MESHTRAIN_MEMORY_LIMIT_MIB.
  // Throws std::invalid_argument for a job this trainer cannot run (a world other than
  // the communicator's, a malformed limit), TokenFileError for bad data,
  // runtime::OutOfMemory when the limit is too small, runtime::cuda::CudaError for a CUDA
  // device that cannot be used. Checkpoint writers meet rank 0 through `checkpoint_store`
  // (a Store connection of their own; needed where more than one rank writes). `switches`
  // are what tests and benchmarks choose of the engine beyond the spec (devices.h).
  //
  // It resumes from spec.checkpoint.path: with spec.checkpoint.resume, from the newest
  // checkpoint there; without it, from the newest this run wrote (job.metadata.uid's: a
  // gang restart keeps the steps it trained), if the job has a uid. Resuming, each rank
  // reads only its own elements of the newest checkpoint that every
  // rank can read its part of (collective, over `world`); one that a rank cannot read is
  // skipped on every rank with a warning naming it and the ranks. Throws
  // std::invalid_argument, touching nothing, when the newest whole checkpoint there is of
  // another model.
  explicit Trainer(const api::TrainingJob& job, comm::Communicator* world = nullptr,
                   runtime::Device device = runtime::Device::Cpu(), comm::StreamCollectives* device_world = nullptr,
                   comm::StoreClient* checkpoint_store = nullptr, const EngineSwitches& switches = {});

  // Trains from where it stands to spec.training.steps, calling `report` after every
  // step, with a checkpoint every spec.checkpoint.interval steps and after the last (if
  // spec.checkpoint.path is set); returns once the last checkpoint is written. Throws
  // TrainingDiverged at a step whose loss or gradient norm is not finite (without a
  // checkpoint of it), and CheckpointError when the last checkpoint could not be written
  // (earlier ones that fail are logged, and training goes on). Collective.
  //
  // With `stop_requested` (every rank passes one, or none does), after each step the
  // ranks agree (RanksThatAsked) whether any of them was told to stop; if so every rank
  // stops after that same step, writes a checkpoint of it when spec.checkpoint.path is set
  // and the step has none yet, waits until it is written, and returns stopped. Throws
  // CheckpointError when that checkpoint could not be written.
  RunEnd Run(const std::function<void(const StepReport&)>& report,
             const std::function<bool()>& stop_requested = {});

  // The step the Trainer resumed from (a checkpoint found; see the constructor),
  // and why newer checkpoints were skipped.
  std::optional<int64_t> resumed_from() const { return resumed_from_; }
  int64_t steps() const { return job_.spec.training.steps; }
  const std::string& resumed_directory() const { return resumed_directory_; }
  const std::vector<std::string>& checkpoint_warnings() const { return checkpoint_warnings_; }
  CheckpointStats checkpoint_stats() const { return checkpoints_ ? checkpoints_->stats() : CheckpointStats{}; }

  // One optimizer step over the global batch; returns its report (without validation).
  StepReport Step();

  // Mean loss over evalBatches micro-batches from the start of the validation data
  // (the training data if there is none), averaged over the data-parallel ranks.
  double Evaluate();

  // `tokens` tokens sampled from the model after `prompt` (sampler.h). Collective. Throws
  // std::logic_error under context parallelism, whose ranks hold parts of sequences.
  std::vector<uint32_t> Sample(const std::vector<uint32_t>& prompt, int tokens, const SamplingOptions& options);
  // An unprompted sample of `tokens` tokens at temperature 1, as text (TextCodec), or
  // under context parallelism a line that says why there is none. Collective.
  std::string SampleText(int tokens, uint64_t seed);

  MemoryReport memory() const;
  const runtime::MemoryAccounting& accounting() const { return accounting_; }
  int64_t tokens_per_step() const { return tokens_per_step_; }
  runtime::Device device() const { return engine_->device(); }
  // The fp32 master weights, whole, in ParameterLayout order; collective: every rank calls it.
  std::vector<float> Weights() { return engine_->Weights(); }
  // How the model is laid out on this rank.
  std::string Describe() const { return engine_->Describe(); }
  parallel::Engine& model() { return *engine_; }

 private:
  // The mean of `value` over the data-parallel ranks.
  double Average(double value);
  // The weight of each target (engine.h, Forward) in the next `micro_batches` global
  // micro-batches of `data`, whose mean over their unmasked targets a step (or an
  // evaluation) reports: the data-parallel size over their number.
  float TargetWeight(const DataLoader& data, int64_t micro_batches) const;
  // Restores the newest checkpoint under `path` every rank can read, of the run `only_run`
  // unless it is empty; see the constructor.
  void Resume(const std::string& path, const std::string& only_run);
  // The world ranks for which `failed` is true on that rank; collective.
  std::vector<int> FailedRanks(bool failed);
  // A stop's checkpoint: writes one of step_ unless it has one (or step_ is 0), and waits
  // until it is written; true when this call wrote it. Collective. Throws CheckpointError
  // naming `what` when it was not written.
  bool CheckpointNow(const std::string& what);

  api::TrainingJob job_;
  api::ParallelLayout layout_;
  comm::Communicator* world_;
  // Keeps, of each of `batch_` windows of seq_ tokens at `tokens`, the rows this rank
  // holds under context parallelism (api::ContextRows), packed at the front in place.
  void KeepContextRows(int32_t* tokens) const;
  // With spec.data.attention document: the documents of `batch_` windows of seq_ tokens
  // at `tokens` (before KeepContextRows), into `into`; else null.
  const model::Documents* DocumentsOf(const int32_t* tokens, model::Documents* into) const;

  int batch_, seq_;
  int rows_;  // of each window on this rank: seq_, or seq_ / C under context parallelism
  int64_t micro_steps_, tokens_per_step_;
  runtime::MemoryAccounting accounting_;
  std::unique_ptr<parallel::Engine> engine_;
  TextCodec codec_;
  std::optional<DataLoader> train_;  // always set; optional only to be opened in the body
  std::optional<DataLoader> validation_;
  std::vector<int32_t> inputs_, targets_;  // a step's micro-batches, one after another
  DocumentMarks marks_;                     // spec.data.attention document's; empty: causal
  std::vector<model::Documents> documents_;  // each micro-batch's, with marks_
  int64_t step_ = 0;
  std::unique_ptr<CheckpointWriter> checkpoints_;  // null: none written
  int64_t checkpointed_step_ = -1;  // the newest step with a checkpoint (resumed or written); -1: none
  std::optional<int64_t> resumed_from_;
  std::string resumed_directory_;
  std::vector<std::string> checkpoint_warnings_;
};

}  // namespace meshtrain::train
