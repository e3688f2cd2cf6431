#include "cli/plan_report.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>

#include "api/layout.h"
#include "api/pipeline.h"

namespace meshtrain::cli {
namespace {

// "395.6 TFLOP/s", or "20.0 GFLOP/s" below a TFLOP/s.
std::string Rate(double flops) {
  char text[32];
  const bool tera = flops >= 1e12;
  std::snprintf(text, sizeof text, "%.1f %s", flops / (tera ? 1e12 : 1e9), tera ? "TFLOP/s" : "GFLOP/s");
  return text;
}

nlohmann::json CandidateJson(const scheduler::Candidate& c) {
  const scheduler::LayoutChoice& l = c.choice;
  nlohmann::json j = {{"pipelineParallelDegree", l.pipeline.stages},
                      {"pipelineSchedule", api::PipelineScheduleName(l.pipeline.schedule)},
                      {"pipelineVirtualStages", l.pipeline.virtual_stages},
                      {"tensorParallelDegree", l.tp},
                      {"hybridShardDegree", l.shard},
                      {"contextParallelDegree", l.context},
                      {"microBatchSize", l.micro_batch},
                      {"activationCheckpointing", l.activations.checkpointing},
                      {"activationOffloading", l.activations.offload},
                      {"memoryBytes", c.needed},
                      {"stepSeconds", c.step.seconds},
                      {"tokensPerSecond", c.step.tokens_per_second},
                      {"exposedSeconds", c.step.exposed_seconds},
                      {"microSteps", c.step.micro_steps},
                      {"bubble", c.step.bubble},
                      {"p2pBytesPerStep", c.step.p2p_bytes},
                      {"p2pSeconds", c.step.p2p_seconds},
                      {"contextSeconds", c.step.context_seconds},
                      {"expertParallelDegree", l.expert},
                      {"expertSeconds", c.step.expert_seconds},
                      {"expertBytesPerStep", c.step.expert_bytes}};
  if (l.context > 1) j["contextParallelMode"] = l.context_mode;
  if (l.activations.offload) j["activationLoadingHorizon"] = l.activations.horizon;
  if (!c.reason.empty()) j["rejected"] = c.reason;
  return j;
}

// Per degree tried (of `member`: C or EP): how many candidates fit, and the fastest of
// them, or the one needing the least memory and why it does not fit.
void PrintDegrees(const scheduler::Plan& plan, const std::map<int, int64_t>& tried, int scheduler::LayoutChoice::*member,
                  const std::string& title, const std::string& name, std::ostream& out) {
  out << "  by " << title << ":\n";
  for (const auto& [degree, candidates] : tried) {
    const auto of_c = [degree, member](const scheduler::Candidate& c) { return c.choice.*member == degree; };
    const int64_t fit = std::count_if(plan.feasible.begin(), plan.feasible.end(), of_c);
    out << "    " << name << "=" << degree << ": " << fit << " of " << candidates << " candidates fit";
    if (const auto fastest = std::find_if(plan.feasible.begin(), plan.feasible.end(), of_c);
        fastest != plan.feasible.end()) {
      char seconds[32];
      std::snprintf(seconds, sizeof seconds, "%.4f s", fastest->step.seconds);
      out << "; the fastest " << scheduler::Describe(fastest->choice) << ", " << seconds << " a step\n";
      continue;
    }
    const scheduler::Candidate* least = nullptr;
    for (const scheduler::Candidate& c : plan.rejected) {
      if (of_c(c) && (least == nullptr || c.needed < least->needed)) least = &c;
    }
    out << (least ? "; the least " + least->reason : "") << "\n";
  }
}

}  // namespace

std::optional<scheduler::DeviceModel> PlanDevice(const std::string& flag, const api::TrainingJobSpec& spec,
                                                 const std::vector<std::map<std::string, std::string>>& node_labels,
                                                 std::string* why) {
  if (flag.empty()) return scheduler::DeviceForNodes(node_labels, spec, why);
  if (flag == "cpu") {
    if (!spec.resources.memory_limit_mib) {
      *why = "--device cpu: the planner needs each rank's memory; set spec.resources.memoryLimitMiB";
      return std::nullopt;
    }
    return scheduler::CpuDevice(*spec.resources.memory_limit_mib << 20, scheduler::kCpuMatrixFlops);
  }
  if (const scheduler::DeviceModel* device = scheduler::FindInstanceDevice(flag)) {
    return scheduler::AsJobUsesIt(*device, spec);
  }
  *why = "--device " + flag + ": unknown; use cpu, p5.48xlarge, p5e.48xlarge, p5en.48xlarge, p4d.24xlarge or p4de.24xlarge";
  return std::nullopt;
}

scheduler::LayoutChoice DefaultChoice(const api::TrainingJobSpec& spec) {
  const int world = int(spec.nodes * spec.gpus_per_node);
  return {1, world, int(spec.training.micro_batch_size), {}};
}

std::string CandidateRow(const scheduler::Candidate& c) {
  char row[512];
  int n = std::snprintf(row, sizeof row, "%-46s %10s %9.4f s %12.0f tok/s   exposed %.4f s, %lld micro-steps",
                        scheduler::Describe(c.choice).c_str(), scheduler::MemorySize(c.needed).c_str(), c.step.seconds,
                        c.step.tokens_per_second, c.step.exposed_seconds, (long long)c.step.micro_steps);
  if (c.choice.pipeline.stages > 1 && n > 0 && size_t(n) < sizeof row) {
    std::snprintf(row + n, sizeof row - size_t(n), ", bubble %.1f%%, p2p %s a step (waits %.4f s)", 100 * c.step.bubble,
                  scheduler::MemorySize(c.step.p2p_bytes).c_str(), c.step.p2p_seconds);
  }
  n = int(std::strlen(row));
  if (c.choice.context > 1 && size_t(n) < sizeof row) {
    std::snprintf(row + n, sizeof row - size_t(n), ", context exchanges %.4f s", c.step.context_seconds);
  }
  n = int(std::strlen(row));
  if (c.choice.expert > 1 && size_t(n) < sizeof row) {
    std::snprintf(row + n, sizeof row - size_t(n), ", expert all-to-alls %s a step (%.4f s)",
                  scheduler::MemorySize(c.step.expert_bytes).c_str(), c.step.expert_seconds);
  }
  return row;
}

void PrintPlan(const scheduler::PlanRequest& r, const scheduler::Plan& plan, int top,
               const std::optional<scheduler::LayoutChoice>& reference, std::ostream& out) {
  char line[320];
  std::snprintf(line, sizeof line,
                "planner: %s, %s per rank (%s usable), matrix rate %s; %d nodes x %d ranks; global batch "
                "%lld tokens of %d\n",
                r.device.name.c_str(), scheduler::MemorySize(r.device.memory_bytes).c_str(), scheduler::MemorySize(r.device.Usable()).c_str(),
                Rate(r.device.matrix_flops).c_str(), r.cluster.nodes, r.cluster.gpus_per_node,
                (long long)r.global_batch_tokens, r.seq);
  out << line;
  out << "  " << plan.feasible.size() << " candidates fit, " << plan.candidates - int64_t(plan.feasible.size())
      << " do not; the top " << std::min<size_t>(size_t(top), plan.feasible.size()) << " (modelled per-rank peak, step time):\n";
  for (size_t i = 0; i < plan.feasible.size() && i < size_t(top); ++i) {
    out << "  " << i + 1 << ". " << CandidateRow(plan.feasible[i]) << "\n";
  }
  if (const scheduler::Candidate* best = plan.best(); best && reference) {
    const scheduler::Candidate d = scheduler::Evaluate(r, *reference);
    out << "  the default (full sharding, T=1, the spec's micro-batch): " << CandidateRow(d) << "\n";
    std::snprintf(line, sizeof line, "  chosen / default: %.2fx the tokens/s%s\n", d.step.seconds / best->step.seconds,
                  d.reason.empty() ? "" : "; the default does not fit");
    out << line;
  }
  if (plan.candidates_by_context.size() > 1) {
    PrintDegrees(plan, plan.candidates_by_context, &scheduler::LayoutChoice::context,
                 "contextParallelDegree C (ranks that split each sequence)", "C", out);
  }
  if (plan.candidates_by_expert.size() > 1) {
    PrintDegrees(plan, plan.candidates_by_expert, &scheduler::LayoutChoice::expert,
                 "expertParallelDegree EP (ranks that split each block's experts)", "EP", out);
  }
  if (!plan.rejected.empty() || plan.rejected_count > 0) out << "  rejected:\n";
  for (const scheduler::Candidate& c : plan.rejected) {
    out << "    " << (c.choice.pipeline.stages > 1 ? "P=" + std::to_string(c.choice.pipeline.stages) + ", " : "")
        << "T=" << c.choice.tp << ", S=" << c.choice.shard
        << (c.choice.context > 1 ? ", C=" + std::to_string(c.choice.context) : "")
        << (c.choice.expert > 1 ? ", EP=" + std::to_string(c.choice.expert) : "") << ": nothing fits; the least "
        << c.reason << "\n";
  }
  if (plan.rejected_count > 0) {
    out << "    and " << plan.rejected_count << " larger variants (micro-batch, activations) of layouts that fit\n";
  }
  for (const std::string& note : plan.notes) out << "  not tried: " << note << "\n";
  if (!plan.shortfall.empty()) out << "  nothing fits: " << plan.shortfall << "\n";
}

nlohmann::json PlanJson(const scheduler::PlanRequest& r, const scheduler::Plan& plan, int top) {
  nlohmann::json candidates = nlohmann::json::array(), rejected = nlohmann::json::array();
  for (size_t i = 0; i < plan.feasible.size() && i < size_t(top); ++i) candidates.push_back(CandidateJson(plan.feasible[i]));
  for (const scheduler::Candidate& c : plan.rejected) rejected.push_back(CandidateJson(c));
  return {{"device", r.device.name},
          {"memoryBytes", r.device.memory_bytes},
          {"usableBytes", r.device.Usable()},
          {"feasible", plan.feasible.size()},
          {"candidates", candidates},
          {"rejected", rejected},
          {"notes", plan.notes},
          {"shortfall", plan.shortfall}};
}

}  // namespace meshtrain::cli
