#include "operator/controller/decide.h"

#include <algorithm>
#include <cstdio>

#include "api/json_codec.h"
#include "api/layout.h"
#include "api/worker_contract.h"
#include "operator/controller/builders.h"
#include "operator/kube/objects.h"
#include "operator/kube/time.h"
#include "operator/scheduler/cost_model.h"
#include "operator/scheduler/placement.h"
#include "operator/scheduler/planner.h"

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

bool Finished(const std::string& phase) { return phase == "Succeeded" || phase == "Failed"; }

std::string Label(const json& object, const char* label) {
  return object.value("metadata", json::object()).value("labels", json::object()).value(label, "");
}

// One pass of Decide: the observation, and the decision it builds up.
class Decider {
 public:
  Decider(const Observed& observed, const DecideOptions& options)
      : o_(observed), options_(options), job_(observed.checked.job), defaults_(observed.checked.defaults) {
    d_.status = observed.status;
    if (observed.checked.ok())
      ApplyWorkerDefaults(options.worker, observed.object.value("spec", json::object()), &job_, &defaults_);
  }

  Decision Run() {
    Judge();
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

 private:
  int64_t generation() const { return job_.metadata.generation; }

  // The state of `node`; one the caches do not know makes the decision rest on its absence.
  NodeState NodeOf(const std::string& node) {
    const NodeState state = o_.node(node);
    if (state == NodeState::kGone) d_.rests_on_absence = true;
    return state;
  }

  // What `pod` will hold on its node.
  static PodClaim ClaimOf(const json& pod) {
    const std::string key = kube::KeyOf(pod), where = "pod " + key + " spec";
    return {key, kube::PinnedNode(pod), scheduler::PodRequest(pod["spec"], "nvidia.com/gpu", where),
            scheduler::PodRequest(pod["spec"], "vpc.amazonaws.com/efa", where)};
  }
  int64_t nodes() const { return job_.spec.nodes; }
  // The placed gang's size: spec.nodes, or fewer while an elastic job is shrunk.
  int64_t gang_size() const { return d_.status.placement ? int64_t(d_.status.placement->nodes.size()) : nodes(); }

  void Judge() {
    const auto& policy = job_.spec.run_policy;
    // 1. A finished job: clean up its pods, then wait for the TTL.
    if (Finished(o_.status.phase)) {
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
      return;
    }
    // 2. Validation.
    if (!o_.checked.ok()) {
      std::string message;
      for (const auto& e : o_.checked.errors) message += (message.empty() ? "" : "; ") + e.ToString();
      return Fail("InvalidSpec", message);
    }
    d_.status.defaults = defaults_;
    ReportFieldsWithoutEffect();

    // 3. runPolicy: suspend and the deadline.
    if (policy.suspend) {
      if (o_.status.phase == "Suspended") {
        d_.delete_pods = o_.pods;  // the stored status records the suspension
        return;
      }
      d_.status.phase = "Suspended";
      d_.status.ready_workers = 0;
      SetCondition("Suspended", true, "Suspended", "spec.runPolicy.suspend is true; deleting the pods");
      SetCondition("Running", false, "Suspended", "suspended");
      return d_.Requeue(kAfterOwnWrite);
    }
    if (d_.status.phase == "Suspended") {
      d_.status.phase = "Pending";
      d_.status.placement.reset();
      SetCondition("Suspended", false, "Resumed", "spec.runPolicy.suspend is false; re-planning");
    }
    if (policy.active_deadline_seconds && !d_.status.start_time.empty()) {
      const int64_t left = *policy.active_deadline_seconds - kube::SecondsSince(d_.status.start_time, o_.now);
      if (left <= 0) {
        return Fail("DeadlineExceeded", "the job ran longer than spec.runPolicy.activeDeadlineSeconds (" +
                                            std::to_string(*policy.active_deadline_seconds) + " s)");
      }
      d_.Requeue(std::chrono::seconds(left));
    }

    // 4. Judge the current gang; pods of older gangs are leftovers of a recorded restart.
    const int64_t gang = GangOf(d_.status);
    std::vector<json> current;
    for (const auto& pod : o_.pods) {
      // A pod of this gang on another node than the stored placement gives its node rank
      // was replaced (ReplacePod): it goes too.
      if (Label(pod, kGangLabel) == std::to_string(gang) && !MovedAway(pod)) current.push_back(pod);
      else d_.delete_pods.push_back(pod);
    }
    const bool stale_left = !d_.delete_pods.empty() || o_.terminating > 0;
    // A gang restarting in place keeps its placement; a recreated one has none yet.
    const bool restarting_in_place = o_.status.phase == "Restarting" && o_.status.placement;
    const bool gang_started = d_.status.phase == "Starting" || d_.status.phase == "Running" || restarting_in_place;
    int succeeded = 0, ready = 0;
    for (const auto& pod : current) {
      const std::string phase = kube::PodPhase(pod);
      const std::string pod_name = pod["metadata"].value("name", "");
      const std::string node = kube::PinnedNode(pod);
      if (phase == "Failed") {
        const auto code = ExitCode(pod);
        const std::string what = "pod " + pod_name + " on node " + node + " failed" +
                                 (code ? " with exit code " + std::to_string(*code) : "");
        if (code && *code == api::worker::kExitPermanent)
          return Fail("PermanentError", what + " (a permanent failure; not restarting)");
        return Restart("PodFailed", what, node, true);
      }
      if (phase == "Succeeded") ++succeeded;
      if (phase == "Running" && kube::ConditionTrue(pod, "Ready")) ++ready;
      if (phase != "Succeeded" && !node.empty()) {
        const NodeState state = NodeOf(node);
        if (state != NodeState::kReady) {
          const std::string what =
              "node " + node + " of pod " + pod_name + (state == NodeState::kGone ? " is gone" : " is not Ready");
          if (gang_started && ReplacePod(current, pod, what)) return;
          return Restart("NodeNotReady", what, node, true);
        }
      }
      if (phase == "Pending") {
        const int64_t age = kube::SecondsSince(pod["metadata"].value("creationTimestamp", ""), o_.now);
        if (age >= options_.pending_timeout.count()) {
          return Restart("PodPendingTimeout",
                         "pod " + pod_name + " stayed Pending on node " + node + " for " + std::to_string(age) + " s",
                         node, false);
        }
        d_.Requeue(std::chrono::seconds(options_.pending_timeout.count() - age + 1));
      }
    }
    // The pod cache has not caught up with our creates or deletes: its pod events enqueue
    // the job, and this pass judges nothing it lacks.
    if (o_.awaiting_created_pods) return d_.Requeue(kAwaitCache);
    const auto have = static_cast<int64_t>(current.size());
    // A gang restarting in place gets a pod it lacks (one replaced) on the stored placement,
    // held at the attempt until its launcher starts with the others.
    // Fewer pods than the gang while the cache has shown every pod created: unless read
    // from the API server, that may be the cache's lag rather than a deletion.
    if (gang_started && have < gang_size()) d_.rests_on_absence = true;
    if (restarting_in_place && have < gang_size()) {
      if (!CreateHeldPods(gang, current)) {  // the failure that began this restart is counted
        return Restart("PodDeleted", "a pod of the gang restarting in place is gone, and the job's ConfigMap with it",
                       "", false);
      }
    } else if (gang_started && have < gang_size()) {
      return Restart("PodDeleted",
                     std::to_string(gang_size() - have) + " of " + std::to_string(gang_size()) + " pods of the gang were deleted",
                     "", true);
    }

    // 5. In place: a launcher whose ranks failed restarts the gang's attempt, and a gang
    //    restarting in place waits for its launchers to run the stored attempt.
    if (gang_started && DriveLaunchers(current, restarting_in_place)) return;

    // 6. The gang is not all there, or its placement is not recorded yet: create it, once
    //    the old gang is gone.
    if (!gang_started && (have < gang_size() || !d_.status.placement)) {
      if (stale_left) return d_.Requeue(std::chrono::milliseconds(500));
      return CreateGang(gang, current);
    }

    // 7. The gang exists: observe it.
    d_.status.ready_workers = ready;
    if (gang_started) d_.launchers_from = current;
    if (succeeded == gang_size()) {
      d_.status.phase = "Succeeded";
      d_.status.ready_workers = 0;
      d_.status.completion_time = kube::Rfc3339(o_.now);
      SetCondition("Succeeded", true, "AllPodsSucceeded", "all " + std::to_string(succeeded) + " pods exited with code 0");
      SetCondition("Running", false, "AllPodsSucceeded", "training finished");
      if (policy.ttl_seconds_after_finished) d_.Requeue(std::chrono::seconds(*policy.ttl_seconds_after_finished));
    } else if (ready == gang_size()) {
      d_.status.phase = "Running";
      SetCondition("Running", true, "AllWorkersReady", "all " + std::to_string(ready) + " workers are running");
      d_.progress_from = Rank0Pod(current, gang);
      TakeProgress();
      Grow(current);
    } else if (succeeded == 0) {
      d_.status.phase = "Starting";
    }
  }

  // A status write lets the next pass act on it (the job's own update enqueues it too).
  static constexpr std::chrono::milliseconds kAfterOwnWrite{100};
  // While the pod cache lags our own writes: in case no event comes (Expectations time out).
  static constexpr std::chrono::seconds kAwaitCache{5};

  void SetCondition(const std::string& type, bool value, const std::string& reason, const std::string& message) {
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
  void Fail(const std::string& reason, const std::string& message) {
    d_.status.phase = "Failed";
    d_.status.ready_workers = 0;
    d_.status.completion_time = kube::Rfc3339(o_.now);
    SetCondition("Failed", true, reason, message);
    SetCondition("Running", false, reason, message);
    d_.Requeue(kAfterOwnWrite);
  }

  // Counts a failure; false, with the job failed, when it is one more than backoffLimit.
  bool WithinBackoffLimit(const std::string& message) {
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
  void Restart(const std::string& reason, const std::string& message, const std::string& bad_node, bool failure,
               const char* kind = "recreated") {
    if (failure && !WithinBackoffLimit(message)) return;
    d_.avoid_node = bad_node;
    RecordRestart(reason, kind, message, {failure ? "Warning" : "Normal", reason, message + "; restarting the gang"},
                  failure);
    // A new gang's number is one no gang had (no more than restarts), so its pod names
    // never meet an old gang's.
    d_.status.gang = d_.status.restarts;
    d_.status.placement.reset();
  }

  // Records the next attempt of the same pods: the passes after the write stop every
  // launcher's ranks and then start them again together (DriveLaunchers).
  void RestartInPlace(const std::string& message) {
    if (!WithinBackoffLimit(message)) return;
    BeginNextAttempt("RankFailed", "in_place", true, message,
                     message + "; restarting the gang in place: attempt " + std::to_string(d_.status.restarts + 1));
  }

  // The next attempt of the gang's pods after a failure already counted, which
  // DriveLaunchers then carries out, with a Restarted Event.
  // A `new_failure` sets status.lastFailureTime; the recovery is measured from the first.
  void BeginNextAttempt(const std::string& reason, const char* kind, bool new_failure, const std::string& message,
                        const std::string& event) {
    RecordRestart(reason, kind, message,
                  {"Warning", "Restarted", event + " (backoffLimit " + std::to_string(job_.spec.run_policy.backoff_limit) + ")"},
                  new_failure);
    d_.status.gang = GangOf(o_.status);  // the same pods, also where status.gang was unset
  }

  // What every restart writes: the next attempt, Restarting, the conditions and the Event.
  void RecordRestart(const std::string& reason, const char* kind, const std::string& message, PendingEvent event,
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

  // The node rank of a pod of the gang; -1 when its label is not one of status.placement's.
  int64_t NodeRankOf(const json& pod) const {
    const int64_t rank = NodeRankLabel(pod);
    return d_.status.placement && rank < int64_t(d_.status.placement->nodes.size()) ? rank : -1;
  }

  bool MovedAway(const json& pod) const {
    const int64_t rank = NodeRankOf(pod);
    return rank >= 0 && kube::PinnedNode(pod) != d_.status.placement->nodes[size_t(rank)].name;
  }

  // Node replacement: the pod on a lost node moves to the free node nearest it, and the
  // others restart in place. False, changing nothing, when that cannot be done: a pod of
  // the gang is not running with a launcher that answers, or no node can take its place.
  // The passes after the write delete the lost pod, create its successor held at the new
  // attempt (CreateHeldPods) and start the attempt on every pod together (DriveLaunchers).
  bool ReplacePod(const std::vector<json>& current, const json& lost, const std::string& what) {
    const int64_t rank = NodeRankOf(lost);
    if (rank < 0 || int64_t(current.size()) != gang_size()) return false;
    for (const json& pod : current) {
      if (kube::Uid(pod) == kube::Uid(lost)) continue;
      if (kube::PodPhase(pod) != "Running" || !o_.launchers.count(kube::Uid(pod))) return false;
      if (NodeOf(kube::PinnedNode(pod)) != NodeState::kReady) return false;  // two nodes lost: a new gang
    }
    const std::optional<api::TrainingJob> sized = JobOfSize(gang_size());
    if (!sized) return false;
    const scheduler::Placement gang = StoredPlacement();
    const scheduler::PlacementRequest request = scheduler::PlacementRequest::ForJob(*sized, o_.avoided_nodes);
    const scheduler::Placement moved = scheduler::PlaceReplacement(request, o_.cluster(), gang, size_t(rank));
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

  // The placement status.placement records, as the scheduler writes one. REQUIRES: it has one.
  scheduler::Placement StoredPlacement() const {
    scheduler::Placement placement;
    for (const api::PlacedNode& n : d_.status.placement->nodes) {
      placement.nodes.push_back(n.name);
      placement.paths.push_back(n.topology_path);
    }
    return placement;
  }

  // The gang's pods it lacks while restarting in place, on their stored nodes, their
  // launchers held at the attempt; the ConfigMap's rank table names those nodes. False
  // when the ConfigMap is gone: a new gang, then.
  bool CreateHeldPods(int64_t gang, const std::vector<json>& current) {
    const std::optional<json> existing = o_.config_map();
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
  bool DriveLaunchers(const std::vector<json>& current, bool restarting_in_place) {
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

  // Well inside a launcher's hold (MESHTRAIN_LAUNCHER_HOLD_SECONDS, 60 by default).
  static constexpr std::chrono::seconds kRenewHold{10};

  // Sets the SpecWarnings condition (False once no warning is left), with a Warning Event
  // when the warnings changed.
  void ReportFieldsWithoutEffect() {
    const auto& warnings = o_.checked.warnings;
    std::string message;
    for (const auto& w : warnings) message += (message.empty() ? "" : "; ") + w.ToString();
    const auto& stored = o_.status.conditions;
    const auto had = std::find_if(stored.begin(), stored.end(),
                                  [](const api::Condition& c) { return c.type == kSpecWarningsCondition; });
    if (warnings.empty()) {
      if (had != stored.end()) SetCondition(kSpecWarningsCondition, false, "NoFieldsWithoutEffect", "");
      return;
    }
    SetCondition(kSpecWarningsCondition, true, "FieldsWithoutEffect", message);
    if (had == stored.end() || had->status != "True" || had->message != message)
      d_.events.push_back({"Warning", "FieldsWithoutEffect", message});
  }

  // The rank table of an interrupted creation of this gang, when its nodes are still usable.
  std::optional<api::RankTable> ReusableTable(const std::optional<json>& existing, int64_t gang) const {
    if (!existing || Label(*existing, kGangLabel) != std::to_string(gang)) return std::nullopt;
    api::FieldErrors errors;
    const json data = existing->value("data", json::object());
    api::RankTable table =
        api::DecodeRankTable(json::parse(data.value("rank-table.json", "{}"), nullptr, false), &errors);
    const auto size = static_cast<int64_t>(table.nodes.size());
    if (!errors.empty() || size > nodes() || size < job_.spec.elastic.min_nodes.value_or(nodes())) return std::nullopt;
    for (const auto& n : table.nodes)
      if (o_.node(n.name) != NodeState::kReady || o_.avoided_nodes.count(n.name)) return std::nullopt;
    return table;
  }

  static std::string LayoutText(const api::LayoutStatus& l) {
    scheduler::LayoutChoice choice;
    choice.tp = int(l.tensor_parallel_degree);
    choice.shard = int(l.hybrid_shard_degree);
    choice.micro_batch = int(l.micro_batch_size);
    choice.activations = {l.activation_checkpointing, l.activation_offloading, int(l.activation_loading_horizon)};
    choice.pipeline = {int(l.pipeline_parallel_degree), int(l.pipeline_virtual_stages),
                       api::ParsePipelineSchedule(l.pipeline_schedule)};
    return scheduler::Describe(choice);
  }

  // spec.parallelism.mode auto: the planner's layout for the placed nodes, written into
  // *written_spec; nullopt when none fits, with the job left Pending and why.
  std::optional<api::LayoutStatus> PlanLayout(const api::TrainingJobSpec& spec, const scheduler::Placement& placement,
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

  // The job as a gang of `size` nodes runs it: the written spec with that many nodes,
  // checked and defaulted as its workers will; nullopt when the layout cannot split so.
  std::optional<api::TrainingJob> JobOfSize(int64_t size) const {
    if (size == nodes()) return job_;
    json object = o_.object;
    object["spec"]["nodes"] = size;
    object["spec"].erase("elastic");  // the operator shrinks and grows the gang; its workers need no more
    const api::CheckedJob checked = api::CheckTrainingJob(object, "spec.nodes " + std::to_string(size), 0);
    if (!checked.ok()) return std::nullopt;
    api::TrainingJob job = checked.job;
    job.metadata = job_.metadata;
    std::vector<api::DerivedDefault> derived;
    ApplyWorkerDefaults(options_.worker, object["spec"], &job, &derived);
    return job;
  }

  // spec.elastic: the largest smaller gang, down to minNodes, whose layout splits over it
  // and which the cluster can place. False, with `*reason` saying so, when there is none.
  bool PlaceSmaller(const scheduler::ClusterView& cluster, api::TrainingJob* sized, scheduler::Placement* placement,
                    scheduler::PlacementRequest* request, std::string* reason) const {
    const std::optional<int64_t> min_nodes = job_.spec.elastic.min_nodes;
    if (!min_nodes || *min_nodes >= nodes()) return false;
    for (int64_t size = nodes() - 1; size >= *min_nodes; --size) {
      const std::optional<api::TrainingJob> job = JobOfSize(size);
      if (!job) continue;
      scheduler::PlacementRequest smaller = scheduler::PlacementRequest::ForJob(*job, o_.avoided_nodes);
      scheduler::Placement placed = scheduler::Place(smaller, cluster);
      if (!placed.ok()) continue;
      *sized = *job;
      *placement = std::move(placed);
      *request = std::move(smaller);
      return true;
    }
    *reason += "; nor does a smaller gang of " + std::to_string(*min_nodes) + " to " + std::to_string(nodes() - 1) +
               " nodes (spec.elastic.minNodes)";
    return false;
  }

  // An elastic gang below spec.nodes grows back at each new checkpoint, once the whole
  // gang fits the cluster with the nodes it holds now counted as free.
  void Grow(const std::vector<json>& current) {
    if (gang_size() >= nodes() || !o_.progress || !o_.progress->checkpoint_step) return;
    if (o_.status.progress && o_.status.progress->checkpoint_step == o_.progress->checkpoint_step) return;
    const scheduler::ClusterView cluster = o_.cluster();
    std::map<size_t, scheduler::ReleasedUsage::Released> released;
    for (const json& pod : current) {
      const PodClaim held = ClaimOf(pod);
      const std::optional<size_t> node = cluster.topology->Find(held.node);
      if (!node) continue;
      released[*node].gpus += held.gpus;
      released[*node].efa += held.efa;
    }
    const scheduler::ClusterView grown{cluster.topology,
                                       std::make_shared<scheduler::ReleasedUsage>(cluster.usage, std::move(released))};
    if (!scheduler::Place(scheduler::PlacementRequest::ForJob(job_, o_.avoided_nodes), grown).ok()) return;
    Restart("Growing",
            "all " + std::to_string(nodes()) + " nodes fit again; the gang of " + std::to_string(gang_size()) +
                " grows back from the checkpoint of step " + std::to_string(*o_.progress->checkpoint_step),
            "", false, "grown");
  }

  void CreateGang(int64_t gang, const std::vector<json>& current) {
    const std::optional<json> existing = o_.config_map();
    std::optional<api::RankTable> table = ReusableTable(existing, gang);
    scheduler::Placement placement;
    auto request = scheduler::PlacementRequest::ForJob(job_, o_.avoided_nodes);
    api::TrainingJob sized = job_;  // the job at the gang's size
    // The cluster is read at most once, and only when placement or the planner needs it.
    std::optional<scheduler::ClusterView> cluster;
    auto snapshot = [&]() -> const scheduler::ClusterView& {
      if (!cluster) cluster = o_.cluster();
      return *cluster;
    };
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
    if (!table) {
      const auto started = std::chrono::steady_clock::now();
      placement = scheduler::Place(request, snapshot());
      std::string reason = placement.reason;
      if (!placement.ok() && !PlaceSmaller(snapshot(), &sized, &placement, &request, &reason)) placement.reason = reason;
      d_.placement_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
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
      layout = PlanLayout(sized.spec, placement, snapshot(), request.levels, &written_spec);
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
    for (const json& pod : objects.pods) d_.claims.push_back(ClaimOf(pod));
    d_.check_claims = !reused;  // a placement made now, from counters another gang may be taking from
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

  // The Event for a layout that changed: planned (mode auto), or an elastic gang that
  // shrank or grew, with the accumulation that keeps its global batch.
  void ReportLayout(const api::LayoutStatus& layout, const api::TrainingJobSpec& spec) {
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

  // Rank 0's latest reading, and a Resumed Event when the gang reports a new resume.
  void TakeProgress() {
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

  const Observed& o_;
  const DecideOptions& options_;
  api::TrainingJob job_;  // the job with the operator's worker defaults applied
  std::vector<api::DerivedDefault> defaults_;
  Decision d_;
};

}  // namespace

int64_t GangOf(const api::TrainingJobStatus& status) { return status.gang.value_or(status.restarts); }

std::optional<json> Rank0Pod(const std::vector<json>& pods, int64_t gang) {
  for (const auto& pod : pods)
    if (Label(pod, kGangLabel) == std::to_string(gang) && NodeRankLabel(pod) == 0) return pod;
  return std::nullopt;
}

Decision Decide(const Observed& observed, const DecideOptions& options) { return Decider(observed, options).Run(); }

}  // namespace meshtrain::controller
