// With Kueue (DecideOptions::kueue, and the job carries kQueueNameLabel): the job's
// Workload, the wait for its admission, following the admission when placing, eviction,
// and Finished (decider.h, kueue.h). Kueue's job-integration contract, from the job's side:
//
// - the job's Workload is written by the operator, owned by the job; the job is Queued
//   (no pod) until the Workload is Admitted; with kueue.x-k8s.io/priority-class, the
//   Workload takes that WorkloadPriorityClass's priority, and is not created while the
//   class is missing;
// - admitted with quota only, the pods run with the flavors' node labels and tolerations
//   and the podSetUpdates, and the operator's placement chooses among the nodes they
//   allow; admitted with a TAS topologyAssignment, pod r runs on its r-th node;
// - evicted: the job is Queued again, its pods go (as for a suspend: the status first,
//   then the ranks' checkpoint, decide_stop.cc), and once they have, the admission is
//   cleared (QuotaReserved=False, Admitted=False, Requeued=True); the job waits for the
//   next admission;
// - finished: Finished=True, with the job's phase as the reason.

#include <algorithm>

#include "operator/controller/builders.h"
#include "operator/controller/decider.h"
#include "operator/kube/objects.h"

namespace meshtrain::controller {

using nlohmann::json;

bool Decider::InQueue() const { return options_.kueue && !LabelOf(o_.object, kQueueNameLabel).empty(); }

bool Decider::LacksWorkload() {
  if (o_.workload) return false;
  d_.needs.workload = true;
  return true;
}

bool Decider::LacksFlavors() {
  if (o_.flavors) return false;
  d_.needs.flavors = true;
  return true;
}

bool Decider::LacksPriorityClass() {
  if (o_.priority_class) return false;
  d_.needs.priority_class = true;
  return true;
}

bool Decider::WorkloadPriorityOf(std::optional<WorkloadPriority>* priority) {
  const std::string name = PriorityClassName(job_);
  if (name.empty()) return true;
  if (LacksPriorityClass()) return false;
  std::string reason = "PriorityClassNotFound", why = "which does not exist", until = "it does";
  if (!o_.priority_class->is_null()) {
    *priority = PriorityOf(*o_.priority_class, &why);
    if (*priority) return true;
    reason = "PriorityClassInvalid";
    until = "its value is an int32";
  }
  // As in Kueue's job framework, no Workload without its priority: the job waits, Queued.
  const std::string message = "the label " + std::string(kPriorityClassLabel) + " names WorkloadPriorityClass " +
                              name + ", " + why + "; the job's Workload is created once " + until;
  if (!ConditionStands(kQueuedCondition, reason, message)) d_.events.push_back({"Warning", reason, message});
  Queue(reason, message);
  d_.delete_pods = o_.status.phase == "Queued" ? o_.pods : std::vector<json>{};
  d_.Requeue(kAwaitPriorityClass);
  return false;
}

bool Decider::AwaitAdmission() {
  if (!InQueue()) return false;
  if (LacksWorkload()) return true;
  const std::string queue = LabelOf(o_.object, kQueueNameLabel);
  const json& workload = *o_.workload;
  if (workload.is_null()) {
    std::optional<WorkloadPriority> priority;
    if (!WorkloadPriorityOf(&priority)) return true;
    d_.create_workload = BuildWorkload(job_, queue, options_.worker, priority);
    Queue("WorkloadCreated", "waiting for Kueue to admit Workload " +
                                 (*d_.create_workload)["metadata"]["name"].get<std::string>() + " (queue " + queue + ")");
    d_.delete_pods = o_.status.phase == "Queued" ? o_.pods : std::vector<json>{};
    return true;
  }
  const std::string name = workload["metadata"].value("name", "");
  if (const std::string mismatch = WorkloadMismatch(workload, job_, queue); !mismatch.empty()) {
    // Kueue's PodSets are immutable: the job stops, and its Workload is replaced.
    const bool was_queued = o_.status.phase == "Queued";
    Queue("WorkloadOutdated", "Workload " + name + " no longer matches the job (" + mismatch + "); replacing it");
    if (!was_queued) return true;
    d_.delete_pods = o_.pods;
    if (!o_.pods.empty() || o_.terminating > 0) d_.Requeue(std::chrono::seconds(1));
    else d_.delete_workload = name;
    return true;
  }
  const bool evicted = WorkloadEvicted(workload);
  if (WorkloadConditionTrue(workload, "Admitted") && !evicted) {
    admitted_ = &workload;
    if (d_.status.phase == "Queued") {
      const std::string cluster_queue =
          workload.value("status", json::object()).value("admission", json::object()).value("clusterQueue", "");
      const std::string message = "Workload " + name + " admitted" +
                                  (cluster_queue.empty() ? "" : " by ClusterQueue " + cluster_queue);
      d_.status.phase = "Pending";
      d_.status.placement.reset();
      SetCondition(kQueuedCondition, false, "Admitted", message);
      d_.events.push_back({"Normal", "Admitted", message});
    }
    return false;
  }
  // Not admitted, or evicted: the job waits in its queue, and has no pod.
  const std::string message = evicted ? "Workload " + name + " evicted by Kueue: " +
                                            WorkloadConditionMessage(workload, "Evicted")
                                      : "waiting for Kueue to admit Workload " + name + " (queue " + queue + ")";
  const bool was_queued = o_.status.phase == "Queued";
  if (!was_queued && evicted) BeginCheckpointBeforeStop("Evicted");  // before Queue() leaves Running
  Queue(evicted ? "Evicted" : "WaitingForAdmission", message);
  if (!was_queued) return true;  // the pods go once Queued is stored, the ranks' checkpoint first
  if (CheckpointBeforeStop()) return true;
  d_.delete_pods = o_.pods;
  if (!o_.pods.empty() || o_.terminating > 0) {
    d_.Requeue(std::chrono::seconds(1));
    return true;
  }
  // Stopped: give the quota back as a job integration does, and wait to be admitted again.
  const json status = workload.value("status", json::object());
  if (evicted && (WorkloadConditionTrue(workload, "QuotaReserved") || WorkloadConditionTrue(workload, "Admitted") ||
                  status.contains("admission")))
    d_.workload_status = WorkloadRequeued(workload, o_.now);
  return true;
}

void Decider::Queue(const std::string& reason, const std::string& message) {
  const bool running = o_.status.phase == "Starting" || o_.status.phase == "Running" || o_.status.phase == "Restarting";
  d_.status.phase = "Queued";
  d_.status.ready_workers = 0;
  d_.status.placement.reset();
  SetCondition(kQueuedCondition, true, reason, message);
  if (running) SetCondition("Running", false, reason, message);
  if (o_.status.phase != "Queued") d_.Requeue(kAfterOwnWrite);
}

bool Decider::FollowAdmission() {
  if (!admitted_) return true;
  if (LacksFlavors()) return false;
  KueueAdmission admission = ReadAdmission(*admitted_, *o_.flavors);
  if (admission.error.empty() && admission.topology && int64_t(admission.nodes.size()) != nodes())
    admission.error = "its topologyAssignment places " + std::to_string(admission.nodes.size()) +
                      " pods, and the job has " + std::to_string(nodes());
  if (!admission.error.empty()) {
    return AdmissionNotFollowed("the admission of Workload " +
                                admitted_->value("metadata", json::object()).value("name", "") +
                                " cannot be followed: " + admission.error);
  }
  // The pods run with what the admission adds (the job's own spec is not edited).
  auto& overrides = job_.spec.template_;
  for (const auto& [key, value] : admission.node_selector) overrides.node_selector[key] = value;
  for (const auto& t : admission.tolerations)
    if (std::find(overrides.tolerations.begin(), overrides.tolerations.end(), t) == overrides.tolerations.end())
      overrides.tolerations.push_back(t);
  admission_ = std::move(admission);
  return true;
}

bool Decider::AssignedPlacement(const scheduler::ClusterView& cluster, const std::vector<std::string>& levels,
                                scheduler::Placement* placement) {
  const auto request = scheduler::PlacementRequest::ForJob(job_);
  std::string why;
  for (size_t r = 0; r < admission_->nodes.size() && why.empty(); ++r) {
    const std::string& name = admission_->nodes[r];
    const scheduler::ClusterNode* node = cluster.Node(name);
    if (!node) {
      why = "node " + name + " (pod " + std::to_string(r) + ") is not in the cluster";
      break;
    }
    if (std::find(placement->nodes.begin(), placement->nodes.end(), name) != placement->nodes.end()) {
      why = "node " + name + " is assigned more than one pod";
      break;
    }
    // Kueue counted the quota: what is still in use there (an evicted gang terminating)
    // holds the pod Pending, it does not move it.
    scheduler::ClusterNode free = *node;
    free.gpus_used = free.efa_used = 0;
    if (const std::string reason = scheduler::Ineligibility(request, free); !reason.empty())
      why = "node " + name + " (pod " + std::to_string(r) + ") is " + reason;
    placement->nodes.push_back(name);
    placement->paths.push_back(scheduler::TopologyPath(*node, levels));
  }
  if (why.empty()) return true;
  return AdmissionNotFollowed("the TAS assignment of Workload " +
                              admitted_->value("metadata", json::object()).value("name", "") +
                              " cannot be followed: " + why);
}

bool Decider::AdmissionNotFollowed(const std::string& message) {
  d_.status.phase = "Pending";
  SetCondition("Scheduled", false, "AdmissionNotFollowed", message);
  if (o_.status.phase != "Pending" || o_.status.conditions != d_.status.conditions)
    d_.events.push_back({"Warning", "AdmissionNotFollowed", message});
  d_.Requeue(options_.unschedulable_retry);
  return false;
}

bool Decider::AdmissionAllows(const api::RankTable& table, const scheduler::ClusterView& cluster) const {
  if (!admission_) return true;
  if (admission_->topology) {
    if (table.nodes.size() != admission_->nodes.size()) return false;
    for (size_t r = 0; r < table.nodes.size(); ++r)
      if (table.nodes[r].name != admission_->nodes[r]) return false;
    return true;
  }
  const auto request = scheduler::PlacementRequest::ForJob(job_);
  for (const auto& n : table.nodes) {
    const scheduler::ClusterNode* node = cluster.Node(n.name);
    if (!node || !scheduler::Admits(request, *node)) return false;
  }
  return true;
}

void Decider::MarkForKueue(json* pod) const {
  if (!admission_) return;
  json& meta = (*pod)["metadata"];
  for (const auto& [key, value] : admission_->labels) meta["labels"][key] = value;
  for (const auto& [key, value] : admission_->annotations) meta["annotations"][key] = value;
  meta["labels"][kPodSetLabel] = kWorkloadPodSet;
  if (admission_->topology) meta["labels"][kTasLabel] = "true";
  meta["annotations"][kWorkloadAnnotation] = admitted_->value("metadata", json::object()).value("name", "");
}

void Decider::ReportPodsReady(int64_t ready) {
  if (!admitted_ || WorkloadConditionTrue(*admitted_, "PodsReady")) return;
  json workload = *admitted_;
  SetWorkloadCondition(&workload, "PodsReady", true, "PodsReady",
                       "all " + std::to_string(ready) + " pods of the TrainingJob are running and ready", o_.now);
  d_.workload_status = std::move(workload);
}

void Decider::FinishWorkload() {
  if (!InQueue() || LacksWorkload() || o_.workload->is_null()) return;
  if (WorkloadConditionTrue(*o_.workload, "Finished")) return;
  const std::string phase = o_.status.phase;
  std::string message = "the TrainingJob " + std::string(phase == "Succeeded" ? "succeeded" : "failed");
  for (const auto& c : o_.status.conditions)
    if (c.type == phase && c.status == "True" && !c.message.empty()) message += ": " + c.message;
  json workload = *o_.workload;
  SetWorkloadCondition(&workload, "Finished", true, phase == "Succeeded" ? "Succeeded" : "Failed", message, o_.now);
  d_.workload_status = std::move(workload);
}

}  // namespace meshtrain::controller
