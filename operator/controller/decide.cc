// Decide's narrative (Judge) and what every outcome writes. The steps it calls live by
// concern in decide_gang.cc, decide_in_place.cc, decide_elastic.cc and decide_plan.cc
// (decider.h).

#include "operator/controller/decide.h"

#include <algorithm>

#include "operator/controller/builders.h"
#include "operator/controller/decider.h"
#include "operator/kube/objects.h"
#include "operator/kube/time.h"
#include "operator/scheduler/cluster.h"

namespace meshtrain::controller {

using nlohmann::json;

namespace {

bool Finished(const std::string& phase) { return phase == "Succeeded" || phase == "Failed"; }

}  // namespace

std::string LabelOf(const json& object, const char* label) {
  return object.value("metadata", json::object()).value("labels", json::object()).value(label, "");
}

Decider::Decider(const Observed& observed, const DecideOptions& options)
    : o_(observed), options_(options), job_(observed.checked.job), defaults_(observed.checked.defaults) {
  d_.status = observed.status;
  if (observed.checked.ok())
    ApplyWorkerDefaults(options.worker, observed.object.value("spec", json::object()), &job_, &defaults_);
}

Decision Decider::Run() {
  Judge();
  if (d_.needs.any()) {
    Decision lacking;
    lacking.status = o_.status;
    lacking.needs = d_.needs;
    return lacking;
  }
  for (const json& pod : d_.delete_pods) {
    const std::string node = kube::PinnedNode(pod);
    if (!node.empty() && NodeOf(node) != NodeState::kReady) d_.force_delete.insert(kube::Uid(pod));
  }
  d_.status.observed_generation = generation();
  if (d_.status.phase != o_.status.phase) {
    std::string message = "phase " + (o_.status.phase.empty() ? "(new)" : o_.status.phase) + " -> " + d_.status.phase;
    for (const auto& c : d_.status.conditions)
      if (c.type == d_.status.phase && !c.message.empty()) message += ": " + c.message;
    d_.events.push_back({d_.status.phase == "Failed" ? "Warning" : "Normal", d_.status.phase, message});
  }
  return std::move(d_);
}

void Decider::Judge() {
  // 1. A finished job: clean up its pods, then wait for the TTL.
  if (Finished(o_.status.phase)) return CleanUpFinished();

  // 2. Validation.
  if (!o_.checked.ok()) {
    std::string message;
    for (const auto& e : o_.checked.errors) message += (message.empty() ? "" : "; ") + e.ToString();
    return Fail("InvalidSpec", message);
  }
  d_.status.defaults = defaults_;
  ReportFieldsWithoutEffect();
  ReportQueueWarnings();

  // 3. runPolicy: suspend and the deadline.
  if (ApplyRunPolicy()) return;

  // 4. With Kueue, a job in a queue runs only under its Workload's admission: until then
  //    (and after an eviction) it is Queued, with no pod.
  if (AwaitAdmission()) return;

  // 5. Judge the current gang from its pods and their nodes; pods of older gangs are
  //    leftovers of a recorded restart.
  Gang gang = FindGang();
  if (JudgePods(&gang)) return;
  // The pod cache has not caught up with our creates or deletes: its pod events enqueue
  // the job, and this pass judges nothing it lacks.
  if (o_.awaiting_created_pods) return d_.Requeue(kAwaitCache);
  if (JudgeMissingPods(gang)) return;

  // 6. In place: a launcher whose ranks failed restarts the gang's attempt, and a gang
  //    restarting in place waits for its launchers to run the stored attempt.
  if (gang.started && DriveLaunchers(gang.pods, gang.restarting_in_place)) return;

  // 7. The gang is not all there, or its placement is not recorded yet: create it, once
  //    the old gang is gone.
  if (!gang.started && (int64_t(gang.pods.size()) < gang_size() || !d_.status.placement)) {
    if (gang.stale_left) return d_.Requeue(std::chrono::milliseconds(500));
    return CreateGang(gang.number, gang.pods);
  }

  // 8. The gang exists: read its phase, and while it runs, its progress (and an elastic
  //    gang below spec.nodes grows back).
  ReadGang(gang);
}

void Decider::CleanUpFinished() {
  FinishWorkload();
  const auto& policy = job_.spec.run_policy;
  for (const auto& pod : o_.pods) {
    const std::string phase = kube::PodPhase(pod);
    if (policy.clean_pod_policy == "All" ||
        (policy.clean_pod_policy == "Running" && (phase == "Running" || phase == "Pending")))
      d_.delete_pods.push_back(pod);
  }
  if (const auto ttl = policy.ttl_seconds_after_finished) {
    const int64_t left = *ttl - kube::SecondsSince(o_.status.completion_time, o_.now);
    if (left <= 0) d_.delete_job = true;
    else d_.Requeue(std::chrono::seconds(left));
  }
}

bool Decider::ApplyRunPolicy() {
  const auto& policy = job_.spec.run_policy;
  if (policy.suspend) {
    if (o_.status.phase == "Suspended") {
      // The stored status records the suspension: the ranks checkpoint, then the pods go.
      if (CheckpointBeforeStop()) return true;
      d_.delete_pods = o_.pods;
      return true;
    }
    const bool checkpoint = BeginCheckpointBeforeStop("Suspended");
    d_.status.phase = "Suspended";
    d_.status.ready_workers = 0;
    SetCondition("Suspended", true, "Suspended",
                 checkpoint ? "spec.runPolicy.suspend is true; the ranks checkpoint, then the pods go"
                            : "spec.runPolicy.suspend is true; deleting the pods");
    SetCondition("Running", false, "Suspended", "suspended");
    d_.Requeue(kAfterOwnWrite);
    return true;
  }
  if (d_.status.phase == "Suspended" && (!o_.pods.empty() || o_.terminating > 0)) {
    // Unsuspended before the suspended gang was gone: it goes first (its ranks, told to
    // stop, checkpoint on their way out), and a new gang resumes from that checkpoint.
    d_.delete_pods = o_.pods;
    const api::Condition* checkpointing = nullptr;
    for (const auto& c : o_.status.conditions)
      if (c.type == kCheckpointingCondition) checkpointing = &c;
    if (checkpointing && checkpointing->status == "True")
      SetCondition(kCheckpointingCondition, false, "Resumed", "spec.runPolicy.suspend is false again");
    d_.Requeue(std::chrono::seconds(1));
    return true;
  }
  if (d_.status.phase == "Suspended") {
    d_.status.phase = "Pending";
    d_.status.placement.reset();
    SetCondition("Suspended", false, "Resumed", "spec.runPolicy.suspend is false; re-planning");
  }
  if (policy.active_deadline_seconds && !d_.status.start_time.empty()) {
    const int64_t left = *policy.active_deadline_seconds - kube::SecondsSince(d_.status.start_time, o_.now);
    if (left <= 0) {
      Fail("DeadlineExceeded", "the job ran longer than spec.runPolicy.activeDeadlineSeconds (" +
                                   std::to_string(*policy.active_deadline_seconds) + " s)");
      return true;
    }
    d_.Requeue(std::chrono::seconds(left));
  }
  return false;
}

void Decider::SetCondition(const std::string& type, bool value, const std::string& reason, const std::string& message) {
  const std::string s = value ? "True" : "False";
  for (auto& c : d_.status.conditions) {
    if (c.type != type) continue;
    if (c.status != s) c.last_transition_time = kube::Rfc3339(o_.now);
    c.status = s;
    c.reason = reason;
    c.message = message;
    c.observed_generation = generation();
    return;
  }
  d_.status.conditions.push_back({type, s, reason, message, kube::Rfc3339(o_.now), generation()});
}

// The pods go in the next pass, under cleanPodPolicy.
void Decider::Fail(const std::string& reason, const std::string& message) {
  d_.status.phase = "Failed";
  d_.status.ready_workers = 0;
  d_.status.completion_time = kube::Rfc3339(o_.now);
  SetCondition("Failed", true, reason, message);
  SetCondition("Running", false, reason, message);
  d_.Requeue(kAfterOwnWrite);
}

// Counts a failure; false, with the job failed, when it is one more than backoffLimit.
bool Decider::WithinBackoffLimit(const std::string& message) {
  const int64_t limit = job_.spec.run_policy.backoff_limit;
  if (d_.status.failures + 1 > limit) {
    Fail("BackoffLimitExceeded", message + "; the gang already failed and restarted " +
                                     std::to_string(d_.status.failures) + " times (backoffLimit " +
                                     std::to_string(limit) + ")");
    return false;
  }
  d_.status.failures += 1;
  return true;
}

// Records the next gang; the pass after the write deletes the old one and creates it.
// A `failure` counts against backoffLimit; a re-plan of a gang stuck Pending does not.
void Decider::Restart(const std::string& reason, const std::string& message, const std::string& bad_node, bool failure,
                      const char* kind) {
  if (failure && !WithinBackoffLimit(message)) return;
  d_.avoid_node = bad_node;
  RecordRestart(reason, kind, message, {failure ? "Warning" : "Normal", reason, message + "; restarting the gang"},
                failure);
  // A new gang's number is one no gang had (no more than restarts), so its pod names
  // never meet an old gang's.
  d_.status.gang = d_.status.restarts;
  d_.status.placement.reset();
}

// What every restart writes: the next attempt, Restarting, the conditions and the Event.
void Decider::RecordRestart(const std::string& reason, const char* kind, const std::string& message, PendingEvent event,
                            bool failure) {
  d_.status.restarts += 1;
  if (failure) d_.status.last_failure_time = kube::MicroTime(o_.now);
  d_.restart_kind = kind;
  d_.status.phase = "Restarting";
  d_.status.ready_workers = 0;
  SetCondition("Restarting", true, reason, message);
  SetCondition("Running", false, reason, message);
  d_.events.push_back(std::move(event));
  d_.Requeue(kAfterOwnWrite);
}

// A warning that stands while its cause does: condition `type` True with `reason` and
// `message`, and a Warning Event of reason `event` when it turns True or its message
// changes; once `message` is empty, False with reason `cleared` if the job had the
// condition, else nothing.
void Decider::ReportStandingWarning(const char* type, const std::string& reason, const std::string& event,
                                    const std::string& message, const std::string& cleared) {
  const auto& stored = o_.status.conditions;
  const auto had =
      std::find_if(stored.begin(), stored.end(), [&](const api::Condition& c) { return c.type == type; });
  if (message.empty()) {
    if (had != stored.end()) SetCondition(type, false, cleared, "");
    return;
  }
  if (!ConditionStands(type, reason, message)) d_.events.push_back({"Warning", event, message});
  SetCondition(type, true, reason, message);
}

bool Decider::ConditionStands(const char* type, const std::string& reason, const std::string& message) const {
  const auto& stored = o_.status.conditions;
  return std::any_of(stored.begin(), stored.end(), [&](const api::Condition& c) {
    return c.type == type && c.status == "True" && c.reason == reason && c.message == message;
  });
}

// SpecWarnings: the fields a valid spec sets that have no effect.
void Decider::ReportFieldsWithoutEffect() {
  std::string message;
  for (const auto& w : o_.checked.warnings) message += (message.empty() ? "" : "; ") + w.ToString();
  ReportStandingWarning(kSpecWarningsCondition, "FieldsWithoutEffect", "FieldsWithoutEffect", message, "NoFieldsWithoutEffect");
}

// QueueLabelIgnored: the job names a Kueue queue and the operator runs without Kueue.
// ElasticUnderKueue: an elastic job in a queue runs whole. Kueue counts a Workload's pods
// as admitted; the operator asks for no partial admission (a PodSet's minCount) and no
// workload slices, so a gang Kueue admitted neither shrinks below spec.nodes nor regrows.
void Decider::ReportQueueWarnings() {
  const std::string queue = LabelOf(o_.object, kQueueNameLabel);
  ReportStandingWarning(kQueueLabelIgnoredCondition, "KueueDisabled", "QueueLabelIgnored",
                        queue.empty() || options_.kueue
                            ? ""
                            : "label " + std::string(kQueueNameLabel) + "=" + queue +
                                  " is ignored: the operator runs without Kueue (the chart's kueue.enabled is "
                                  "false), so it places the job itself",
                        queue.empty() ? "NoQueueLabel" : "KueueEnabled");
  const std::optional<int64_t> min_nodes = job_.spec.elastic.min_nodes;
  const bool elastic = min_nodes && *min_nodes < nodes();
  ReportStandingWarning(kElasticUnderKueueCondition, "ElasticNotResized", "ElasticUnderKueue",
                        InQueue() && elastic
                            ? "spec.elastic.minNodes " + std::to_string(*min_nodes) + " has no effect under Kueue (" +
                                  std::string(kQueueNameLabel) + "=" + queue + "): the Workload asks for all " +
                                  std::to_string(nodes()) +
                                  " nodes, without partial admission (minCount) or workload slices, so the gang "
                                  "runs whole, waiting in the queue rather than shrinking"
                            : "",
                        InQueue() ? "NotElastic" : "NotQueued");
}

bool Decider::LacksCluster() {
  if (o_.cluster) return false;
  d_.needs.cluster = true;
  return true;
}

bool Decider::LacksConfigMap() {
  if (o_.config_map) return false;
  d_.needs.config_map = true;
  return true;
}

std::optional<json> Decider::ExistingConfigMap() const {
  if (o_.config_map->is_null()) return std::nullopt;
  return *o_.config_map;
}

NodeState Decider::NodeOf(const std::string& node) {
  const NodeState state = StateOf(node);
  if (state == NodeState::kGone) d_.rests_on_absence = true;
  return state;
}

NodeState Decider::StateOf(const std::string& node) const {
  const auto it = o_.nodes.find(node);
  return it == o_.nodes.end() ? NodeState::kGone : it->second;
}

PodClaim Decider::ClaimOf(const json& pod) {
  const std::string key = kube::KeyOf(pod), where = "pod " + key + " spec";
  return {key, kube::PinnedNode(pod), scheduler::PodRequest(pod["spec"], "nvidia.com/gpu", where),
          scheduler::PodRequest(pod["spec"], "vpc.amazonaws.com/efa", where)};
}

int64_t GangOf(const api::TrainingJobStatus& status) { return status.gang.value_or(status.restarts); }

std::optional<json> Rank0Pod(const std::vector<json>& pods, int64_t gang) {
  for (const auto& pod : pods)
    if (LabelOf(pod, kGangLabel) == std::to_string(gang) && NodeRankLabel(pod) == 0) return pod;
  return std::nullopt;
}

std::set<std::string> NodesOf(const std::vector<json>& pods, const std::optional<json>& config_map) {
  std::set<std::string> nodes;
  for (const json& pod : pods) {
    std::string node = kube::PinnedNode(pod);
    if (!node.empty()) nodes.insert(std::move(node));
  }
  if (config_map && config_map->is_object()) {
    api::FieldErrors errors;
    for (const auto& n : RankTableOf(*config_map, &errors).nodes) nodes.insert(n.name);
  }
  return nodes;
}

Decision Decide(const Observed& observed, const DecideOptions& options) { return Decider(observed, options).Run(); }

}  // namespace meshtrain::controller
