// The automatic layout planner (spec.parallelism.mode: auto, `meshtrain plan --auto`):
// a search over pipeline stages P (divisors of the world, at most the blocks), tensor
// parallelism T (divisors of the GPUs per node that divide the heads and the MLP width),
// context parallelism C (powers of two up to max_context dividing a stage's TP groups,
// with 2C | seq, no dropout, and for AllToAll C | each TP rank's heads and key/value
// heads; the mode is the spec's contextParallelMode; C > 1 only for a P and T none of
// whose C = 1 layouts that fit keeps every activation), shard groups S (divisors of the
// data-parallel ranks, world / (P x T x C), that form a layout), expert parallelism EP
// (for a mixture of experts only: the divisors of its experts that divide S x C; 1 for a
// dense model, so that its search is what it was), the
// micro-batch (divisors of each rank's sequences per step; with P > 1 only those leaving
// at least P micro-batches, under 1F1B, and under Interleaved1F1B with 2 chunks a stage
// where they are a multiple of P and 2P blocks go round), and activations (keep all,
// checkpointing, or offload with the loading horizon that is fastest), for the job's model
// and global batch on the placed nodes. Each candidate gets the memory model's per-rank
// peak (its worst stage's) and the step model's time (bubble and point-to-point
// included); the fastest that fits in the device's memory, less a margin, wins.
// Thread-safety: pure functions.

#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "api/training_job.h"
#include "operator/scheduler/memory_model.h"
#include "operator/scheduler/step_model.h"

namespace meshtrain::scheduler {

struct PlanRequest {
  api::ModelShape shape;
  int seq = 0;
  int64_t global_batch_tokens = 0;
  Cluster cluster;
  DeviceModel device;
  int max_micro_batch = 64;
  int max_horizon = 8;
  int max_context = 8;                // the largest C tried
  std::string context_mode = "Ring";  // spec.parallelism.contextParallelMode
  bool dropout = false;  // spec.model.dropout > 0: the backward keeps masked copies
};

struct Candidate {
  LayoutChoice choice;
  MemoryPrediction memory;
  StepPrediction step;
  int64_t needed = 0;   // the memory that must fit: the device's, or on the CPU everything
  std::string reason;   // why it does not fit; empty when it does
};

struct Plan {
  std::vector<Candidate> feasible;  // fastest first
  // Per (P, T, C, S, EP) with no feasible candidate, the one needing the least memory and why
  // it does not fit; and how many candidates of the other (P, T, C, S, EP) were left out for memory.
  std::vector<Candidate> rejected;
  int64_t rejected_count = 0;
  int64_t candidates = 0;  // evaluated, feasible or not (an offload counts once, at its best horizon)
  std::map<int, int64_t> candidates_by_context;  // of them, per context degree C tried
  std::map<int, int64_t> candidates_by_expert;   // of them, per expert degree EP tried
  // What the search could not try at all (a batch no micro-batch divides), one line each.
  std::vector<std::string> notes;
  // When nothing fits: SequenceShortfall of the rejected candidate needing the least memory.
  std::string shortfall;
  const Candidate* best() const { return feasible.empty() ? nullptr : &feasible.front(); }
};

// "93.0 GiB", or "21.6 MiB" below a GiB: sizes in the planner's reasons and reports.
std::string MemorySize(int64_t bytes);

// One candidate, predicted. REQUIRES: the choice forms a layout for the request.
Candidate Evaluate(const PlanRequest& request, const LayoutChoice& choice);

Plan PlanLayouts(const PlanRequest& request);

// The contextParallelDegree values that suit `choice` (its P, T and the request's world,
// sequence, model, mode and dropout): powers of two from 1 up to `most`, each dividing a
// stage's TP groups, with 2C | seq, and for AllToAll C | this TP rank's heads and
// key/value heads.
std::vector<int> ContextDegrees(const PlanRequest& request, int stages, int tp, int most);

// The expertParallelDegree values the planner tries with a shard group of `shard_group`
// ranks (S x C): for a mixture of experts, the divisors of its experts that divide
// shard_group (an expert group is consecutive ranks of one); {1} for a dense model.
std::vector<int> ExpertDegrees(const api::ModelShape& shape, int shard_group);

// Where `choice` does not fit a rank: the shortfall in bytes and the least C above its own
// (a power of two up to 64 with 2C | seq, and for AllToAll C | a TP rank's heads and
// key/value heads; the rest of the choice kept, whether or not the world takes that C)
// with which a rank's share of its micro-batch would fit, e.g. "one sequence of 131072 tokens needs 105.4 GiB per
// rank with T=1, S=4, micro-batch 1, checkpointing: 35867590656 bytes more than the
// 72.0 GiB usable; contextParallelDegree 2 (Ring) would need 57.7 GiB per rank". Empty
// when it fits.
std::string SequenceShortfall(const PlanRequest& request, const LayoutChoice& choice);

// The request for `spec` (defaulted, valid) on nodes at `node_paths`.
PlanRequest RequestFor(const api::TrainingJobSpec& spec, std::vector<std::vector<std::string>> node_paths,
                       const LinkModel& links, const DeviceModel& device);

// The device of nodes of EKS instance type `instance_type` (p5.48xlarge, p5e.48xlarge,
// p4d.24xlarge, p4de.24xlarge), or nullptr if none is known. Rates: dense bf16 peak x the
// share of the peak the best GPT-2 training peer reached on an H100 (llm.c with cuDNN
// training GPT-2 124M: about 40%).
const DeviceModel* FindInstanceDevice(const std::string& instance_type);

// The CPU engine's device (fp32, host memory): memory_bytes per rank and a matrix rate.
DeviceModel CpuDevice(int64_t memory_bytes, double matrix_flops);

// `device` as `spec` uses it: its memory capped by spec.resources.memoryLimitMiB (the
// engine's allocator never holds more), and fp32 compute when spec.training.precision is fp32.
DeviceModel AsJobUsesIt(DeviceModel device, const api::TrainingJobSpec& spec);

// The device of a job's placed nodes (AsJobUsesIt): their instance type's
// (FindInstanceDevice, from the node.kubernetes.io/instance-type label), or where no node
// has a known GPU type, the CPU engine's with spec.resources.memoryLimitMiB per rank and a
// nominal matrix rate (kCpuMatrixFlops). nullopt, with the reason in `why`, when neither
// is known.
inline constexpr double kCpuMatrixFlops = 20e9;
std::optional<DeviceModel> DeviceForNodes(const std::vector<std::map<std::string, std::string>>& node_labels,
                                          const api::TrainingJobSpec& spec, std::string* why);

// A spec as written (JSON) with the choice written into spec.parallelism (the pipeline's
// degree and schedule too, its virtual stages where more than 1, the context degree and
// mode, the expert degree) and
// spec.training.microBatchSize, and mode manual: what the workers run. With mode auto
// none of those fields was written (validation), so nothing the user wrote changes.
nlohmann::json ResolveWrittenSpec(nlohmann::json written_spec, const LayoutChoice& choice);

// What status.layout says of the chosen candidate.
api::LayoutStatus LayoutStatusOf(const Candidate& chosen, const DeviceModel& device);

// The layout a spec in manual mode runs: its T, its S (as written or derived), its
// micro-batch, activation policy, pipeline, context degree and mode, and expert degree.
LayoutChoice ChoiceOf(const api::TrainingJobSpec& spec);
// What status.layout says of a layout no planner chose: no device or prediction.
api::LayoutStatus LayoutStatusOf(const LayoutChoice& choice);

}  // namespace meshtrain::scheduler
