#include "operator/controller/kueue.h"

#include <cstdint>
#include <cstdio>

#include "operator/controller/builders.h"
#include "operator/kube/time.h"

namespace meshtrain::controller {

using nlohmann::json;

namespace {

json TolerationJson(const api::Toleration& t) {
  json tol = {{"operator", t.operator_}};
  if (!t.key.empty()) tol["key"] = t.key;
  if (!t.value.empty()) tol["value"] = t.value;
  if (!t.effect.empty()) tol["effect"] = t.effect;
  if (t.toleration_seconds) tol["tolerationSeconds"] = *t.toleration_seconds;
  return tol;
}

api::Toleration TolerationOf(const json& t) {
  api::Toleration tol;
  tol.key = t.value("key", "");
  tol.operator_ = t.value("operator", "Equal");
  tol.value = t.value("value", "");
  tol.effect = t.value("effect", "");
  if (t.contains("tolerationSeconds") && t["tolerationSeconds"].is_number_integer())
    tol.toleration_seconds = t["tolerationSeconds"].get<int64_t>();
  return tol;
}

void AddStrings(const json& from, std::map<std::string, std::string>* to) {
  if (!from.is_object()) return;
  for (const auto& [k, v] : from.items())
    if (v.is_string()) (*to)[k] = v.get<std::string>();
}

// A Kubernetes name's characters: the job name is one already.
uint32_t Fnv1a(const std::string& text) {
  uint32_t h = 2166136261u;
  for (const unsigned char c : text) h = (h ^ c) * 16777619u;
  return h;
}

json PriorityClassRef(const std::string& name) {
  return {{"group", kPriorityClassGroup}, {"kind", kPriorityClassKind}, {"name", name}};
}

}  // namespace

std::string WorkloadName(const std::string& job_name, const std::string& job_uid) {
  char hash[8];
  std::snprintf(hash, sizeof hash, "%05x", Fnv1a(job_name + "/" + job_uid) & 0xfffffu);
  std::string prefix = "trainingjob-" + job_name;
  if (prefix.size() > 253 - 6) prefix.resize(253 - 6);
  while (!prefix.empty() && (prefix.back() == '-' || prefix.back() == '.')) prefix.pop_back();
  return prefix + "-" + hash;
}

std::string PriorityClassName(const api::TrainingJob& job) {
  const auto it = job.metadata.labels.find(kPriorityClassLabel);
  return it == job.metadata.labels.end() ? "" : it->second;
}

std::optional<WorkloadPriority> PriorityOf(const json& priority_class, std::string* error) {
  const json value = priority_class.value("value", json());
  const bool int32 = value.is_number_unsigned()
                         ? value.get<uint64_t>() <= uint64_t{INT32_MAX}
                         : value.is_number_integer() && value.get<int64_t>() >= INT32_MIN &&
                               value.get<int64_t>() <= INT32_MAX;
  if (!int32) {
    *error = "whose value is not an int32 (" + value.dump() + ")";
    return std::nullopt;
  }
  const std::string name = priority_class.value("metadata", json::object()).value("name", "");
  return WorkloadPriority{name, int32_t(value.get<int64_t>())};
}

json BuildWorkload(const api::TrainingJob& job, const std::string& queue, const WorkerDefaults& worker,
                   const std::optional<WorkloadPriority>& priority) {
  const api::TrainingJobSpec& spec = job.spec;
  json limits = {{"nvidia.com/gpu", std::to_string(spec.resources.gpu.value_or(spec.gpus_per_node))}};
  if (spec.resources.efa > 0) {
    limits["vpc.amazonaws.com/efa"] = std::to_string(spec.resources.efa);
    if (!worker.hugepages_2mi.empty()) limits["hugepages-2Mi"] = worker.hugepages_2mi;
  }
  json pod_spec = {{"restartPolicy", "Never"},
                   {"containers", json::array({{{"name", "worker"},
                                                {"image", spec.image},
                                                {"resources", {{"limits", limits}, {"requests", limits}}}}})}};
  if (!spec.template_.node_selector.empty()) pod_spec["nodeSelector"] = spec.template_.node_selector;
  if (!spec.template_.tolerations.empty()) {
    json tolerations = json::array();
    for (const auto& t : spec.template_.tolerations) tolerations.push_back(TolerationJson(t));
    pod_spec["tolerations"] = tolerations;
  }
  json pod_set = {{"name", kWorkloadPodSet},
                  {"count", spec.nodes},
                  {"template", {{"metadata", {{"labels", {{kJobNameLabel, job.metadata.name}}}}}, {"spec", pod_spec}}}};
  // spec.topology as a TAS request: Required keeps the gang in one domain of its level;
  // Preferred, as the operator's own placement, tries the deepest level above the node
  // and falls back outwards. The pod index is the node rank.
  if (!spec.topology.required_level.empty()) {
    json request = {{"podIndexLabel", kNodeRankLabel}};
    request[spec.topology.mode == "Required" ? "required" : "preferred"] = spec.topology.required_level;
    pod_set["topologyRequest"] = request;
  }
  // No minCount for spec.elastic: Kueue's partial admission would count fewer pods than
  // the gang the operator starts; an elastic job is admitted whole, and runs whole.
  const std::string name = WorkloadName(job.metadata.name, job.metadata.uid);
  json workload_spec = {{"queueName", queue}, {"podSets", json::array({pod_set})}};
  if (priority) {
    workload_spec["priorityClassRef"] = PriorityClassRef(priority->class_name);
    workload_spec["priority"] = priority->value;
  }
  return {{"apiVersion", kWorkloadApiVersion},
          {"kind", "Workload"},
          {"metadata",
           {{"name", name},
            {"namespace", job.metadata.namespace_},
            {"labels", {{kJobNameLabel, job.metadata.name}}},
            {"ownerReferences", json::array({OwnerReference(job)})}}},
          {"spec", workload_spec}};
}

namespace {

const json* FindCondition(const json& workload, const char* type) {
  const auto status = workload.find("status");
  if (status == workload.end() || !status->is_object()) return nullptr;
  const auto conditions = status->find("conditions");
  if (conditions == status->end() || !conditions->is_array()) return nullptr;
  for (const json& c : *conditions)
    if (c.is_object() && c.value("type", "") == type) return &c;
  return nullptr;
}

// The podSetAssignment of the workers' PodSet (the first, if none is named so).
const json* WorkersAssignment(const json& workload) {
  const auto status = workload.find("status");
  if (status == workload.end() || !status->is_object()) return nullptr;
  const auto admission = status->find("admission");
  if (admission == status->end() || !admission->is_object()) return nullptr;
  const auto assignments = admission->find("podSetAssignments");
  if (assignments == admission->end() || !assignments->is_array()) return nullptr;
  const json* found = nullptr;
  for (const json& a : *assignments) {
    if (!a.is_object()) continue;
    if (a.value("name", "") == kWorkloadPodSet) return &a;
    if (!found) found = &a;
  }
  return found;
}

}  // namespace

bool WorkloadConditionTrue(const json& workload, const char* type) {
  const json* c = FindCondition(workload, type);
  return c && c->value("status", "") == "True";
}

bool WorkloadEvicted(const json& workload) {
  const json* evicted = FindCondition(workload, "Evicted");
  if (!evicted || evicted->value("status", "") != "True") return false;
  const json* reserved = FindCondition(workload, "QuotaReserved");
  if (!reserved || reserved->value("status", "") != "True") return true;
  // RFC 3339 times in one format compare as strings.
  return !(reserved->value("lastTransitionTime", "") > evicted->value("lastTransitionTime", ""));
}

std::string WorkloadConditionMessage(const json& workload, const char* type) {
  const json* c = FindCondition(workload, type);
  return c ? c->value("message", "") : "";
}

std::string WorkloadMismatch(const json& workload, const api::TrainingJob& job, const std::string& queue) {
  const json spec = workload.value("spec", json::object());
  if (spec.value("queueName", "") != queue)
    return "its queue is " + spec.value("queueName", "") + ", the job's label names " + queue;
  const json podsets = spec.value("podSets", json::array());
  const int64_t count = podsets.size() == 1 ? podsets[0].value("count", int64_t{-1}) : -1;
  if (count != job.spec.nodes)
    return "it counts " + std::to_string(count) + " pods, the job has spec.nodes " + std::to_string(job.spec.nodes);
  const std::string wanted = PriorityClassName(job);
  const json ref = spec.value("priorityClassRef", json());
  if (ref != (wanted.empty() ? json() : PriorityClassRef(wanted))) {
    const std::string had = ref.is_object() ? ref.value("kind", "") + " " + ref.value("name", "") : "none";
    return "its priority class is " + had + ", the job's label " + kPriorityClassLabel + " names " +
           (wanted.empty() ? "none" : wanted);
  }
  return "";
}

bool HasTopologyAssignment(const json& workload) {
  const json* a = WorkersAssignment(workload);
  return a && a->contains("topologyAssignment");
}

std::set<std::string> AdmittedFlavors(const json& workload) {
  std::set<std::string> out;
  if (const json* a = WorkersAssignment(workload)) {
    const json flavors = a->value("flavors", json::object());
    for (const auto& [resource, flavor] : flavors.items())
      if (flavor.is_string()) out.insert(flavor.get<std::string>());
  }
  return out;
}

KueueAdmission ReadAdmission(const json& workload, const std::map<std::string, json>& flavors) {
  KueueAdmission out;
  const json status = workload.value("status", json::object());
  out.cluster_queue = status.value("admission", json::object()).value("clusterQueue", "");
  const json* assignment = WorkersAssignment(workload);
  if (!assignment) {
    out.error = "its admission has no podSetAssignment";
    return out;
  }
  out.flavors = AdmittedFlavors(workload);
  for (const std::string& name : out.flavors) {
    const auto it = flavors.find(name);
    if (it == flavors.end() || !it->second.is_object()) {
      out.error = "ResourceFlavor " + name + " of its admission was not found";
      return out;
    }
    const json spec = it->second.value("spec", json::object());
    AddStrings(spec.value("nodeLabels", json::object()), &out.node_selector);
    for (const json& t : spec.value("tolerations", json::array())) out.tolerations.push_back(TolerationOf(t));
  }
  for (const json& check : status.value("admissionChecks", json::array())) {
    for (const json& update : check.value("podSetUpdates", json::array())) {
      if (update.value("name", "") != assignment->value("name", "")) continue;
      AddStrings(update.value("nodeSelector", json::object()), &out.node_selector);
      AddStrings(update.value("labels", json::object()), &out.labels);
      AddStrings(update.value("annotations", json::object()), &out.annotations);
      for (const json& t : update.value("tolerations", json::array())) out.tolerations.push_back(TolerationOf(t));
    }
  }
  if (assignment->contains("topologyAssignment")) {
    out.topology = true;
    out.nodes = TopologyNodes((*assignment)["topologyAssignment"], &out.error);
  }
  return out;
}

std::vector<std::string> TopologyNodes(const json& assignment, std::string* error) {
  std::vector<std::string> nodes;
  const json levels = assignment.value("levels", json::array());
  size_t host = levels.size();
  for (size_t i = 0; i < levels.size(); ++i)
    if (levels[i] == kHostnameLabel) host = i;
  if (host == levels.size()) {
    *error = "its topologyAssignment does not name nodes (no level " + std::string(kHostnameLabel) +
             "): the Topology's lowest level must be the node";
    return {};
  }
  for (const json& slice : assignment.value("slices", json::array())) {
    const int64_t domains = slice.value("domainCount", int64_t{0});
    const json values = slice.value("valuesPerLevel", json::array());
    const json counts = slice.value("podCounts", json::object());
    if (host >= values.size() || domains < 1) {
      *error = "its topologyAssignment has a slice without a value per level";
      return {};
    }
    const json& value = values[host];
    for (int64_t d = 0; d < domains; ++d) {
      std::string node;
      if (value.contains("universal")) {
        node = value.value("universal", "");
      } else {
        const json individual = value.value("individual", json::object());
        const json roots = individual.value("roots", json::array());
        if (size_t(d) >= roots.size() || !roots[d].is_string()) {
          *error = "its topologyAssignment has fewer roots than domains";
          return {};
        }
        node = individual.value("prefix", "") + roots[d].get<std::string>() + individual.value("suffix", "");
      }
      int64_t count = counts.value("universal", int64_t{0});
      if (counts.contains("individual")) {
        const json individual = counts["individual"];
        count = size_t(d) < individual.size() && individual[d].is_number_integer() ? individual[d].get<int64_t>() : 0;
      }
      for (int64_t c = 0; c < count; ++c) nodes.push_back(node);
    }
  }
  return nodes;
}

void SetWorkloadCondition(json* workload, const std::string& type, bool value, const std::string& reason,
                          const std::string& message, std::chrono::system_clock::time_point now) {
  json& status = (*workload)["status"];
  if (!status.is_object()) status = json::object();
  if (!status.contains("conditions") || !status["conditions"].is_array()) status["conditions"] = json::array();
  const std::string s = value ? "True" : "False";
  const int64_t generation = (*workload)["metadata"].value("generation", int64_t{1});
  for (json& c : status["conditions"]) {
    if (c.value("type", "") != type) continue;
    if (c.value("status", "") != s) c["lastTransitionTime"] = kube::Rfc3339(now);
    c["status"] = s;
    c["reason"] = reason;
    c["message"] = message;
    c["observedGeneration"] = generation;
    return;
  }
  status["conditions"].push_back({{"type", type},
                                  {"status", s},
                                  {"reason", reason},
                                  {"message", message},
                                  {"lastTransitionTime", kube::Rfc3339(now)},
                                  {"observedGeneration", generation}});
}

json WorkloadRequeued(json workload, std::chrono::system_clock::time_point now) {
  const std::string evicted = WorkloadConditionMessage(workload, "Evicted");
  std::string reason = "Evicted";
  if (const json* c = FindCondition(workload, "Evicted")) reason = c->value("reason", "Evicted");
  if (reason.empty()) reason = "Evicted";
  const std::string message = "the job's pods were stopped after the eviction" + (evicted.empty() ? "" : ": " + evicted);
  SetWorkloadCondition(&workload, "QuotaReserved", false, "Pending", message, now);
  SetWorkloadCondition(&workload, "Admitted", false, "NoReservation", "the workload has no quota reservation", now);
  SetWorkloadCondition(&workload, "Requeued", true, reason, message, now);
  if (FindCondition(workload, "PodsReady"))
    SetWorkloadCondition(&workload, "PodsReady", false, "WaitForStart", "the job's pods were stopped", now);
  workload["status"].erase("admission");
  return workload;
}

}  // namespace meshtrain::controller
