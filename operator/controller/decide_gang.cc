// Judging the current gang from its pods and their nodes, and reading a gang that runs
// (decider.h).

#include <cstdio>

#include "api/worker_contract.h"
#include "operator/controller/builders.h"
#include "operator/controller/decider.h"
#include "operator/kube/objects.h"
#include "operator/kube/time.h"

namespace meshtrain::controller {

using nlohmann::json;

namespace {

std::optional<int> ExitCode(const json& pod) {
  for (const auto& cs : pod.value("status", json::object()).value("containerStatuses", json::array())) {
    const json state = cs.value("state", json::object());
    if (state.contains("terminated")) return state["terminated"].value("exitCode", 0);
  }
  return std::nullopt;
}

}  // namespace

Decider::Gang Decider::FindGang() {
  Gang gang;
  gang.number = GangOf(d_.status);
  for (const auto& pod : o_.pods) {
    // A pod of this gang on another node than the stored placement gives its node rank
    // was replaced (ReplacePod): it goes too.
    if (LabelOf(pod, kGangLabel) == std::to_string(gang.number) && !MovedAway(pod)) gang.pods.push_back(pod);
    else d_.delete_pods.push_back(pod);
  }
  gang.stale_left = !d_.delete_pods.empty() || o_.terminating > 0;
  // A gang restarting in place keeps its placement; a recreated one has none yet.
  gang.restarting_in_place = o_.status.phase == "Restarting" && o_.status.placement;
  gang.started = d_.status.phase == "Starting" || d_.status.phase == "Running" || gang.restarting_in_place;
  return gang;
}

bool Decider::JudgePods(Gang* gang) {
  for (const auto& pod : gang->pods) {
    const std::string phase = kube::PodPhase(pod);
    const std::string pod_name = pod["metadata"].value("name", "");
    const std::string node = kube::PinnedNode(pod);
    if (phase == "Failed") {
      const auto code = ExitCode(pod);
      const std::string what = "pod " + pod_name + " on node " + node + " failed" +
                               (code ? " with exit code " + std::to_string(*code) : "");
      if (code && *code == api::worker::kExitPermanent)
        Fail("PermanentError", what + " (a permanent failure; not restarting)");
      else
        Restart("PodFailed", what, node, true);
      return true;
    }
    if (phase == "Succeeded") ++gang->succeeded;
    if (phase == "Running" && kube::ConditionTrue(pod, "Ready")) ++gang->ready;
    if (phase != "Succeeded" && !node.empty()) {
      const NodeState state = NodeOf(node);
      if (state != NodeState::kReady) {
        const std::string what =
            "node " + node + " of pod " + pod_name + (state == NodeState::kGone ? " is gone" : " is not Ready");
        if (!(gang->started && ReplacePod(gang->pods, pod, what))) Restart("NodeNotReady", what, node, true);
        return true;
      }
    }
    if (phase == "Pending") {
      const int64_t age = kube::SecondsSince(pod["metadata"].value("creationTimestamp", ""), o_.now);
      if (age >= options_.pending_timeout.count()) {
        Restart("PodPendingTimeout",
                "pod " + pod_name + " stayed Pending on node " + node + " for " + std::to_string(age) + " s", node,
                false);
        return true;
      }
      d_.Requeue(std::chrono::seconds(options_.pending_timeout.count() - age + 1));
    }
  }
  return false;
}

bool Decider::JudgeMissingPods(const Gang& gang) {
  const auto have = static_cast<int64_t>(gang.pods.size());
  if (!gang.started || have >= gang_size()) return false;
  // Fewer pods than the gang while the cache has shown every pod created: unless read
  // from the API server, that may be the cache's lag rather than a deletion.
  d_.rests_on_absence = true;
  if (!gang.restarting_in_place) {
    Restart("PodDeleted",
            std::to_string(gang_size() - have) + " of " + std::to_string(gang_size()) + " pods of the gang were deleted",
            "", true);
    return true;
  }
  // A gang restarting in place gets a pod it lacks (one replaced) on the stored placement,
  // held at the attempt until its launcher starts with the others.
  if (LacksConfigMap()) return true;
  if (!CreateHeldPods(gang.number, gang.pods)) {  // the failure that began this restart is counted
    Restart("PodDeleted", "a pod of the gang restarting in place is gone, and the job's ConfigMap with it", "", false);
    return true;
  }
  return false;
}

void Decider::ReadGang(const Gang& gang) {
  d_.status.ready_workers = gang.ready;
  if (gang.started) d_.launchers_from = gang.pods;
  if (gang.succeeded == gang_size()) {
    d_.status.phase = "Succeeded";
    d_.status.ready_workers = 0;
    d_.status.completion_time = kube::Rfc3339(o_.now);
    SetCondition("Succeeded", true, "AllPodsSucceeded",
                 "all " + std::to_string(gang.succeeded) + " pods exited with code 0");
    SetCondition("Running", false, "AllPodsSucceeded", "training finished");
    if (const auto ttl = job_.spec.run_policy.ttl_seconds_after_finished) d_.Requeue(std::chrono::seconds(*ttl));
  } else if (gang.ready == gang_size()) {
    d_.status.phase = "Running";
    SetCondition("Running", true, "AllWorkersReady", "all " + std::to_string(gang.ready) + " workers are running");
    d_.progress_from = Rank0Pod(gang.pods, gang.number);
    ReportPodsReady(gang.ready);
    TakeProgress();
    Grow(gang.pods);
  } else if (gang.succeeded == 0) {
    d_.status.phase = "Starting";
  }
}

// Rank 0's latest reading, and a Resumed Event when the gang reports a new resume.
void Decider::TakeProgress() {
  if (!o_.progress) return;
  const api::ProgressStatus& progress = *o_.progress;
  d_.status.progress = progress;
  if (progress.step > progress.resumed_from_step.value_or(0)) {
    if (const auto seconds = kube::PreciseSecondsSince(d_.status.last_failure_time, o_.now)) {
      d_.recovery_seconds = *seconds;
      char message[160];
      std::snprintf(message, sizeof message, "the gang trained step %lld %.1f s after the failure that restarted it",
                    static_cast<long long>(progress.step), *seconds);
      d_.events.push_back({"Normal", "Recovered", message});
    }
    d_.status.last_failure_time.clear();
  }
  const std::optional<int64_t> before = o_.status.progress ? o_.status.progress->resumed_from_step : std::nullopt;
  if (!progress.resumed_from_step || progress.resumed_from_step == before) return;
  const int64_t damaged = progress.damaged_checkpoints.value_or(0);
  d_.events.push_back({damaged > 0 ? "Warning" : "Normal", "Resumed",
                       "the gang (restart " + std::to_string(d_.status.restarts) +
                           ") resumed from the checkpoint of step " + std::to_string(*progress.resumed_from_step) +
                           (damaged > 0 ? ", skipping " + std::to_string(damaged) +
                                              " newer damaged one(s) (rank 0's log names each file and what is wrong)"
                                        : "")});
}

int64_t Decider::NodeRankOf(const json& pod) const {
  const int64_t rank = NodeRankLabel(pod);
  return d_.status.placement && rank < int64_t(d_.status.placement->nodes.size()) ? rank : -1;
}

bool Decider::MovedAway(const json& pod) const {
  const int64_t rank = NodeRankOf(pod);
  return rank >= 0 && kube::PinnedNode(pod) != d_.status.placement->nodes[size_t(rank)].name;
}

}  // namespace meshtrain::controller
