// Planning a new gang: its placement (or the one its ConfigMap already records), its
// layout under spec.parallelism.mode auto, its rank table, and the objects that carry them
// (decider.h).

#include <algorithm>
#include <cstdio>

#include "api/json_codec.h"
#include "api/layout.h"
#include "operator/controller/builders.h"
#include "operator/controller/decider.h"
#include "operator/scheduler/cost_model.h"
#include "operator/kube/time.h"
#include "operator/scheduler/planner.h"

namespace meshtrain::controller {

using nlohmann::json;

namespace {

std::string LayoutText(const api::LayoutStatus& l) {
  scheduler::LayoutChoice choice;
  choice.tp = int(l.tensor_parallel_degree);
  choice.shard = int(l.hybrid_shard_degree);
  choice.micro_batch = int(l.micro_batch_size);
  choice.activations = {l.activation_checkpointing, l.activation_offloading, int(l.activation_loading_horizon)};
  choice.pipeline = {int(l.pipeline_parallel_degree), int(l.pipeline_virtual_stages),
                     api::ParsePipelineSchedule(l.pipeline_schedule)};
  choice.context = int(l.context_parallel_degree);
  choice.context_mode = l.context_parallel_mode;
  choice.expert = int(l.expert_parallel_degree);
  return scheduler::Describe(choice);
}

}  // namespace

api::RankTable RankTableOf(const json& config_map, api::FieldErrors* errors) {
  const json data = config_map.value("data", json::object());
  return api::DecodeRankTable(json::parse(data.value("rank-table.json", "{}"), nullptr, false), errors);
}

// A new gang, or the rest of one whose creation a status write did not record: placed
// afresh, or finished on the nodes its ConfigMap's rank table names.
void Decider::CreateGang(int64_t gang, const std::vector<json>& current) {
  const bool lacks_config_map = LacksConfigMap(), lacks_cluster = LacksCluster();
  // With Kueue: the admission's node selector and tolerations, and its TAS assignment.
  const bool admission_followed = FollowAdmission();
  if (lacks_config_map || lacks_cluster || !admission_followed) return;
  const scheduler::ClusterView& cluster = *o_.cluster;
  const std::optional<json> existing = ExistingConfigMap();
  std::optional<api::RankTable> table = ReusableTable(existing, gang);
  if (table && !AdmissionAllows(*table, cluster)) table.reset();
  scheduler::Placement placement;
  auto request = scheduler::PlacementRequest::ForJob(job_, o_.avoided_nodes);
  api::TrainingJob sized = job_;  // the job at the gang's size
  const bool assigned = admission_ && admission_->topology;  // Kueue's TAS places the job
  if (table) {
    for (const auto& n : table->nodes) {
      placement.nodes.push_back(n.name);
      placement.paths.push_back(n.topology_path);
    }
    const std::optional<api::TrainingJob> job = JobOfSize(int64_t(table->nodes.size()));
    if (!job) table.reset();
    else sized = *job;
  }
  const bool reused = table.has_value();
  if (!table && assigned) {
    // Pod r on the r-th node of the assignment: ranks follow the pod index.
    if (!AssignedPlacement(cluster, request.levels, &placement)) return;
    table = scheduler::MakeRankTable(placement, request.levels, job_.spec.gpus_per_node);
  }
  if (!table) {
    d_.placed = true;
    placement = scheduler::Place(request, cluster);
    std::string reason = placement.reason;
    // Under a Kueue admission the gang is the size its quota counted: never smaller.
    if (!placement.ok() && (admitted_ || !PlaceSmaller(cluster, &sized, &placement, &request, &reason)))
      placement.reason = reason;
    // Quota only: the admission's flavors chose the nodes (their labels and tolerations).
    if (!placement.ok() && admitted_) {
      placement.reason = "the nodes the admission of Workload " +
                         admitted_->value("metadata", json::object()).value("name", "") +
                         " allows (its flavors' node labels, with the job's and the flavors' tolerations) do not fit: " +
                         placement.reason;
    }
    if (!placement.ok()) {
      d_.status.phase = "Pending";
      SetCondition("Scheduled", false, "Unschedulable", placement.reason);
      if (o_.status.phase != "Pending" || o_.status.conditions != d_.status.conditions)
        d_.events.push_back({"Warning", "Unschedulable", placement.reason});
      return d_.Requeue(options_.unschedulable_retry);
    }
    table = scheduler::MakeRankTable(placement, request.levels, job_.spec.gpus_per_node);
  }
  const int64_t size = sized.spec.nodes;

  // With mode auto, the planner chooses the layout for these nodes, and the workers
  // get the spec with it written in; a shrunk gang's workers get its size.
  json written_spec = o_.object.value("spec", json::object());
  if (size != nodes()) {
    written_spec["nodes"] = size;
    written_spec.erase("elastic");  // as JobOfSize checked it
  }
  std::optional<api::LayoutStatus> layout;
  if (job_.spec.parallelism.mode == "auto") {
    layout = PlanLayout(sized.spec, placement, cluster, request.levels, &written_spec);
    if (!layout) return d_.Requeue(options_.unschedulable_retry);
  } else if (job_.spec.elastic.min_nodes) {
    layout = scheduler::LayoutStatusOf(scheduler::ChoiceOf(sized.spec));
  }
  if (layout) layout->nodes = size;

  GangObjects objects;
  objects.service = BuildService(job_);
  objects.config_map = BuildConfigMap(job_, written_spec, *table, gang);
  if (options_.worker.network_policy.enabled)
    objects.network_policy = BuildNetworkPolicy(job_, options_.worker.network_policy);
  if (existing && !reused) {
    objects.replace_config_map = true;
    objects.config_map["metadata"]["resourceVersion"] = (*existing)["metadata"]["resourceVersion"];
  }
  std::set<int64_t> present;
  for (const auto& pod : current) present.insert(NodeRankLabel(pod));
  for (int64_t rank = 0; rank < size; ++rank) {
    if (!present.count(rank))
      objects.pods.push_back(BuildPod(job_, *table, gang, rank, d_.status.restarts, options_.worker));
  }
  for (json& pod : objects.pods) MarkForKueue(&pod);
  for (const json& pod : objects.pods) d_.claims.push_back(ClaimOf(pod));
  // A placement made now, from counters another gang may be taking from; not Kueue's
  // assignment, which its quota already counted.
  d_.check_claims = !reused && !assigned;
  d_.create = std::move(objects);

  api::PlacementStatus summary;
  for (size_t i = 0; i < placement.nodes.size(); ++i)
    summary.nodes.push_back({static_cast<int64_t>(i), placement.nodes[i], placement.paths[i]});
  summary.cost_seconds_per_step =
      scheduler::EstimateStepCost(sized.spec, placement.paths, scheduler::LinkModel(request.levels)).seconds;
  d_.status.placement = summary;
  d_.status.gang = gang;
  if (layout) {
    if (o_.status.layout != layout) ReportLayout(*layout, sized.spec);
    d_.status.layout = layout;
  }
  d_.status.phase = "Starting";
  if (d_.status.start_time.empty()) d_.status.start_time = kube::Rfc3339(o_.now);
  const std::string message = "gang " + std::to_string(gang) + " of " + std::to_string(size) + " pods placed" +
                              (placement.domain.empty() ? "" : " in " + placement.domain);
  SetCondition("Scheduled", true, "GangPlaced", message);
  SetCondition("Restarting", false, "GangPlaced", message);
  d_.events.push_back({"Normal", "GangCreated", message});
}

// The rank table of an interrupted creation of this gang, when its nodes are still usable.
std::optional<api::RankTable> Decider::ReusableTable(const std::optional<json>& existing, int64_t gang) const {
  if (!existing || LabelOf(*existing, kGangLabel) != std::to_string(gang)) return std::nullopt;
  api::FieldErrors errors;
  api::RankTable table = RankTableOf(*existing, &errors);
  const auto size = static_cast<int64_t>(table.nodes.size());
  if (!errors.empty() || size > nodes() || size < job_.spec.elastic.min_nodes.value_or(nodes())) return std::nullopt;
  for (const auto& n : table.nodes)
    if (StateOf(n.name) != NodeState::kReady || o_.avoided_nodes.count(n.name)) return std::nullopt;
  return table;
}


// spec.parallelism.mode auto: the planner's layout for the placed nodes, written into
// *written_spec; nullopt when none fits, with the job left Pending and why.
std::optional<api::LayoutStatus> Decider::PlanLayout(const api::TrainingJobSpec& spec,
                                                     const scheduler::Placement& placement,
                                                     const scheduler::ClusterView& cluster,
                                                     const std::vector<std::string>& levels, json* written_spec) {
  std::vector<std::map<std::string, std::string>> labels;
  for (const std::string& name : placement.nodes) {
    if (const scheduler::ClusterNode* n = cluster.Node(name)) labels.push_back(n->labels);
  }
  std::string why;
  const std::optional<scheduler::DeviceModel> device = scheduler::DeviceForNodes(labels, spec, &why);
  std::optional<scheduler::Plan> plan;
  if (device) {
    plan = scheduler::PlanLayouts(
        scheduler::RequestFor(spec, placement.paths, scheduler::LinkModel(levels), *device));
    if (!plan->best()) {
      why = "no layout fits";
      const auto least = std::min_element(plan->rejected.begin(), plan->rejected.end(),
                                          [](const auto& a, const auto& b) { return a.needed < b.needed; });
      if (least != plan->rejected.end()) why += "; the smallest " + least->reason;
      if (!plan->shortfall.empty()) why += "; " + plan->shortfall;
      for (const std::string& note : plan->notes) why += "; " + note;
    }
  }
  if (!plan || !plan->best()) {
    d_.status.phase = "Pending";
    SetCondition("Scheduled", false, "NoLayout", why);
    if (o_.status.phase != "Pending" || o_.status.conditions != d_.status.conditions)
      d_.events.push_back({"Warning", "NoLayout", why});
    return std::nullopt;
  }
  *written_spec = scheduler::ResolveWrittenSpec(*written_spec, plan->best()->choice);
  return scheduler::LayoutStatusOf(*plan->best(), *device);
}

// The Event for a layout that changed: planned (mode auto), or an elastic gang that
// shrank or grew, with the accumulation that keeps its global batch.
void Decider::ReportLayout(const api::LayoutStatus& layout, const api::TrainingJobSpec& spec) {
  const int64_t before = o_.status.layout ? o_.status.layout->nodes : nodes();
  if (layout.nodes != before && before > 0) {
    const bool shrunk = layout.nodes < before;
    if (shrunk) d_.restart_kind = "shrunk";
    char text[400];
    std::snprintf(text, sizeof text,
                  "the gang runs on %lld of spec.nodes %lld (was %lld): %s, %lld micro-steps of accumulation per "
                  "step keep the global batch of %lld tokens",
                  static_cast<long long>(layout.nodes), static_cast<long long>(nodes()), static_cast<long long>(before),
                  LayoutText(layout).c_str(), static_cast<long long>(api::AccumulationSteps(spec)),
                  static_cast<long long>(spec.training.global_batch_tokens));
    d_.events.push_back({shrunk ? "Warning" : "Normal", shrunk ? "Shrunk" : "Grown", text});
  }
  if (job_.spec.parallelism.mode != "auto") return;
  char text[400];
  std::snprintf(text, sizeof text, "%s: predicted %.2f GiB per rank and %.3f s per step on %s",
                LayoutText(layout).c_str(), double(layout.predicted_memory_bytes) / double(1 << 30),
                layout.predicted_step_seconds, layout.device.c_str());
  d_.events.push_back({"Normal", "LayoutPlanned", text});
}

}  // namespace meshtrain::controller
