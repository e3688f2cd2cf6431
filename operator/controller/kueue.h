// The operator's side of Kueue's job integration (docs/operator.md, "Kueue"), as plain
// functions on JSON: Kueue's Go job framework is not available to a C++ controller, so the
// operator writes each queued job's kueue.x-k8s.io/v1beta2 Workload itself and reads
// Kueue's answer from its status.
//
// - BuildWorkload: the Workload of a job, owned by it: one PodSet ("workers") of spec.nodes
//   pods with the pod template's resources, node selector and tolerations, and a
//   topologyRequest from spec.topology (its required or preferred level, and podIndexLabel
//   = the node-rank label, so that Kueue's TAS keeps rank order), and, when the job carries
//   kPriorityClassLabel, the priorityClassRef and priority of that WorkloadPriorityClass.
// - ReadAdmission: where an admitted Workload may run. Quota only: the node labels and
//   tolerations of the flavors it was given, and the podSetUpdates of its admission checks;
//   the operator's own placement then chooses among the nodes they allow. With a TAS
//   topologyAssignment (v1beta2: levels, and slices of domainCount, valuesPerLevel and
//   podCounts): the node of each pod index, which replaces the operator's placement.
// - The status a job integration writes (through workloads/status): the admission cleared
//   after an eviction, and Finished.
//
// Thread-safety: pure functions.

#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "api/training_job.h"
#include "operator/controller/worker_defaults.h"

namespace meshtrain::controller {

inline constexpr const char* kWorkloadApiVersion = "kueue.x-k8s.io/v1beta2";
// The one PodSet of a job's Workload.
inline constexpr const char* kWorkloadPodSet = "workers";
// What Kueue expects on the pods of an admitted Workload (its pod-group contract).
inline constexpr const char* kWorkloadAnnotation = "kueue.x-k8s.io/workload";
inline constexpr const char* kPodSetLabel = "kueue.x-k8s.io/podset";
// On a pod placed by a TAS assignment: Kueue counts its usage as the assignment's, once.
inline constexpr const char* kTasLabel = "kueue.x-k8s.io/tas";
inline constexpr const char* kHostnameLabel = "kubernetes.io/hostname";
// The job label that names the Kueue WorkloadPriorityClass of its Workload, as on Kueue's
// own job integrations.
inline constexpr const char* kPriorityClassLabel = "kueue.x-k8s.io/priority-class";
inline constexpr const char* kPriorityClassGroup = "kueue.x-k8s.io";
inline constexpr const char* kPriorityClassKind = "WorkloadPriorityClass";

// The value of the job's kPriorityClassLabel; empty without it.
std::string PriorityClassName(const api::TrainingJob& job);

// The priority a Workload takes from a WorkloadPriorityClass.
struct WorkloadPriority {
  std::string class_name;
  int32_t value = 0;
};
// The priority of the WorkloadPriorityClass `priority_class` (as read); nullopt, with
// `*error` saying why ("whose value ..."), when its value is not an int32.
std::optional<WorkloadPriority> PriorityOf(const nlohmann::json& priority_class, std::string* error);

// The Workload's name: "trainingjob-<name>-<5 hex digits of the name and uid>", at most 253
// characters; the same for the same job, another for a job recreated under the name.
std::string WorkloadName(const std::string& job_name, const std::string& job_uid);

// The Workload of `job` (defaulted) in the LocalQueue `queue`; with `priority`, its
// spec.priorityClassRef names that WorkloadPriorityClass and spec.priority is its value.
nlohmann::json BuildWorkload(const api::TrainingJob& job, const std::string& queue, const WorkerDefaults& worker,
                             const std::optional<WorkloadPriority>& priority = std::nullopt);

// Whether the Workload's condition `type` is True.
bool WorkloadConditionTrue(const nlohmann::json& workload, const char* type);
// Whether Kueue evicted the Workload from the admission it holds: Evicted=True, set no
// earlier than its quota reservation (an Evicted left True from before a re-admission
// does not count).
bool WorkloadEvicted(const nlohmann::json& workload);
// The message of its condition `type`, or "".
std::string WorkloadConditionMessage(const nlohmann::json& workload, const char* type);

// Where an admitted Workload lets the job run.
struct KueueAdmission {
  std::string cluster_queue;
  std::set<std::string> flavors;                     // the ResourceFlavors it was given
  std::map<std::string, std::string> node_selector;  // theirs and the podSetUpdates'
  std::vector<api::Toleration> tolerations;
  std::map<std::string, std::string> labels, annotations;  // the podSetUpdates', for the pods
  bool topology = false;           // it carries a TAS topologyAssignment
  std::vector<std::string> nodes;  // with topology: the node of each pod index
  std::string error;               // why it cannot be followed; empty when it can
};

// Why `workload` no longer describes `job` in `queue` (another queue, another pod count,
// another WorkloadPriorityClass than the job's kPriorityClassLabel names), or "" when it
// does: Kueue's PodSets are immutable, so it is replaced. Kueue lets a job integration
// change a Workload's priority in place; the operator writes no Workload spec after its
// creation, so a changed priority class replaces the Workload too. The class's value is
// not compared: as in Kueue, a Workload keeps the priority it was created with.
std::string WorkloadMismatch(const nlohmann::json& workload, const api::TrainingJob& job, const std::string& queue);
// Whether the Workload's admission carries a TAS topologyAssignment.
bool HasTopologyAssignment(const nlohmann::json& workload);
// The ResourceFlavors the Workload's admission names (ReadAdmission needs them).
std::set<std::string> AdmittedFlavors(const nlohmann::json& workload);
// The admission of `workload`; `flavors` by name holds those AdmittedFlavors names (one
// missing is an error).
KueueAdmission ReadAdmission(const nlohmann::json& workload, const std::map<std::string, nlohmann::json>& flavors);
// The node of each pod index of a v1beta2 topologyAssignment, in slice and domain order:
// pod r goes to the r-th domain (a domain of podCount c takes c consecutive indexes). Its
// levels must include kubernetes.io/hostname; otherwise `*error` says so.
std::vector<std::string> TopologyNodes(const nlohmann::json& assignment, std::string* error);

// Sets the condition `type` of `workload`'s status (lastTransitionTime changes with status).
void SetWorkloadCondition(nlohmann::json* workload, const std::string& type, bool value, const std::string& reason,
                          const std::string& message, std::chrono::system_clock::time_point now);
// The Workload's status once the job stopped after an eviction, as a job integration
// clears it: QuotaReserved=False, Admitted=False, Requeued=True, no admission (and
// PodsReady=False, when it was set).
nlohmann::json WorkloadRequeued(nlohmann::json workload, std::chrono::system_clock::time_point now);

}  // namespace meshtrain::controller
