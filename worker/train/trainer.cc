#include "worker/train/trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <stdexcept>

#include "api/layout.h"
#include "api/model_shape.h"
#include "api/pipeline.h"
#include "worker/kernels/precision.h"
#include "worker/model/parameters.h"
#include "worker/parallel/activation_store.h"
#include "worker/train/checkpoint_reader.h"
#include "worker/train/devices.h"
#include "worker/train/huggingface.h"
#include "worker/train/safetensors.h"
#include "worker/train/schedule.h"

namespace meshtrain::train {
namespace {

// The job's layout, if this trainer can run it on `ranks` ranks.
api::ParallelLayout SupportedLayout(const api::TrainingJob& job, int ranks) {
  if (job.spec.parallelism.mode == "auto") {
    throw std::invalid_argument(
        "spec.parallelism.mode auto: the layout is chosen when the job is placed (by the operator or meshtrain run), "
        "and the workers get the resolved spec; a worker cannot train an unresolved one");
  }
  const api::ParallelLayout layout = api::ParallelLayout::ForSpec(job.spec);
  if (layout.world() != ranks) {
    throw std::invalid_argument("the job has " + std::to_string(layout.world()) +
                                " ranks (spec.nodes x spec.gpusPerNode) but this trainer runs on " +
                                std::to_string(ranks) + (ranks == 1 ? "; launch it with meshtrain-worker" : ""));
  }
  return layout;
}

// The training data, and the validation data if the job names any, for world rank `rank`.
std::pair<DataLoader, std::optional<DataLoader>> OpenData(const api::TrainingJob& job,
                                                          const api::ParallelLayout& layout, int rank) {
  DataOptions options;
  options.batch = int(job.spec.training.micro_batch_size);
  options.seq = int(*job.spec.model.seq_len);
  options.dp_rank = layout.DataParallelRankOf(rank);
  options.dp_size = layout.data_parallel();
  options.format = ParseTokenFormat(job.spec.data.format);
  options.vocab_size = uint32_t(*job.spec.model.vocab_size);
  options.seed = uint64_t(job.spec.training.seed);
  std::pair<DataLoader, std::optional<DataLoader>> data{DataLoader(job.spec.data.train, options), std::nullopt};
  if (!job.spec.data.validation.empty()) data.second.emplace(job.spec.data.validation, options);
  return data;
}

// spec.data.attention document's marks of a document's start (DocumentMarks), from the
// tokenizer's framing; empty with causal attention. Throws std::invalid_argument naming
// the field when there are none, or when a file of the data holds none in its first
// tokens.
DocumentMarks CheckedMarks(const api::TrainingJob& job, const TextCodec& codec, const DataLoader& train,
                           const std::optional<DataLoader>& validation) {
  if (job.spec.data.attention != "document") return {};
  const text::DocumentFrame frame = codec.frame();
  const DocumentMarks marks = DocumentMarks::Of(frame.before, frame.after);
  if (job.spec.model.tokenizer.empty()) {
    throw std::invalid_argument("spec.data.attention: document needs spec.model.tokenizer, whose framing says where "
                                "documents start");
  }
  if (marks.empty()) {
    throw std::invalid_argument("spec.data.attention: document: the tokenizer of spec.model.tokenizer (" +
                                job.spec.model.tokenizer +
                                ") puts no token before or after a document, so nothing in the data says where one "
                                "starts");
  }
  constexpr uint64_t kScanned = uint64_t(1) << 20;
  for (const DataLoader* data : {&train, validation ? &*validation : nullptr}) {
    if (data == nullptr) continue;
    if (const std::string file = data->FileWithoutDocuments(marks, kScanned); !file.empty()) {
      throw std::invalid_argument(
          "spec.data.attention: document: " + file + " holds no document start in its first " +
          std::to_string(kScanned) + " tokens (" +
          (marks.start ? "token " + std::to_string(*marks.start) + ", which the tokenizer puts before each document"
                       : "a token after " + std::to_string(*marks.end) + ", which the tokenizer puts after each") +
          "): was it written by prepare-data with spec.model.tokenizer?");
    }
  }
  return marks;
}

// The fill with the state a model of `shape` starts from: the weights InitParameters
// gives for `seed`, and AdamW's zeros.
parallel::ShardFill InitialState(const api::ModelShape& shape, uint64_t seed) {
  return [whole = model::ParameterLayout(shape), seed](int, const std::vector<int64_t>& at, float* master, float* m,
                                                       float* v) {
    std::fill(m, m + at.size(), 0.0f);
    std::fill(v, v + at.size(), 0.0f);
    // Initialisation is a function of the single-rank index: each run of consecutive
    // indices initialises at once.
    for (size_t i = 0; i < at.size();) {
      size_t j = i + 1;
      if (at[i] < 0) {
        master[i] = 0;
      } else {
        while (j < at.size() && at[j] == at[j - 1] + 1) ++j;
        model::InitParameterRange(master + i, whole, seed, at[i], at[j - 1] + 1);
      }
      i = j;
    }
  };
}

}  // namespace

void CheckTrainable(const api::TrainingJob& job, int rank, int ranks) {
  const api::ParallelLayout layout = SupportedLayout(job, ranks);
  const api::ModelShape shape = api::ShapeOf(job.spec.model);
  model::ParameterLayout(shape, 0, layout.tp());  // TP must divide the heads and the MLP
  if (!job.spec.model.init.from.empty()) {
    // The files' headers, every tensor's name, shape and dtype: a bad one is found here,
    // on every rank, before the rendezvous.
    try {
      HuggingFaceWeights(job.spec.model.init.from, shape);
    } catch (const SafetensorsError& e) {
      throw std::invalid_argument(std::string("spec.model.init.from: ") + e.what());
    }
  }
  runtime::MemoryLimitFromEnvironment();
  parallel::ActivationStore<kernels::Fp32>::Check(ActivationPolicyOf(job.spec.parallelism));
  const TextCodec codec{job.spec.model};
  const auto [train, validation] = OpenData(job, layout, rank);
  CheckedMarks(job, codec, train, validation);
}

std::string FormatMemory(const MemoryReport& m) {
  return "params " + runtime::FormatMiB(m.params) + ", grads " + runtime::FormatMiB(m.grads) + ", optimizer " +
         runtime::FormatMiB(m.optimizer) + ", activations " + runtime::FormatMiB(m.activations) + ", gathered " +
         runtime::FormatMiB(m.gathered) + (m.offload > 0 ? ", offload " + runtime::FormatMiB(m.offload) : "");
}

std::string FormatStepReport(const StepReport& r) {
  char line[200];
  int n = std::snprintf(line, sizeof line, "step %5lld/%lld | loss %.4f | lr %.2e | norm %.3f | %.0f tok/s",
                        static_cast<long long>(r.step), static_cast<long long>(r.steps), r.loss, r.learning_rate,
                        r.grad_norm, r.tokens_per_second);
  if (r.validation_loss && n > 0 && size_t(n) < sizeof line) {
    n += std::snprintf(line + n, sizeof line - size_t(n), " | val loss %.4f", *r.validation_loss);
  }
  if (r.aux_loss && n > 0 && size_t(n) < sizeof line) {
    n += std::snprintf(line + n, sizeof line - size_t(n), " | aux %.4f", *r.aux_loss);
  }
  std::string text = line;
  if (!r.stage_bubbles.empty()) {
    text += " | bubble by stage";
    for (double b : r.stage_bubbles) text += " " + std::to_string(int(std::lround(100 * b))) + "%";
    text += " (model " + std::to_string(int(std::lround(100 * r.bubble_model))) + "%)";
  }
  if (!r.expert_load.empty()) {
    double worst = 0;
    for (const auto& [block, load] : r.expert_load) worst = std::max(worst, load.imbalance());
    char experts[48];
    std::snprintf(experts, sizeof experts, " | experts max/mean %.2f", worst);
    text += experts;
  }
  return text;
}

Trainer::Trainer(const api::TrainingJob& job, comm::Communicator* world, runtime::Device device,
                 comm::StreamCollectives* device_world, comm::StoreClient* checkpoint_store,
                 const EngineSwitches& switches)
    : job_(job),
      layout_(SupportedLayout(job, world ? world->size() : 1)),
      world_(world),
      batch_(int(job.spec.training.micro_batch_size)),
      seq_(int(*job.spec.model.seq_len)),
      rows_(seq_ / layout_.context()),
      micro_steps_(api::AccumulationSteps(job.spec)),
      tokens_per_step_(job.spec.training.global_batch_tokens),
      engine_(MakeEngine(job, layout_, world, device_world, device, batch_, rows_, &accounting_, switches)),
      codec_(job.spec.model) {
  auto [train, validation] = OpenData(job, layout_, world ? world->rank() : 0);
  train_.emplace(std::move(train));
  validation_ = std::move(validation);
  marks_ = CheckedMarks(job, codec_, *train_, validation_);
  documents_.resize(size_t(micro_steps_));
  const api::CheckpointSpec& checkpoint = job.spec.checkpoint;
  const api::ModelShape shape = api::ShapeOf(job.spec.model);
  if (!checkpoint.path.empty()) {
    if (checkpoint.resume || !job.metadata.uid.empty()) {
      Resume(checkpoint.path, checkpoint.resume ? std::string() : job.metadata.uid);
    }
    const int rank = world ? world->rank() : 0;
    // Rank 0 clears half-written checkpoints before the first step; no rank writes one
    // before that step's collectives, which need rank 0.
    if (rank == 0) CheckpointWriter::RemovePartial(checkpoint.path);
    checkpoints_ = std::make_unique<CheckpointWriter>(
        checkpoint.path, checkpoint.keep, shape, layout_, engine_->vocab_multiple(), rank, checkpoint_store,
        [rank](const std::string& error) { std::fprintf(stderr, "rank %d: error: %s\n", rank, error.c_str()); },
        job.metadata.uid);
  }
  if (!resumed_from_ && !job.spec.model.init.from.empty()) {
    // Each rank reads only its own elements, one unit at a time; AdamW starts from zero.
    try {
      const HuggingFaceWeights weights(job.spec.model.init.from, shape);
      engine_->RestoreShards([&weights](int unit, const std::vector<int64_t>& at, float* master, float* m, float* v) {
        weights.ReadUnit(unit, at, master);
        std::fill(m, m + at.size(), 0.0f);
        std::fill(v, v + at.size(), 0.0f);
      });
    } catch (const SafetensorsError& e) {
      throw std::invalid_argument(std::string("spec.model.init.from: ") + e.what());
    }
  }
  inputs_.resize(size_t(micro_steps_) * size_t(batch_) * size_t(seq_));
  targets_.resize(inputs_.size());
}

void Trainer::Resume(const std::string& path, const std::string& only_run) {
  const api::ModelShape shape = api::ShapeOf(job_.spec.model);
  bool restored_any = false;  // the engine's state is no longer its initial one
  for (const std::string& directory : ResumeCandidates(path)) {
    // Another run's checkpoint is passed over; one whose metadata cannot be read is tried,
    // so that the warning says what is wrong with it. Every rank reads the metadata, and
    // they agree (a rank that read another run's skips it for all), so none waits alone.
    if (!only_run.empty()) {
      const std::optional<std::string> run = CheckpointRun(directory);
      if (!FailedRanks(run && *run != only_run).empty()) continue;
    }
    // The newest whole checkpoint is another model's: the job names another run's
    // directory, whose checkpoints this run's would rotate out. (Every rank reads the
    // same metadata, so every rank throws.)
    if (const std::optional<api::ModelShape> theirs = WholeCheckpointOfAnotherModel(directory, shape)) {
      throw std::invalid_argument("spec.checkpoint.path: " + directory + " is a checkpoint of another model (" +
                                  api::DescribeShape(*theirs) + ") than spec.model (" + api::DescribeShape(shape) +
                                  "); give this job a checkpoint directory of its own");
    }
    std::optional<CheckpointReader> reader;
    std::string error;
    try {
      reader.emplace(directory, shape);
      restored_any = true;
      engine_->RestoreShards([&](int unit, const std::vector<int64_t>& at, float* master, float* m, float* v) {
        reader->ReadUnit(unit, at, master, m, v);
      });
    } catch (const CheckpointError& e) {
      error = e.what();
    }
    const std::vector<int> failed = FailedRanks(!error.empty());
    if (failed.empty()) {
      step_ = reader->position().step;
      train_->set_position(reader->position().data_position);
      resumed_from_ = step_;
      checkpointed_step_ = step_;
      resumed_directory_ = directory;
      return;
    }
    std::string ranks;
    for (int r : failed) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
    checkpoint_warnings_.push_back("skipping checkpoint " + directory + ": " +
                                   (error.empty() ? (failed.size() == 1 ? "rank " : "ranks ") + ranks +
                                                        " could not read " + (failed.size() == 1 ? "its" : "their") +
                                                        " part (" + (failed.size() == 1 ? "its" : "their") +
                                                        " log says why)"
                                                  : error));
    if (!error.empty() && world_ != nullptr && world_->rank() != 0) {
      std::fprintf(stderr, "rank %d: warning: %s\n", world_->rank(), checkpoint_warnings_.back().c_str());
    }
  }
  // No checkpoint could be read: the run starts afresh, from the initial state.
  if (restored_any) engine_->RestoreShards(InitialState(shape, uint64_t(job_.spec.training.seed)));
}

std::vector<int> RanksThatAsked(comm::Communicator* world, bool mine) {
  if (world == nullptr || world->size() == 1) return mine ? std::vector<int>{world ? world->rank() : 0} : std::vector<int>{};
  // One number first, as it is asked after every step: which ranks, only when any did.
  double any = mine ? 1.0 : 0.0;
  world->AllReduce(&any, &any, 1, comm::DataType::kFloat64, comm::ReduceOp::kSum)->Wait();
  if (any == 0) return {};
  std::vector<double> flags(size_t(world->size()), 0.0);
  flags[size_t(world->rank())] = mine ? 1.0 : 0.0;
  world->AllReduce(flags.data(), flags.data(), flags.size(), comm::DataType::kFloat64, comm::ReduceOp::kSum)->Wait();
  std::vector<int> ranks;
  for (size_t r = 0; r < flags.size(); ++r) {
    if (flags[r] > 0) ranks.push_back(int(r));
  }
  return ranks;
}

std::vector<int> Trainer::FailedRanks(bool failed) { return RanksThatAsked(world_, failed); }

StepReport Trainer::Step() {
  const auto start = std::chrono::steady_clock::now();
  const api::TrainingSpec& t = job_.spec.training;
  StepReport report;
  report.steps = t.steps;
  const parallel::CommStats comm_before = engine_->comm_stats();
  engine_->ZeroGrad();
  // The step's loss is the mean over the global batch's targets: each weighs the
  // data-parallel size over their number (the replicas' gradients are averaged).
  const float weight = TargetWeight(*train_, micro_steps_);
  const size_t tokens = size_t(batch_) * size_t(seq_);
  std::vector<parallel::MicroBatch> micro_batches;
  for (int64_t micro = 0; micro < micro_steps_; ++micro) {
    int32_t* inputs = inputs_.data() + size_t(micro) * tokens;
    int32_t* targets = targets_.data() + size_t(micro) * tokens;
    train_->Next(inputs, targets);
    const model::Documents* documents = DocumentsOf(inputs, &documents_[size_t(micro)]);
    KeepContextRows(inputs);
    KeepContextRows(targets);
    micro_batches.push_back({inputs, targets, batch_, rows_, {step_, micro}, weight, documents});
  }
  engine_->ForwardBackward(micro_batches);
  report.learning_rate = LearningRate(t, step_);
  ++step_;
  parallel::OptimizerStep update;
  update.learning_rate = float(report.learning_rate);
  update.weight_decay = float(t.weight_decay);
  update.max_norm = float(t.grad_clip);
  update.t = step_;
  engine_->Update(update);
  report.loss = Average(engine_->TakeLoss());  // the one wait of the step
  report.grad_norm = engine_->GradNorm();
  report.aux_loss = engine_->TakeAuxLoss();
  report.step = step_;
  report.comm = engine_->comm_stats() - comm_before;
  for (const auto& [block, counts] : engine_->TakeExpertCounts()) {
    StepReport::ExpertLoad& load = report.expert_load[block];
    for (int64_t c : counts) load.max = std::max(load.max, double(c)), load.mean += double(c);
    if (!counts.empty()) load.mean /= double(counts.size());
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  report.seconds = seconds;
  report.tokens_per_second = double(tokens_per_step_) / seconds;
  if (layout_.pipeline() > 1) {
    // Each rank's share of the step spent waiting on its neighbours; a stage's is its ranks' mean.
    std::vector<double> waits(size_t(layout_.world()), 0.0);
    waits[size_t(world_->rank())] = report.comm.neighbour_wait / seconds;
    world_->AllReduce(waits.data(), waits.data(), waits.size(), comm::DataType::kFloat64, comm::ReduceOp::kSum)->Wait();
    report.stage_bubbles.assign(size_t(layout_.pipeline()), 0.0);
    for (int rank = 0; rank < layout_.world(); ++rank) {
      report.stage_bubbles[size_t(layout_.StageOf(rank))] += waits[size_t(rank)] / layout_.stage_ranks();
    }
    report.bubble_model = api::BubbleFraction(api::Pipeline::Of(job_.spec.parallelism), int(micro_steps_));
  }
  return report;
}

float Trainer::TargetWeight(const DataLoader& data, int64_t micro_batches) const {
  // A global batch with no target at all (every one masked) adds nothing: any weight does.
  // The gradients are averaged over the ranks that reduce them, the context ranks too.
  const int64_t targets = std::max<int64_t>(1, data.GlobalTargets(micro_batches));
  return float(double(layout_.data_parallel()) * layout_.context() / double(targets));
}

const model::Documents* Trainer::DocumentsOf(const int32_t* tokens, model::Documents* into) const {
  if (marks_.empty()) return nullptr;
  into->starts.resize(size_t(batch_));
  for (int b = 0; b < batch_; ++b) into->starts[size_t(b)] = marks_.Starts(tokens + size_t(b) * size_t(seq_), seq_);
  return into;
}

void Trainer::KeepContextRows(int32_t* tokens) const {
  if (layout_.context() == 1) return;
  // Each row moves to a place no later than its own, and rows move in order: in place.
  const api::ContextRows rows(seq_, layout_.ContextRankOf(world_->rank()), layout_.context());
  for (int b = 0; b < batch_; ++b) {
    for (int i = 0; i < rows_; ++i) {
      tokens[size_t(b) * size_t(rows_) + size_t(i)] = tokens[size_t(b) * size_t(seq_) + size_t(rows.Position(i))];
    }
  }
}

double Trainer::Average(double value) {
  if (world_ == nullptr || world_->size() == 1) return value;
  double mean = value;
  world_->AllReduce(&mean, &mean, 1, comm::DataType::kFloat64, comm::ReduceOp::kAverage)->Wait();
  return mean;
}

RunEnd Trainer::Run(const std::function<void(const StepReport&)>& report,
                    const std::function<bool()>& stop_requested) {
  const api::TrainingSpec& t = job_.spec.training;
  const bool trains = step_ < t.steps;
  RunEnd end;
  while (step_ < t.steps) {
    if (stop_requested) {
      // Agreed after each step (and before the first): every rank stops after the same one.
      end.asked = RanksThatAsked(world_, stop_requested());
      if (!end.asked.empty()) {
        end.stopped = true;
        end.step = step_;
        if (checkpoints_) {
          end.wrote = CheckpointNow("the checkpoint before stopping, of step " + std::to_string(step_));
          end.checkpointed = step_ > 0;
        }
        return end;
      }
    }
    StepReport r = Step();
    // A diverged model is worth no checkpoint: stop before one rotates a good one out.
    // Every rank has the same loss and norm (both global), so every rank stops here.
    if (!std::isfinite(r.loss) || !std::isfinite(r.grad_norm)) {
      char line[200];
      std::snprintf(line, sizeof line,
                    "step %lld: the loss is %g and the gradient norm %g at learning rate %g: training diverged; "
                    "stopped without a checkpoint of it",
                    static_cast<long long>(r.step), r.loss, r.grad_norm, r.learning_rate);
      throw TrainingDiverged(line);
    }
    const bool last = r.step == t.steps;
    if (last || (t.eval_interval > 0 && r.step % t.eval_interval == 0)) r.validation_loss = Evaluate();
    if (checkpoints_ && (last || r.step % job_.spec.checkpoint.interval == 0)) {
      r.checkpoint_stall =
          checkpoints_->Save({step_, train_->position()}, [this](parallel::ShardState* into) { engine_->Snapshot(into); });
      checkpointed_step_ = step_;
    }
    report(r);
  }
  end.step = step_;
  if (!checkpoints_) return end;
  checkpoints_->Wait();
  // The final checkpoint is what the run leaves behind: without it the run has failed.
  if (const std::vector<int> failed = FailedRanks(trains && checkpoints_->stats().last_step != t.steps);
      !failed.empty()) {
    const std::string error = checkpoints_->stats().last_error;
    throw CheckpointError("the final checkpoint, of step " + std::to_string(t.steps) + " under " +
                          job_.spec.checkpoint.path + ", was not written: " +
                          (error.empty() ? "rank " + std::to_string(failed[0]) + " failed to write it" : error));
  }
  return end;
}

bool Trainer::CheckpointNow(const std::string& what) {
  if (step_ == 0) return false;  // nothing trained: the initial state needs no checkpoint
  const bool write = checkpointed_step_ != step_;
  if (write) {
    checkpoints_->Save({step_, train_->position()}, [this](parallel::ShardState* into) { engine_->Snapshot(into); });
    checkpointed_step_ = step_;
  }
  checkpoints_->Wait();
  // A step this run saved (now, or at its interval a moment ago) must have been written;
  // the step it resumed from was read whole.
  if (resumed_from_ == step_) return false;
  if (const std::vector<int> failed = FailedRanks(checkpoints_->stats().last_step != step_); !failed.empty()) {
    const std::string error = checkpoints_->stats().last_error;
    throw CheckpointError(what + " under " + job_.spec.checkpoint.path + ", was not written: " +
                          (error.empty() ? "rank " + std::to_string(failed[0]) + " failed to write it" : error));
  }
  return write;
}

double Trainer::Evaluate() {
  DataLoader& data = validation_ ? *validation_ : *train_;
  const uint64_t saved = data.position();
  data.set_position(0);
  const int64_t batches = job_.spec.training.eval_batches;
  const float weight = TargetWeight(data, batches);
  for (int64_t i = 0; i < batches; ++i) {
    data.Next(inputs_.data(), targets_.data());
    model::Documents documents;
    const model::Documents* in = DocumentsOf(inputs_.data(), &documents);
    KeepContextRows(inputs_.data());
    KeepContextRows(targets_.data());
    engine_->Forward(inputs_.data(), targets_.data(), batch_, rows_, nullptr, weight, in);
  }
  data.set_position(saved);
  return Average(engine_->TakeLoss());
}

std::vector<uint32_t> Trainer::Sample(const std::vector<uint32_t>& prompt, int tokens, const SamplingOptions& options) {
  if (layout_.context() > 1) {
    throw std::logic_error("sampling needs whole sequences on a rank; this job splits them over " +
                           std::to_string(layout_.context()) + " (spec.parallelism.contextParallelDegree)");
  }
  return SampleTokens(*engine_, prompt, tokens, seq_, int(*job_.spec.model.vocab_size), options);
}

std::string Trainer::SampleText(int tokens, uint64_t seed) {
  if (layout_.context() > 1) {
    return "(no sample: spec.parallelism.contextParallelDegree " + std::to_string(layout_.context()) +
           " splits each sequence over ranks; `meshtrain sample` samples the checkpoint on one)";
  }
  SamplingOptions options;
  options.seed = seed;
  options.vocabulary = codec_.vocabulary();
  options.stop = codec_.Stop();  // a sample ends where the model ends its text
  return codec_.Decode(Sample(codec_.Start(), tokens, options));
}

MemoryReport Trainer::memory() const {
  using runtime::MemoryCategory;
  return {accounting_.peak(MemoryCategory::kParams), accounting_.peak(MemoryCategory::kGrads),
          accounting_.peak(MemoryCategory::kOptimizer), accounting_.peak(MemoryCategory::kActivations),
          accounting_.peak(MemoryCategory::kGathered), accounting_.peak(MemoryCategory::kOffload)};
}

}  // namespace meshtrain::train
