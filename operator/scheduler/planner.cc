#include "operator/scheduler/planner.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <utility>

#include "api/layout.h"
#include "api/model_family.h"
#include "api/pipeline.h"

namespace meshtrain::scheduler {
namespace {

std::vector<int> Divisors(int64_t n, int64_t at_most) {
  std::vector<int> out;
  for (int64_t d = 1; d <= std::min(n, at_most); ++d) {
    if (n % d == 0) out.push_back(int(d));
  }
  return out;
}

// Faster first; equal times (to a part in a million), the one needing less memory.
bool Better(const Candidate& a, const Candidate& b) {
  const double ta = a.step.seconds, tb = b.step.seconds;
  if (std::abs(ta - tb) > 1e-6 * std::max(ta, tb)) return ta < tb;
  return a.needed < b.needed;
}

}  // namespace

std::string MemorySize(int64_t bytes) {
  char text[32];
  const bool gib = bytes >= int64_t(1) << 30;
  std::snprintf(text, sizeof text, "%.1f %s", double(bytes) / double(int64_t(1) << (gib ? 30 : 20)), gib ? "GiB" : "MiB");
  return text;
}

static Float8Memory Float8Of(const DeviceModel& device) {
  if (!device.float8) return Float8Memory::kNone;
  return device.float8_rowwise ? Float8Memory::kRowwise : Float8Memory::kTensorwise;
}

Candidate Evaluate(const PlanRequest& r, const LayoutChoice& choice) {
  Candidate c;
  c.choice = choice;
  const int64_t data_parallel =
      int64_t(r.cluster.nodes) * r.cluster.gpus_per_node / (choice.pipeline.stages * choice.tp * choice.context);
  const int64_t micro_batches = r.global_batch_tokens / (int64_t(choice.micro_batch) * r.seq * data_parallel);
  c.memory = PredictMemory(r.shape, r.seq, choice, r.device.compute_bytes, r.device.memory_is_host, r.dropout,
                           int(micro_batches), Float8Of(r.device));
  c.step = PredictStep(r.shape, r.seq, r.global_batch_tokens, choice, r.cluster, r.device);
  c.needed = r.device.memory_is_host ? c.memory.total() : c.memory.device();
  if (c.needed > r.device.Usable()) {
    const std::string stage =
        choice.pipeline.stages > 1 ? " (stage " + std::to_string(c.memory.stage) + " holds the most)" : "";
    c.reason = "needs " + MemorySize(c.needed) + " per rank with " + Describe(choice) + stage + "; the " +
               r.device.name + " has " + MemorySize(r.device.memory_bytes) + " (" + MemorySize(r.device.Usable()) +
               " usable with a " + std::to_string(int(r.device.margin * 100 + 0.5)) + "% margin)";
  }
  return c;
}

std::vector<int> ContextDegrees(const PlanRequest& r, int stages, int tp, int most) {
  const int64_t tp_groups = int64_t(r.cluster.nodes) * r.cluster.gpus_per_node / (int64_t(stages) * tp);
  const int64_t heads = r.shape.heads / tp, kv_heads = r.shape.KvHeads() / tp;
  std::vector<int> out = {1};
  if (r.dropout) return out;  // dropout's masks are not split by sequence chunk
  for (int C = 2; C <= most; C *= 2) {
    if (tp_groups % C != 0 || r.seq % (2 * C) != 0) continue;
    if (r.context_mode == "AllToAll" && (heads % C != 0 || kv_heads % C != 0)) continue;
    out.push_back(C);
  }
  return out;
}

std::vector<int> ExpertDegrees(const api::ModelShape& shape, int shard_group) {
  if (shape.experts <= 1) return {1};
  std::vector<int> out;
  for (int EP : Divisors(shape.experts, shard_group)) {
    if (shard_group % EP == 0) out.push_back(EP);
  }
  return out;
}

std::string SequenceShortfall(const PlanRequest& r, const LayoutChoice& choice) {
  const Candidate c = Evaluate(r, choice);
  if (c.reason.empty()) return "";
  const int64_t usable = r.device.Usable();
  const std::string sequences =
      choice.micro_batch == 1 ? "one sequence" : std::to_string(choice.micro_batch) + " sequences";
  std::string text = sequences + " of " + std::to_string(r.seq) + " tokens needs " + MemorySize(c.needed) +
                     " per rank with " + Describe(choice) + ": " + std::to_string(c.needed - usable) +
                     " bytes more than the " + MemorySize(usable) + " usable";
  // The micro-batches the choice's step has, which set what a pipeline stage keeps.
  const int64_t data_parallel =
      int64_t(r.cluster.nodes) * r.cluster.gpus_per_node / (choice.pipeline.stages * choice.tp * choice.context);
  const int micro_batches = int(r.global_batch_tokens / (int64_t(choice.micro_batch) * r.seq * data_parallel));
  const int64_t heads = r.shape.heads / choice.tp, kv_heads = r.shape.KvHeads() / choice.tp;
  const int64_t tp_groups =
      int64_t(r.cluster.nodes) * r.cluster.gpus_per_node / (int64_t(choice.pipeline.stages) * choice.tp);
  const std::string dropout = r.dropout ? " and spec.model.dropout 0" : "";
  int tried = choice.context;
  for (int C = choice.context * 2; C <= 64; C *= 2) {
    if (r.seq % (2 * C) != 0) break;
    if (choice.context_mode == "AllToAll" && (heads % C != 0 || kv_heads % C != 0)) break;
    tried = C;
    LayoutChoice wider = choice;
    wider.context = C;
    const MemoryPrediction m = PredictMemory(r.shape, r.seq, wider, r.device.compute_bytes, r.device.memory_is_host,
                                             r.dropout, micro_batches, Float8Of(r.device));
    const int64_t needed = r.device.memory_is_host ? m.total() : m.device();
    if (needed <= usable) {
      const std::string ranks =
          tp_groups % C == 0 ? "" : ", on more ranks: a stage here has " + std::to_string(tp_groups) + " TP groups";
      return text + "; contextParallelDegree " + std::to_string(C) + " (" + wider.context_mode + ")" + dropout +
             " would need " + MemorySize(needed) + " per rank" + ranks;
    }
  }
  return text + "; no contextParallelDegree the sequence takes (up to " + std::to_string(tried) + ") makes it fit";
}

namespace {

// The pipelines of P stages the planner tries for a step of `micro_batches`: for P = 1 the
// one stage; else 1F1B, given at least P micro-batches, and Interleaved1F1B with two
// chunks a stage where the micro-batches are a multiple of P and the blocks go round
// twice. Never GPipe: its bubble is 1F1B's, and it keeps every micro-batch's activations.
std::vector<api::Pipeline> PipelinesFor(int stages, int64_t micro_batches, int layers) {
  if (stages == 1) return {api::Pipeline{}};
  std::vector<api::Pipeline> out;
  if (micro_batches < stages) return out;
  out.push_back({stages, 1, api::PipelineSchedule::kOneFOneB});
  if (2 * stages <= layers && micro_batches % stages == 0) out.push_back({stages, 2, api::PipelineSchedule::kInterleaved});
  return out;
}

// The fewest blocks a chunk of `pipeline` holds: offloading needs a block beyond the horizon.
int FewestBlocks(const api::ModelShape& shape, int seq, const api::Pipeline& pipeline) {
  const std::vector<int> first = api::SplitBlocks(shape, seq, pipeline.chunks());
  int fewest = int(shape.layers);
  for (size_t c = 0; c + 1 < first.size(); ++c) fewest = std::min(fewest, first[c + 1] - first[c]);
  return fewest;
}

}  // namespace

namespace {

// Every S, micro-batch, pipeline schedule and activation policy of P = stages, T = tp and
// C = context, evaluated into `plan`. Returns whether one of them that fits keeps every
// activation (no checkpointing).
bool SearchLayouts(const PlanRequest& r, int stages, int tp, int context, Plan& plan) {
  const int world = r.cluster.nodes * r.cluster.gpus_per_node;
  const int layers = int(r.shape.layers);
  const std::string prefix = (stages > 1 ? "P=" + std::to_string(stages) + ", " : "") + "T=" + std::to_string(tp) +
                             (context > 1 ? ", C=" + std::to_string(context) : "");
  const int dp = world / (stages * tp * context);
  const int64_t per_sequence = int64_t(r.seq) * dp;
  if (r.global_batch_tokens % per_sequence != 0) {
    plan.notes.push_back(prefix + ": the global batch of " + std::to_string(r.global_batch_tokens) +
                         " tokens is not a whole number of sequences of " + std::to_string(r.seq) + " for each of " +
                         std::to_string(dp) + " data-parallel ranks");
    return false;
  }
  const int64_t sequences = r.global_batch_tokens / per_sequence;
  if (sequences < stages) {
    plan.notes.push_back(prefix + ": " + std::to_string(sequences) +
                         " sequence(s) a data-parallel rank per step, fewer micro-batches than the " +
                         std::to_string(stages) + " stages at any micro-batch size");
    return false;
  }
  bool keeps_all = false;
  for (int shard : Divisors(dp, dp)) {
    for (int expert : ExpertDegrees(r.shape, shard * context)) {
      if (!api::ParallelLayout::Check(r.cluster.nodes, r.cluster.gpus_per_node, tp, shard, stages, context, expert)
               .empty()) {
        continue;
      }
      bool any_fits = false;
      const int64_t feasible_before = int64_t(plan.feasible.size());
      int64_t rejected = 0;
      std::optional<Candidate> least;  // of the rejected, the one needing the least memory
      for (int micro : Divisors(sequences, r.max_micro_batch)) {
        for (const api::Pipeline& pipeline : PipelinesFor(stages, sequences / micro, layers)) {
          const LayoutChoice base{tp, shard, micro, {}, pipeline, context, r.context_mode, expert};
          auto with = [&](api::ActivationPolicy activations) {
            LayoutChoice choice = base;
            choice.activations = activations;
            return Evaluate(r, choice);
          };
          std::vector<Candidate> options = {with({false, false, 2}), with({true, false, 2})};
          // Offload: the horizon that is fastest among those that fit (or, if none fits, the smallest).
          std::optional<Candidate> offload;
          const int blocks = stages > 1 ? FewestBlocks(r.shape, r.seq, pipeline) : layers;
          for (int h = 1; h <= std::min(r.max_horizon, blocks - 1); ++h) {
            Candidate c = with({true, true, h});
            const bool better = !offload || (c.reason.empty() && (!offload->reason.empty() || Better(c, *offload)));
            if (better) offload = std::move(c);
          }
          if (offload) options.push_back(std::move(*offload));
          for (Candidate& c : options) {
            if (c.reason.empty()) {
              any_fits = true;
              keeps_all |= !c.choice.activations.checkpointing;
              plan.feasible.push_back(std::move(c));
              continue;
            }
            ++rejected;
            if (!least || c.needed < least->needed) least = std::move(c);
          }
        }
      }
      plan.candidates += int64_t(plan.feasible.size()) - feasible_before + rejected;
      plan.candidates_by_context[context] += int64_t(plan.feasible.size()) - feasible_before + rejected;
      plan.candidates_by_expert[expert] += int64_t(plan.feasible.size()) - feasible_before + rejected;
      if (any_fits) plan.rejected_count += rejected;
      else if (least) plan.rejected.push_back(std::move(*least));
    }
  }
  return keeps_all;
}

}  // namespace

Plan PlanLayouts(const PlanRequest& r) {
  Plan plan;
  const int world = r.cluster.nodes * r.cluster.gpus_per_node;
  // P stages of at least one block each, outermost; P = 1 first.
  for (int stages : Divisors(world, r.shape.layers)) {
    for (int tp : Divisors(r.cluster.gpus_per_node, r.cluster.gpus_per_node)) {
      // T splits the query and key/value heads and the MLP's units: one that does not divide
      // them is never offered.
      if (!api::TensorParallelDivides(r.shape, tp)) continue;
      if (world % (stages * tp) != 0) continue;
      // Sequences are split only where they are long: where no rank of this P and T keeps
      // every activation of its sequences.
      if (SearchLayouts(r, stages, tp, 1, plan)) continue;
      for (int context : ContextDegrees(r, stages, tp, r.max_context)) {
        if (context > 1) SearchLayouts(r, stages, tp, context, plan);
      }
    }
  }
  std::sort(plan.feasible.begin(), plan.feasible.end(), Better);
  if (plan.feasible.empty() && !plan.rejected.empty()) {
    const auto least = std::min_element(plan.rejected.begin(), plan.rejected.end(),
                                        [](const Candidate& a, const Candidate& b) { return a.needed < b.needed; });
    plan.shortfall = SequenceShortfall(r, least->choice);
  }
  return plan;
}

PlanRequest RequestFor(const api::TrainingJobSpec& spec, std::vector<std::vector<std::string>> node_paths,
                       const LinkModel& links, const DeviceModel& device) {
  PlanRequest r;
  r.shape = api::ShapeOf(spec.model);
  r.seq = int(r.shape.seq_len);
  r.global_batch_tokens = spec.training.global_batch_tokens;
  r.dropout = spec.model.dropout > 0;
  r.context_mode = spec.parallelism.context_parallel_mode;
  r.cluster.nodes = int(spec.nodes);
  r.cluster.gpus_per_node = int(spec.gpus_per_node);
  r.cluster.node_paths = std::move(node_paths);
  r.cluster.links = links;
  r.device = device;
  return r;
}

const DeviceModel* FindInstanceDevice(const std::string& instance_type) {
  // Dense bf16 peaks (989 TFLOP/s H100 and H200 SXM, 312 A100) x 0.40, the share of the
  // peak that llm.c with cuDNN's flash attention reached training GPT-2 124M (bf16, B16 x
  // T1024) on one H100 80GB: 487k tokens/s, about 396 TFLOP/s by 6N + 12LTC, measured in
  // November 2026 beside torch.compile's 38%.
  // Copies over PCIe gen5 (gen4 on A100) at about 80% of the link; HBM at 80% of its peak.
  // Float8: Hopper's dense float8 peak is twice its bf16 one (1979 TFLOP/s); the A100 has none.
  static const std::map<std::string, DeviceModel> kDevices = {
      {"p5.48xlarge", {"H100 80GB (p5.48xlarge)", 80LL << 30, 0.1, false, 2, 0.40 * 989e12, {}, 1, 50e9, 2.7e12, 2.0}},
      {"p5e.48xlarge", {"H200 141GB (p5e.48xlarge)", 141LL << 30, 0.1, false, 2, 0.40 * 989e12, {}, 1, 50e9, 3.8e12, 2.0}},
      {"p5en.48xlarge", {"H200 141GB (p5en.48xlarge)", 141LL << 30, 0.1, false, 2, 0.40 * 989e12, {}, 1, 50e9, 3.8e12, 2.0}},
      {"p4d.24xlarge", {"A100 40GB (p4d.24xlarge)", 40LL << 30, 0.1, false, 2, 0.40 * 312e12, {}, 1, 25e9, 1.2e12}},
      {"p4de.24xlarge", {"A100 80GB (p4de.24xlarge)", 80LL << 30, 0.1, false, 2, 0.40 * 312e12, {}, 1, 25e9, 1.6e12}},
  };
  const auto it = kDevices.find(instance_type);
  return it == kDevices.end() ? nullptr : &it->second;
}

DeviceModel CpuDevice(int64_t memory_bytes, double matrix_flops) {
  // Copies and the optimizer stream through host memory at a few GB/s per rank.
  return {"CPU", memory_bytes, 0.1, true, 4, matrix_flops, {}, 1, 4e9, 4e9};
}

DeviceModel AsJobUsesIt(DeviceModel device, const api::TrainingJobSpec& spec) {
  if (spec.resources.memory_limit_mib) {
    device.memory_bytes = std::min(device.memory_bytes, *spec.resources.memory_limit_mib << 20);
  }
  if (spec.training.precision == "fp32") device.compute_bytes = 4;
  device.float8 = spec.training.precision == "fp8";
  device.float8_rowwise = device.float8 && spec.training.float8.recipe == "rowwise";
  return device;
}

std::optional<DeviceModel> DeviceForNodes(const std::vector<std::map<std::string, std::string>>& node_labels,
                                          const api::TrainingJobSpec& spec, std::string* why) {
  static const std::string kInstanceType = "node.kubernetes.io/instance-type";
  std::optional<DeviceModel> found;
  for (const auto& labels : node_labels) {
    const auto type = labels.find(kInstanceType);
    if (type == labels.end()) continue;
    const DeviceModel* device = FindInstanceDevice(type->second);
    if (device == nullptr) continue;
    // Mixed types: plan for the one with the least memory.
    if (!found || device->memory_bytes < found->memory_bytes) found = *device;
  }
  if (found) return AsJobUsesIt(*found, spec);
  if (spec.resources.memory_limit_mib) {
    return CpuDevice(*spec.resources.memory_limit_mib << 20, kCpuMatrixFlops);
  }
  *why = "spec.parallelism.mode auto needs each rank's memory: the nodes' " + kInstanceType +
         " is none the planner knows (p5.48xlarge, p5e.48xlarge, p5en.48xlarge, p4d.24xlarge, p4de.24xlarge) and "
         "spec.resources.memoryLimitMiB is not set";
  return std::nullopt;
}

nlohmann::json ResolveWrittenSpec(nlohmann::json written, const LayoutChoice& choice) {
  nlohmann::json& p = written["parallelism"];
  p["mode"] = "manual";
  p["tensorParallelDegree"] = choice.tp;
  p["hybridShardDegree"] = choice.shard;
  p["activationCheckpointing"] = choice.activations.checkpointing;
  p["activationOffloading"] = choice.activations.offload;
  if (choice.activations.offload) p["activationLoadingHorizon"] = choice.activations.horizon;
  p["pipelineParallelDegree"] = choice.pipeline.stages;
  p["pipelineSchedule"] = api::PipelineScheduleName(choice.pipeline.schedule);
  if (choice.pipeline.virtual_stages > 1) p["pipelineVirtualStages"] = choice.pipeline.virtual_stages;
  p["contextParallelDegree"] = choice.context;
  if (choice.context > 1) p["contextParallelMode"] = choice.context_mode;
  p["expertParallelDegree"] = choice.expert;
  written["training"]["microBatchSize"] = choice.micro_batch;
  return written;
}

api::LayoutStatus LayoutStatusOf(const LayoutChoice& c) {
  api::LayoutStatus status;
  status.tensor_parallel_degree = c.tp;
  status.hybrid_shard_degree = c.shard;
  status.pipeline_parallel_degree = c.pipeline.stages;
  status.pipeline_schedule = api::PipelineScheduleName(c.pipeline.schedule);
  status.pipeline_virtual_stages = c.pipeline.virtual_stages;
  status.micro_batch_size = c.micro_batch;
  status.activation_checkpointing = c.activations.checkpointing;
  status.activation_offloading = c.activations.offload;
  status.activation_loading_horizon = c.activations.offload ? c.activations.horizon : 0;
  status.context_parallel_degree = c.context;
  status.context_parallel_mode = c.context_mode;
  status.expert_parallel_degree = c.expert;
  return status;
}

api::LayoutStatus LayoutStatusOf(const Candidate& chosen, const DeviceModel& device) {
  api::LayoutStatus status = LayoutStatusOf(chosen.choice);
  status.device = device.name;
  status.predicted_memory_bytes = chosen.needed;
  status.predicted_step_seconds = chosen.step.seconds;
  status.predicted_tokens_per_second = chosen.step.tokens_per_second;
  return status;
}

LayoutChoice ChoiceOf(const api::TrainingJobSpec& spec) {
  const api::ParallelLayout layout = api::ParallelLayout::ForSpec(spec);
  const api::ParallelismSpec& p = spec.parallelism;
  return {int(layout.tp()),
          int(layout.shard() / layout.context()),
          int(spec.training.micro_batch_size),
          {p.activation_checkpointing, p.activation_offloading, int(p.activation_loading_horizon)},
          api::Pipeline::Of(p),
          int(layout.context()),
          p.context_parallel_mode,
          int(layout.expert())};
}

}  // namespace meshtrain::scheduler
