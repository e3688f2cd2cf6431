// Restarts in place: the launchers of a started gang run the next attempt of the same
// pods, and a pod on a lost node moves to a replacement node held at that attempt
// (decider.h).

#include "api/json_codec.h"
#include "api/worker_contract.h"
#include "operator/controller/builders.h"
#include "operator/controller/decider.h"
#include "operator/kube/objects.h"
#include "operator/scheduler/cost_model.h"

namespace meshtrain::controller {

using nlohmann::json;

// Records the next attempt of the same pods: the passes after the write stop every
// launcher's ranks and then start them again together (DriveLaunchers).
void Decider::RestartInPlace(const std::string& message) {
  if (!WithinBackoffLimit(message)) return;
  BeginNextAttempt("RankFailed", "in_place", true, message,
                   message + "; restarting the gang in place: attempt " + std::to_string(d_.status.restarts + 1));
}

// The next attempt of the gang's pods after a failure already counted, which
// DriveLaunchers then carries out, with a Restarted Event.
// A `new_failure` sets status.lastFailureTime; the recovery is measured from the first.
void Decider::BeginNextAttempt(const std::string& reason, const char* kind, bool new_failure,
                               const std::string& message, const std::string& event) {
  RecordRestart(reason, kind, message,
                {"Warning", "Restarted", event + " (backoffLimit " + std::to_string(job_.spec.run_policy.backoff_limit) + ")"},
                new_failure);
  d_.status.gang = GangOf(o_.status);  // the same pods, also where status.gang was unset
}

// Node replacement: the pod on a lost node moves to the free node nearest it, and the
// others restart in place. False, changing nothing, when that cannot be done: a pod of
// the gang is not running with a launcher that answers, or no node can take its place.
// True too when the observation lacks the cluster (Decision::needs).
// The passes after the write delete the lost pod, create its successor held at the new
// attempt (CreateHeldPods) and start the attempt on every pod together (DriveLaunchers).
bool Decider::ReplacePod(const std::vector<json>& current, const json& lost, const std::string& what) {
  const int64_t rank = NodeRankOf(lost);
  if (rank < 0 || int64_t(current.size()) != gang_size()) return false;
  // Under a Kueue TAS assignment, Kueue places the pods: the gang is recreated on the
  // assignment as it stands (decide_kueue.cc), never on a node the operator chose.
  if (admitted_ && HasTopologyAssignment(*admitted_)) return false;
  for (const json& pod : current) {
    if (kube::Uid(pod) == kube::Uid(lost)) continue;
    if (kube::PodPhase(pod) != "Running" || !o_.launchers.count(kube::Uid(pod))) return false;
    if (NodeOf(kube::PinnedNode(pod)) != NodeState::kReady) return false;  // two nodes lost: a new gang
  }
  const std::optional<api::TrainingJob> sized = JobOfSize(gang_size());
  if (!sized) return false;
  const scheduler::Placement gang = StoredPlacement();
  if (LacksCluster()) return true;
  const scheduler::PlacementRequest request = scheduler::PlacementRequest::ForJob(*sized, o_.avoided_nodes);
  const scheduler::Placement moved = scheduler::PlaceReplacement(request, *o_.cluster, gang, size_t(rank));
  if (!moved.ok()) {
    d_.events.push_back({"Warning", "NoReplacement", what + "; " + moved.reason});
    return false;
  }
  // A gang already restarting for this loss (its ranks failed in collectives first)
  // counts it once.
  const bool counted = o_.status.phase == "Restarting";
  if (!counted && !WithinBackoffLimit(what)) return true;
  const std::string& node = moved.nodes[size_t(rank)];
  d_.avoid_node = kube::PinnedNode(lost);
  d_.status.placement->nodes[size_t(rank)] = {rank, node, moved.paths[size_t(rank)]};
  d_.status.placement->cost_seconds_per_step =
      scheduler::EstimateStepCost(sized->spec, moved.paths, scheduler::LinkModel(request.levels)).seconds;
  std::string shared;
  for (size_t l = 0; l + 1 < moved.paths[size_t(rank)].size() && moved.paths[size_t(rank)][l] == gang.paths[size_t(rank)][l]; ++l)
    shared += (shared.empty() ? "" : "/") + moved.paths[size_t(rank)][l];
  BeginNextAttempt("NodeLost", "replaced", !counted, what,
                   what + "; its node rank " + std::to_string(rank) + " moves to node " + node +
                       (shared.empty() ? "" : " (in " + shared + ")") +
                       " and the other pods restart in place: attempt " + std::to_string(d_.status.restarts + 1));
  // The node is taken now for the pod that CreateHeldPods will put there.
  d_.claims.push_back({o_.ns + "/" + HeldPodName(o_.name, *d_.status.gang, rank, d_.status.restarts), node,
                       request.gpus_per_node, request.efa_per_node});
  d_.check_claims = true;
  return true;
}

scheduler::Placement Decider::StoredPlacement() const {
  scheduler::Placement placement;
  for (const api::PlacedNode& n : d_.status.placement->nodes) {
    placement.nodes.push_back(n.name);
    placement.paths.push_back(n.topology_path);
  }
  return placement;
}

// The gang's pods it lacks while restarting in place, on their stored nodes, their
// launchers held at the attempt; the ConfigMap's rank table names those nodes. False
// when the ConfigMap is gone: a new gang, then. REQUIRES: !LacksConfigMap().
bool Decider::CreateHeldPods(int64_t gang, const std::vector<json>& current) {
  const std::optional<json> existing = ExistingConfigMap();
  const std::optional<api::TrainingJob> sized = JobOfSize(gang_size());
  if (!existing || !sized) return false;
  const api::RankTable table =
      scheduler::MakeRankTable(StoredPlacement(), sized->spec.topology.levels, sized->spec.gpus_per_node);
  GangObjects objects;
  objects.service = BuildService(job_);
  objects.config_map = *existing;
  objects.config_map["data"]["rank-table.json"] = api::ToJson(table).dump(2);
  objects.replace_config_map = objects.config_map != *existing;
  if (options_.worker.network_policy.enabled)
    objects.network_policy = BuildNetworkPolicy(job_, options_.worker.network_policy);
  std::set<int64_t> present;
  for (const json& pod : current) present.insert(NodeRankOf(pod));
  for (int64_t rank = 0; rank < gang_size(); ++rank) {
    if (!present.count(rank))
      objects.pods.push_back(BuildPod(job_, table, gang, rank, d_.status.restarts, options_.worker, /*held=*/true));
  }
  for (const json& pod : objects.pods) d_.claims.push_back(ClaimOf(pod));  // on the nodes ReplacePod took
  d_.create = std::move(objects);
  return true;
}

// The launchers of a started gang. Returns true when this pass decided what to do: a
// failed attempt restarts the gang in place (or fails the job), and a gang restarting in
// place has its launchers stopped at the stored attempt, then started once all have
// stopped. Returns false when every launcher runs the stored attempt (or has not been
// read yet, outside a restart).
bool Decider::DriveLaunchers(const std::vector<json>& current, bool restarting_in_place) {
  const int64_t attempt = o_.status.restarts;
  std::vector<const LauncherState*> states;
  for (const json& pod : current) {
    const auto it = o_.launchers.find(kube::Uid(pod));
    states.push_back(it == o_.launchers.end() ? nullptr : &it->second);
  }
  // A rank whose collective failed (kExitCommFailure) is most often the victim of another
  // rank's failure: that one is named, when a launcher reports it.
  std::optional<size_t> failed;
  bool others_may_report = false;
  for (size_t i = 0; i < current.size(); ++i) {
    const LauncherState* s = states[i];
    if (!s || (s->attempt == attempt && s->state == "running")) others_may_report = true;
    if (!s || s->attempt != attempt || s->state != "failed") continue;
    if (s->exit_code != api::worker::kExitCommFailure) {
      failed = i;
      break;
    }
    if (!failed) failed = i;
  }
  // ... for a moment: a launcher whose ranks still wait in collectives would keep it
  // waiting until its ranks time out.
  constexpr std::chrono::seconds kWaitForTheCause{2};
  if (failed && states[*failed]->exit_code == api::worker::kExitCommFailure && others_may_report &&
      o_.now - o_.failure_seen.value_or(o_.now) < kWaitForTheCause) {
    d_.launchers_from = current;
    d_.Requeue(std::chrono::milliseconds(200));
    return true;
  }
  if (failed) {
    const size_t i = *failed;
    const LauncherState* s = states[i];
    // The rank's own words, where it left some, say what its status cannot: the rank a
    // hang detector found stuck, the peer a collective lost.
    const std::string what = (s->rank ? "rank " + std::to_string(*s->rank) : std::string("a rank")) + " in pod " +
                             current[i]["metadata"].value("name", "") + " on node " + kube::PinnedNode(current[i]) +
                             " failed" + (s->exit_code ? " with exit code " + std::to_string(*s->exit_code) : "") +
                             (s->exit_code == api::worker::kExitCommFailure ? " in a collective" : "") +
                             (s->reason.empty() ? "" : ": " + s->reason);
    if (s->exit_code == api::worker::kExitPermanent) {
      Fail("PermanentError", what + " (a permanent failure; not restarting)");
      return true;
    }
    // A pod whose ranks all finished has no launcher left to restart: new pods, then.
    for (const json& pod : current) {
      if (kube::PodPhase(pod) != "Succeeded") continue;
      Restart("RankFailed", what + " after pod " + pod["metadata"].value("name", "") + " finished", kube::PinnedNode(current[i]), true);
      return true;
    }
    RestartInPlace(what);
    return true;
  }
  if (!restarting_in_place) return false;
  for (const json& pod : current) {
    if (kube::PodPhase(pod) != "Succeeded") continue;
    // Its launcher has exited: the restart already counted goes on with new pods.
    Restart("PodFinished", "pod " + pod["metadata"].value("name", "") + " finished during an in-place restart", "", false);
    return true;
  }
  // A pod not created yet (a replacement) keeps the others from starting; while it comes
  // up (a node to schedule, an image to pull), the stop is repeated to the launchers that
  // wait, as each instruction renews their hold.
  const bool whole = int64_t(current.size()) == gang_size();
  bool all_stopped = whole, all_running = whole;
  for (size_t i = 0; i < current.size(); ++i) {
    const LauncherState* s = states[i];
    const bool at_attempt = s && s->attempt == attempt;
    if (!s || s->attempt < attempt || (!whole && s->state == "ready"))
      d_.launcher_calls.push_back({current[i], "stop", attempt});
    all_stopped = all_stopped && at_attempt && (s->state == "ready" || s->state == "running");
    all_running = all_running && at_attempt && s->state == "running";
  }
  d_.launchers_from = current;
  if (all_running) {
    const std::string message = "every launcher runs attempt " + std::to_string(attempt);
    d_.status.phase = "Starting";
    SetCondition("Restarting", false, "RestartedInPlace", message);
    return false;
  }
  if (all_stopped) {
    for (size_t i = 0; i < current.size(); ++i)
      if (states[i]->state == "ready") d_.launcher_calls.push_back({current[i], "start", attempt});
  }
  // The launchers' answers and the new pod's arrival enqueue the job sooner.
  d_.Requeue(whole ? std::chrono::milliseconds(200) : kRenewHold);
  return true;
}

}  // namespace meshtrain::controller
