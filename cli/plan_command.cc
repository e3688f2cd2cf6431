#include <algorithm>
#include <iomanip>
#include <sstream>

#include "api/json_codec.h"
#include "api/layout.h"
#include "api/manifest.h"
#include "api/rank_table.h"
#include "cli/commands.h"
#include "cli/job_report.h"
#include "cli/plan_report.h"
#include "operator/controller/worker_defaults.h"
#include "operator/scheduler/cost_model.h"
#include "operator/scheduler/placement.h"

namespace meshtrain::cli {
namespace {

using Json = nlohmann::json;

std::string Seconds(double s) {
  std::ostringstream out;
  out << std::fixed << std::setprecision(s < 0.01 ? 6 : 4) << s << " s";
  return out.str();
}

std::string JoinPath(const std::vector<std::string>& path, size_t length) {
  std::string out;
  for (size_t i = 0; i < length && i < path.size(); ++i) out += (i ? "/" : "") + path[i];
  return out;
}

// Applies --link LEVEL=GBPS[,LATENCY_US] overrides. Returns an error message or "".
std::string ApplyLinkOverrides(const std::vector<std::string>& overrides, scheduler::LinkModel* links) {
  for (const std::string& o : overrides) {
    const size_t eq = o.find('=');
    double gbps = 0, latency_us = -1;
    char comma = 0;
    std::istringstream in(eq == std::string::npos ? "" : o.substr(eq + 1));
    in >> gbps;
    if (in >> comma) in >> latency_us;
    const std::string which = o.substr(0, eq);
    const double latency = latency_us >= 0 ? latency_us * 1e-6 : -1;
    if (eq == std::string::npos || gbps <= 0 || (comma != 0 && (comma != ',' || latency < 0))) {
      return "--link " + o + ": expected LEVEL=GBPS or LEVEL=GBPS,LATENCY_US";
    }
    const scheduler::Link* link = links->Find(which);
    if (link == nullptr) return "--link " + o + ": no link named \"" + which + "\"; use nvlink, cluster or a topology level";
    links->Override(which, gbps * 1e9, latency >= 0 ? latency : link->latency_seconds);
  }
  return "";
}

Json AxesJson(const scheduler::StepCost& cost) {
  Json axes = Json::object();
  for (const auto& a : cost.axes) axes[a.axis] = {{"seconds", a.seconds}, {"groupsByLink", a.groups_by_link}};
  return axes;
}

void PrintText(const api::CheckedJob& job, const scheduler::Placement& aware, const scheduler::Placement& blind,
               const scheduler::StepCost& aware_cost, const scheduler::StepCost& blind_cost,
               const std::vector<std::string>& levels, std::ostream& out) {
  const int64_t gpus = job.job.spec.gpus_per_node;
  out << "placement: " << (aware.domain_level < 0 ? "across the whole cluster"
                                                  : "in " + levels[aware.domain_level] + " domain " + aware.domain)
      << "\n";
  // Nodes grouped by their deepest network domain (the level above the node).
  const size_t depth = levels.size() >= 2 ? levels.size() - 1 : levels.size();
  for (size_t i = 0; i < aware.nodes.size();) {
    size_t j = i;
    while (j < aware.nodes.size() && JoinPath(aware.paths[j], depth) == JoinPath(aware.paths[i], depth)) ++j;
    out << "  " << JoinPath(aware.paths[i], depth) << ": " << (j - i) << " node(s), node ranks " << i << "-" << j - 1
        << "\n";
    i = j;
  }
  out << "rank table:\n";
  for (const api::RankTableNode& n : scheduler::MakeRankTable(aware, levels, gpus).nodes) {
    std::vector<int> ranks(n.ranks.begin(), n.ranks.end());
    out << "  node " << std::setw(3) << n.node_rank << "  " << std::left << std::setw(24) << n.name << std::right
        << " ranks " << std::setw(9) << api::FormatRanks(ranks) << "  " << JoinPath(n.topology_path, n.topology_path.size())
        << "\n";
  }
  out << "groups by link (topology-aware | topology-blind):\n";
  size_t width = 8;  // the axis names' column: "expert-shard" is the longest
  for (const scheduler::AxisCost& axis : aware_cost.axes) width = std::max(width, axis.axis.size() + 1);
  for (size_t a = 0; a < aware_cost.axes.size(); ++a) {
    auto list = [](const std::map<std::string, int>& by_link) {
      std::string s;
      for (const auto& [link, n] : by_link) s += (s.empty() ? "" : ", ") + std::to_string(n) + " " + link;
      return s;
    };
    out << "  " << std::left << std::setw(int(width)) << aware_cost.axes[a].axis << std::right << list(aware_cost.axes[a].groups_by_link)
        << " | " << list(blind_cost.axes[a].groups_by_link) << "\n";
  }
  out << "modelled communication per step:   topology-aware   topology-blind\n";
  for (size_t a = 0; a < aware_cost.axes.size(); ++a) {
    out << "  " << std::left << std::setw(32) << aware_cost.axes[a].axis << std::right << std::setw(14)
        << Seconds(aware_cost.axes[a].seconds) << std::setw(17) << Seconds(blind_cost.axes[a].seconds) << "\n";
  }
  out << "  " << std::left << std::setw(32) << "total" << std::right << std::setw(14) << Seconds(aware_cost.seconds)
      << std::setw(17) << Seconds(blind_cost.seconds) << "\n";
  out << "topology-blind / topology-aware: " << std::fixed << std::setprecision(2)
      << blind_cost.seconds / aware_cost.seconds << "x (blind takes the first " << blind.nodes.size()
      << " eligible nodes in name order)\n";
}

// The labels of the placed nodes, in node-rank order.
std::vector<std::map<std::string, std::string>> LabelsOf(const scheduler::ClusterSnapshot& cluster,
                                                          const scheduler::Placement& placed) {
  std::vector<std::map<std::string, std::string>> labels;
  for (const std::string& name : placed.nodes) {
    for (const scheduler::ClusterNode& n : cluster.nodes) {
      if (n.name == name) labels.push_back(n.labels);
    }
  }
  return labels;
}

// A manual layout whose rank cannot hold its share of a sequence on the placed nodes'
// device: the shortfall in bytes and the contextParallelDegree that would fit
// (scheduler::SequenceShortfall); "" when it fits or the device is unknown.
std::string ManualShortfall(const PlanOptions& options, const api::TrainingJobSpec& spec,
                            const scheduler::ClusterSnapshot& cluster, const scheduler::Placement& placed,
                            const scheduler::LinkModel& links) {
  std::string why;
  const std::optional<scheduler::DeviceModel> device =
      PlanDevice(options.device, spec, LabelsOf(cluster, placed), &why);
  if (!device) return "";
  const scheduler::PlanRequest request = scheduler::RequestFor(spec, placed.paths, links, *device);
  return scheduler::SequenceShortfall(request, scheduler::ChoiceOf(spec));
}

// --auto: the planner's candidates for the placed nodes.
int PlanAuto(const PlanOptions& options, const api::CheckedJob& job, const scheduler::ClusterSnapshot& cluster,
             const scheduler::Placement& placed, const scheduler::LinkModel& links, std::ostream& out,
             std::ostream& err) {
  const api::TrainingJobSpec& spec = job.job.spec;
  std::string why;
  const std::optional<scheduler::DeviceModel> device =
      PlanDevice(options.device, spec, LabelsOf(cluster, placed), &why);
  if (!device) {
    err << job.Where() << ": " << why << "\n";
    return kExitInvalid;
  }
  const scheduler::PlanRequest request = scheduler::RequestFor(spec, placed.paths, links, *device);
  const scheduler::Plan plan = scheduler::PlanLayouts(request);
  if (options.json) {
    out << PlanJson(request, plan, options.top).dump(2) << "\n";
  } else {
    out << job.Where() << ": placed on " << placed.nodes.size() << " nodes"
        << (placed.domain.empty() ? "" : " in " + placed.domain) << "\n";
    PrintPlan(request, plan, options.top, DefaultChoice(spec), out);
  }
  return plan.best() ? kExitOk : kExitInvalid;
}

}  // namespace

int PlanCommand(const PlanOptions& options, std::ostream& out, std::ostream& err) {
  api::CheckedJob job;
  if (int status = LoadOneValidJob(options.job_file, "plan", &job, err); status != kExitOk) return status;
  PrintWarnings(job, err);
  if (!options.worker_defaults.empty()) {
    try {
      const controller::WorkerDefaults defaults = controller::LoadWorkerDefaults(options.worker_defaults);
      const Json written = job.written.value("spec", Json::object());
      std::vector<api::DerivedDefault> derived;
      controller::ApplyWorkerDefaults(defaults, written, &job.job, &derived);
      for (const api::DerivedDefault& d : derived)
        err << job.Where() << ": default: " << d.field << " = " << d.value << " (" << d.reason << ")\n";
    } catch (const std::exception& e) {
      err << e.what() << "\n";
      return kExitUnreadable;
    }
  }
  scheduler::ClusterSnapshot cluster;
  try {
    cluster = options.cluster_file.empty() ? scheduler::ReadKubectlFiles(options.nodes_json, options.pods_json)
                                           : scheduler::ReadClusterFile(options.cluster_file);
  } catch (const scheduler::ClusterError& e) {
    err << e.what() << "\n";
    return kExitUnreadable;
  }
  const auto& spec = job.job.spec;
  scheduler::LinkModel links(spec.topology.levels);
  try {
    if (!options.links_file.empty()) scheduler::ApplyLinkFile(options.links_file, &links);
  } catch (const std::exception& e) {
    err << e.what() << "\n";
    return kExitUnreadable;
  }
  if (std::string error = ApplyLinkOverrides(options.link_overrides, &links); !error.empty()) {
    err << error << "\n";
    return kExitUnreadable;
  }

  const scheduler::PlacementRequest request = scheduler::PlacementRequest::ForJob(
      job.job, std::set<std::string>(options.avoid.begin(), options.avoid.end()));
  const scheduler::Placement aware = scheduler::Place(request, cluster);
  if (!aware.ok()) {
    if (options.json) out << Json{{"placement", nullptr}, {"reason", aware.reason}}.dump(2) << "\n";
    err << job.Where() << ": no placement: " << aware.reason << "\n";
    return kExitInvalid;
  }
  if (options.auto_layout) return PlanAuto(options, job, cluster, aware, links, out, err);
  const scheduler::Placement blind = scheduler::PlaceBlind(request, cluster);
  const scheduler::StepCost aware_cost = scheduler::EstimateStepCost(spec, aware.paths, links);
  const scheduler::StepCost blind_cost = scheduler::EstimateStepCost(spec, blind.paths, links);
  const api::RankTable table = scheduler::MakeRankTable(aware, spec.topology.levels, spec.gpus_per_node);
  const std::string shortfall = ManualShortfall(options, spec, cluster, aware, links);

  if (options.json) {
    Json placement = api::ToJson(table);
    placement["domainLevel"] = aware.domain_level < 0 ? Json(nullptr) : Json(spec.topology.levels[aware.domain_level]);
    placement["domain"] = aware.domain;
    Json blind_placement = api::ToJson(scheduler::MakeRankTable(blind, spec.topology.levels, spec.gpus_per_node));
    out << Json{{"placement", placement},
                {"costSecondsPerStep", aware_cost.seconds},
                {"blindCostSecondsPerStep", blind_cost.seconds},
                {"blindOverAware", blind_cost.seconds / aware_cost.seconds},
                {"axes", AxesJson(aware_cost)},
                {"blindAxes", AxesJson(blind_cost)},
                {"blindPlacement", blind_placement},
                {"shortfall", shortfall}}
               .dump(2)
        << "\n";
    return kExitOk;
  }
  PrintLayout(job, /*groups=*/false, out);
  if (!shortfall.empty()) out << "  memory: " << shortfall << "\n";
  PrintText(job, aware, blind, aware_cost, blind_cost, spec.topology.levels, out);
  return kExitOk;
}

}  // namespace meshtrain::cli
