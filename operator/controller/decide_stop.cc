// Before a suspended (spec.runPolicy.suspend) or evicted (Kueue) gang's pods go, its ranks
// checkpoint, so that the job loses no step (decider.h):
//
// 1. The pass that records the stop (phase Suspended, or Queued after an eviction) also
//    sets Checkpointing=True, when the job has spec.checkpoint.path, its gang runs with
//    launchers the operator reads, and rank 0's progress shows a step after its newest
//    checkpoint (or none read yet). Otherwise the pods go as before.
// 2. The passes after it ask each running pod's launcher to suspend (POST
//    /attempt/suspend): the launcher sends its ranks kStopSignal, they agree on a step to
//    stop after, checkpoint it and exit kExitStopped; the launcher kills those still
//    running after its grace and reports how each rank ended ("suspended").
// 3. Once every launcher has reported, or options.checkpoint_timeout after the stored
//    Checkpointing=True, the outcome is written: Checkpointing=False, Checkpointed (a
//    Normal Event quoting rank 0's line) or CheckpointTimedOut (a Warning Event naming
//    each rank that did not checkpoint, and each pod whose launcher never reported).
// 4. The pass after that write deletes the pods, as for any suspension. Unsuspending or a
//    new admission creates a new gang, which resumes from the newest checkpoint.

#include <algorithm>

#include "api/worker_contract.h"
#include "operator/controller/builders.h"
#include "operator/controller/decider.h"
#include "operator/kube/objects.h"
#include "operator/kube/time.h"

namespace meshtrain::controller {

using nlohmann::json;

namespace {

const api::Condition* ConditionOf(const api::TrainingJobStatus& status, const std::string& type) {
  for (const auto& c : status.conditions)
    if (c.type == type) return &c;
  return nullptr;
}

std::string PodName(const json& pod) { return pod["metadata"].value("name", ""); }

}  // namespace

std::vector<json> Decider::RunningGangPods() const {
  const std::string gang = std::to_string(GangOf(o_.status));
  std::vector<json> pods;
  for (const json& pod : o_.pods)
    if (LabelOf(pod, kGangLabel) == gang && kube::PodPhase(pod) == "Running") pods.push_back(pod);
  return pods;
}

bool Decider::BeginCheckpointBeforeStop(const std::string& why) {
  if (job_.spec.checkpoint.path.empty()) return false;
  if (o_.status.phase != "Running") return false;  // no rank trains, or the gang restarts
  const std::optional<api::ProgressStatus>& progress = o_.progress ? o_.progress : o_.status.progress;
  if (progress && progress->checkpoint_step && *progress->checkpoint_step >= progress->step) return false;
  bool asked = false;  // a launcher the operator reads runs this gang's ranks
  for (const json& pod : RunningGangPods()) {
    const auto it = o_.launchers.find(kube::Uid(pod));
    asked = asked || (it != o_.launchers.end() && it->second.state == "running");
  }
  if (!asked) return false;
  const std::string since = progress ? "step " + std::to_string(progress->step) + ", " +
                                           (progress->checkpoint_step
                                                ? "checkpoint of step " + std::to_string(*progress->checkpoint_step)
                                                : std::string("no checkpoint yet"))
                                     : std::string("no progress read yet");
  SetCondition(kCheckpointingCondition, true, why,
               "the ranks checkpoint and stop before their pods go (" + since + "; up to " +
                   std::to_string(options_.checkpoint_timeout.count()) + " s)");
  return true;
}

bool Decider::CheckpointBeforeStop() {
  const api::Condition* stored = ConditionOf(o_.status, kCheckpointingCondition);
  if (!stored || stored->status != "True") return false;
  const std::vector<json> pods = RunningGangPods();
  const int64_t attempt = o_.status.restarts;
  std::vector<std::string> unanswered;  // a rank, or a pod's ranks, that did not checkpoint
  std::vector<const json*> silent;      // pods whose launchers have not reported
  std::string stopped;                  // the first line a rank wrote of its stop
  for (const json& pod : pods) {
    const auto it = o_.launchers.find(kube::Uid(pod));
    const LauncherState* s = it == o_.launchers.end() ? nullptr : &it->second;
    if (!s || s->state != "suspended") {
      if (!s || s->state != "stopping") d_.launcher_calls.push_back({pod, "suspend", attempt});
      silent.push_back(&pod);
      continue;
    }
    for (const RankEnd& r : s->ranks) {
      if (r.exit_code == api::worker::kExitStopped) {
        if (stopped.empty()) stopped = r.reason;
        continue;
      }
      if (r.exit_code == 0) continue;  // it had trained its last step
      unanswered.push_back("rank " + std::to_string(r.rank) + " (pod " + PodName(pod) + ", exit code " +
                           std::to_string(r.exit_code) +
                           (r.exit_code == 128 + 9 ? ", killed past the launcher's grace" : "") +
                           (r.reason.empty() ? "" : ": " + r.reason) + ")");
    }
  }
  const int64_t waited = kube::SecondsSince(stored->last_transition_time, o_.now);
  const int64_t bound = options_.checkpoint_timeout.count();
  if (!silent.empty() && waited < bound) {
    d_.launchers_from = pods;
    d_.Requeue(std::chrono::milliseconds(500));
    return true;
  }
  d_.launcher_calls.clear();
  for (const json* pod : silent)
    unanswered.push_back("the ranks of pod " + PodName(*pod) + " on node " + kube::PinnedNode(*pod) +
                         " (its launcher did not report within " + std::to_string(bound) + " s)");
  if (unanswered.empty()) {
    const std::string message = stopped.empty() ? "the ranks stopped" : "the ranks " + stopped;
    SetCondition(kCheckpointingCondition, false, "Checkpointed", message);
    d_.events.push_back({"Normal", "Checkpointed", message + "; deleting the pods"});
  } else {
    std::string message;
    for (const std::string& u : unanswered) message += (message.empty() ? "" : "; ") + u;
    message += ": did not checkpoint and stop within the bound";
    SetCondition(kCheckpointingCondition, false, "CheckpointTimedOut", message);
    d_.events.push_back({"Warning", "CheckpointTimedOut", message + "; deleting the pods anyway"});
  }
  d_.Requeue(kAfterOwnWrite);
  return true;
}

}  // namespace meshtrain::controller
