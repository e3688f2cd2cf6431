#include "operator/controller/reconciler.h"

#include <openssl/rand.h>
#include <spdlog/spdlog.h>

#include <stdexcept>

#include "api/json_codec.h"
#include "api/manifest.h"
#include "operator/controller/builders.h"
#include "operator/controller/kueue.h"
#include "operator/controller/launcher_client.h"
#include "operator/kube/objects.h"
#include "operator/kube/time.h"

namespace meshtrain::controller {

using nlohmann::json;
using Clock = std::chrono::steady_clock;
namespace res = kube::resources;

namespace {

// A job's rendezvous Store key: 32 random bytes.
std::string NewStoreKey() {
  std::string key(32, '\0');
  if (RAND_bytes(reinterpret_cast<unsigned char*>(key.data()), static_cast<int>(key.size())) != 1)
    throw std::runtime_error("drawing a random Store key failed (OpenSSL RAND_bytes)");
  return key;
}

}  // namespace

std::vector<std::string> PodJobKeys(const json& pod) {
  std::string job = JobKeyOf(pod);
  if (job.empty()) return {};
  return {std::move(job)};
}

std::vector<std::string> PodNodes(const json& pod) {
  std::string node = kube::PinnedNode(pod);
  if (node.empty()) return {};
  return {std::move(node)};
}

Reconciler::Reconciler(kube::Client& client, kube::Informer& jobs, kube::Informer& pods, ClusterState& cluster,
                       PodPoller* progress, PodPoller* launchers, OperatorMetrics* metrics, ReconcilerOptions options)
    : client_(client),
      jobs_(jobs),
      pods_(pods),
      cluster_(cluster),
      progress_(progress),
      launchers_(launchers),
      metrics_(metrics),
      options_(std::move(options)) {}

ReconcileResult Reconciler::Reconcile(const std::string& ns, const std::string& name) {
  const std::string key = kube::ObjectKey(ns, name);
  std::optional<Observed> observed = Observe(ns, name);
  if (!observed) {
    Forget(key);
    return {};
  }
  double decided_in = 0;  // seconds
  Decision decision = DecideObserved(&*observed, &decided_in);
  if (decision.rests_on_absence && !observed->live) {
    // A pod or node the caches lack is no proof that it is gone: ask the API server.
    ObserveLive(&*observed);
    decision = DecideObserved(&*observed, &decided_in);
    if (metrics_) metrics_->AbsenceChecked(decision.rests_on_absence);
    if (!decision.rests_on_absence)
      spdlog::info("{}: the caches lack a pod or node that the API server has: decided from its answer", key);
  }
  if (decision.delete_job) {
    client_.Delete(res::TrainingJobs(), ns, name);
    spdlog::info("{}: deleted {} s after it finished (ttlSecondsAfterFinished)", key,
                 *observed->checked.job.spec.run_policy.ttl_seconds_after_finished);
    return {};
  }
  if (!decision.claims.empty() && !cluster_.Reserve(key, decision.claims, decision.check_claims, Clock::now())) {
    // Another gang took some of these GPUs since this placement read what was free: place
    // again from the counters as they are now.
    if (metrics_) metrics_->PlacementConflict();
    return {std::chrono::milliseconds(1)};
  }
  if (decision.placed && metrics_) metrics_->Placed(decided_in);
  try {
    Act(*observed, decision);
  } catch (...) {
    ReleaseUncreated(key, decision);
    throw;
  }
  if (!WriteStatus(*observed, decision)) {
    // Our view was stale: decide again from the re-read object rather than overwrite a
    // status computed from newer facts.
    ReleaseUncreated(key, decision);
    return {std::chrono::milliseconds(50)};
  }
  if (!decision.avoid_node.empty()) {
    std::lock_guard lock(mu_);
    avoid_[key][decision.avoid_node] = Clock::now();
  }
  if (!decision.restart_kind.empty() && metrics_) metrics_->GangRestarted(decision.restart_kind);
  if (decision.recovery_seconds && metrics_) metrics_->Recovered(*decision.recovery_seconds);
  for (const auto& event : decision.events) Emit(*observed, event);
  return {decision.requeue_after};
}

std::optional<Observed> Reconciler::Observe(const std::string& ns, const std::string& name) {
  Observed o;
  o.ns = ns;
  o.name = name;
  o.now = std::chrono::system_clock::now();
  const std::string key = kube::ObjectKey(ns, name);
  auto cached = jobs_.Get(key);
  if (!cached) return std::nullopt;
  o.object = std::move(*cached);
  bool read_live = false;
  {
    // The cache still holds a version one of our status writes replaced: acting on that old
    // status would undo the write. The write's answer is the job as stored since (or, after
    // a 409, the API server's).
    std::lock_guard lock(mu_);
    auto it = written_.find(key);
    if (it != written_.end()) {
      if (!it->second.replaced.count(o.object["metadata"].value("resourceVersion", ""))) written_.erase(it);
      else if (it->second.object.is_null()) read_live = true;
      else o.object = it->second.object;
    }
  }
  if (read_live) {
    try {
      o.object = client_.Get(res::TrainingJobs(), ns, name);
    } catch (const kube::KubeError& e) {
      if (e.kind() == kube::ErrorKind::kNotFound) return std::nullopt;
      throw;
    }
  }
  o.checked = api::CheckTrainingJob(o.object, "TrainingJob " + key, 0);
  auto& meta = o.checked.job.metadata;
  meta.generation = o.object["metadata"].value("generation", int64_t{1});
  meta.uid = o.object["metadata"].value("uid", "");
  meta.namespace_ = ns;
  {
    api::FieldErrors ignored;
    o.status = api::DecodeTrainingJobStatus(o.object.value("status", json::object()), &ignored);
  }

  // The job's pods (the pod cache's index by job), less those being deleted: by us, until
  // the cache drops them, or by anyone (deletionTimestamp). The pods in flight are read
  // first: any the cache met since is in what it shows now.
  const ClusterState::InFlightPods in_flight = cluster_.InFlight(key, Clock::now());
  std::set<std::string> unseen = in_flight.creations;
  for (json& pod : pods_.ByIndex(kPodsByJob, key)) {
    bool owned = false;
    for (const auto& ref : pod["metadata"].value("ownerReferences", json::array())) owned = owned || ref.value("uid", "") == meta.uid;
    if (!owned) continue;
    unseen.erase(kube::KeyOf(pod));
    if (in_flight.deletions.count(kube::Uid(pod)) || pod["metadata"].contains("deletionTimestamp")) ++o.terminating;
    else o.pods.push_back(std::move(pod));
  }
  // A created pod the cache has not shown yet is not a deleted one.
  o.awaiting_created_pods = !unseen.empty();
  {
    std::lock_guard lock(mu_);
    auto& failed = avoid_[key];
    for (auto it = failed.begin(); it != failed.end();) {
      if (Clock::now() - it->second > options_.avoid_failed_node) {
        it = failed.erase(it);
      } else {
        o.avoided_nodes.insert(it->first);
        ++it;
      }
    }
  }
  ObserveNodes(&o);
  if (const auto rank0 = Rank0Pod(o.pods, GangOf(o.status)); rank0 && progress_) {
    if (const auto reading = progress_->Latest(key, *rank0)) {
      api::FieldErrors ignored;
      o.progress = api::DecodeProgressStatus(*reading, &ignored);
    }
  }
  if (launchers_) {
    bool failed = false;
    for (const json& pod : o.pods) {
      const auto reading = launchers_->Latest(key, pod);
      if (!reading) continue;
      if (const auto state = ParseLauncherState(*reading)) {
        o.launchers[kube::Uid(pod)] = *state;
        failed = failed || (state->attempt == o.status.restarts && state->state == "failed");
      }
    }
    std::lock_guard lock(mu_);
    auto [seen, first] = failure_seen_.try_emplace(key, std::make_pair(o.status.restarts, o.now));
    if (!first && seen->second.first != o.status.restarts) seen->second = {o.status.restarts, o.now};
    if (failed) o.failure_seen = seen->second.second;
    else failure_seen_.erase(seen);
  }
  return o;
}

void Reconciler::ObserveLive(Observed* o) {
  const std::string& uid = o->checked.job.metadata.uid;
  const json list = client_.List(res::Pods(), o->ns, {std::string(kJobNameLabel) + "=" + o->name, "", ""});
  o->pods.clear();
  o->terminating = 0;
  for (const json& pod : list.value("items", json::array())) {
    bool owned = false;
    for (const auto& ref : pod["metadata"].value("ownerReferences", json::array())) owned = owned || ref.value("uid", "") == uid;
    if (!owned) continue;
    if (pod["metadata"].contains("deletionTimestamp")) ++o->terminating;
    else o->pods.push_back(pod);
  }
  o->awaiting_created_pods = false;  // every create has returned, so the API server has them
  o->live = true;
  o->nodes.clear();
  ObserveNodes(o);
}

void Reconciler::ObserveNodes(Observed* o) {
  for (const std::string& node : NodesOf(o->pods, o->config_map)) {
    if (o->nodes.count(node)) continue;
    NodeState state = cluster_.Node(node);
    if (state == NodeState::kGone && o->live) {
      // A node the cache lacks is read from the API server, once per pass.
      try {
        state = kube::ConditionTrue(client_.Get(res::Nodes(), "", node), "Ready") ? NodeState::kReady
                                                                                   : NodeState::kNotReady;
      } catch (const kube::KubeError& e) {
        if (e.kind() != kube::ErrorKind::kNotFound) throw;
      }
    }
    o->nodes.emplace(node, state);
  }
}

Decision Reconciler::DecideObserved(Observed* o, double* seconds) {
  for (;;) {
    const auto started = Clock::now();
    Decision decision = Decide(*o, options_.decide);
    *seconds = std::chrono::duration<double>(Clock::now() - started).count();
    if (!decision.needs.any()) return decision;
    // Each is read once per pass: the next Decide has it.
    if (decision.needs.cluster) o->cluster = cluster_.View();
    if (decision.needs.workload) o->workload = ReadWorkload(*o);
    if (decision.needs.flavors) o->flavors = ReadFlavors(o->workload.value_or(json()));
    if (decision.needs.priority_class) o->priority_class = ReadPriorityClass(*o);
    if (decision.needs.config_map) {
      try {
        o->config_map = client_.Get(res::ConfigMaps(), o->ns, ConfigMapName(o->name));
      } catch (const kube::KubeError& e) {
        if (e.kind() != kube::ErrorKind::kNotFound) throw;
        o->config_map = json();  // none
      }
      ObserveNodes(o);  // those its rank table names
    }
  }
}

json Reconciler::ReadWorkload(const Observed& o) {
  const auto& meta = o.checked.job.metadata;
  try {
    return client_.Get(res::Workloads(), o.ns, WorkloadName(o.name, meta.uid));
  } catch (const kube::KubeError& e) {
    if (e.kind() != kube::ErrorKind::kNotFound) throw;
    return json();  // none
  }
}

std::map<std::string, json> Reconciler::ReadFlavors(const json& workload) {
  std::map<std::string, json> flavors;
  if (!workload.is_object()) return flavors;
  for (const std::string& name : AdmittedFlavors(workload)) {
    try {
      flavors[name] = client_.Get(res::ResourceFlavors(), "", name);
    } catch (const kube::KubeError& e) {
      if (e.kind() != kube::ErrorKind::kNotFound) throw;  // one not found is absent: Decide says so
    }
  }
  return flavors;
}

json Reconciler::ReadPriorityClass(const Observed& o) {
  const std::string name = PriorityClassName(o.checked.job);
  if (name.empty()) return json();
  try {
    return client_.Get(res::WorkloadPriorityClasses(), "", name);
  } catch (const kube::KubeError& e) {
    if (e.kind() != kube::ErrorKind::kNotFound) throw;
    return json();  // none: Decide says so
  }
}

void Reconciler::Act(const Observed& o, const Decision& decision) {
  const std::string key = kube::ObjectKey(o.ns, o.name);
  if (decision.create_workload) {
    try {
      client_.Create(res::Workloads(), o.ns, *decision.create_workload);
      spdlog::info("{}: created Workload {}", key, (*decision.create_workload)["metadata"].value("name", ""));
    } catch (const kube::KubeError& e) {
      if (e.kind() != kube::ErrorKind::kConflict) throw;  // AlreadyExists: an earlier pass made it
    }
  }
  if (!decision.delete_workload.empty()) {
    try {
      client_.Delete(res::Workloads(), o.ns, decision.delete_workload);
      spdlog::info("{}: deleted Workload {}, which no longer matches the job", key, decision.delete_workload);
    } catch (const kube::KubeError& e) {
      if (e.kind() != kube::ErrorKind::kNotFound) throw;
    }
  }
  if (decision.workload_status) {
    try {
      client_.UpdateStatus(res::Workloads(), o.ns, *decision.workload_status);
    } catch (const kube::KubeError& e) {
      // The Workload changed since it was read: its event enqueues the job, decided again.
      if (e.kind() != kube::ErrorKind::kConflict) throw;
      spdlog::info("{}: the Workload changed while its status was written; deciding again", key);
    }
  }
  DeletePods(key, decision.delete_pods, decision.force_delete);
  if (decision.create) {
    const GangObjects& gang = *decision.create;
    auto create = [&](const kube::ResourceType& type, const json& object) {
      try {
        client_.Create(type, o.ns, object);
      } catch (const kube::KubeError& e) {
        if (e.kind() != kube::ErrorKind::kConflict) throw;  // AlreadyExists: an earlier pass made it
      }
    };
    size_t sent = 0;  // pods whose create went out and did not fail
    bool creating_pods = false;
    try {
      // The Secret before the pods that mount it. A job keeps its first Secret: when it
      // exists, AlreadyExists leaves it as it is.
      create(res::Secrets(), BuildJobSecret(o.checked.job, NewStoreKey(), options_.launcher_key));
      if (gang.network_policy) create(res::NetworkPolicies(), *gang.network_policy);
      create(res::Services(), gang.service);
      if (gang.replace_config_map) client_.Update(res::ConfigMaps(), o.ns, gang.config_map);
      else create(res::ConfigMaps(), gang.config_map);
      std::vector<std::string> pods;
      for (const auto& pod : gang.pods) pods.push_back(kube::KeyOf(pod));
      cluster_.Creating(key, pods, Clock::now());
      creating_pods = true;
      for (; sent < gang.pods.size(); ++sent) {
        json pod = gang.pods[sent];
        if (!options_.launcher_key.empty()) MountLauncherToken(&pod);
        create(res::Pods(), pod);
      }
    } catch (const std::exception& e) {
      // The pods not created end their records in flight, giving back what they claimed. A
      // create that got no answer may have made its pod: that one keeps its record until
      // the cache shows the pod, or the record times out.
      const auto* error = dynamic_cast<const kube::KubeError*>(&e);
      const size_t unanswered = creating_pods && error && error->kind() == kube::ErrorKind::kUnavailable ? 1 : 0;
      for (size_t i = sent + unanswered; i < gang.pods.size(); ++i) cluster_.Release(key, kube::KeyOf(gang.pods[i]));
      throw;
    }
  }
  if (progress_) {
    if (decision.progress_from) progress_->Watch(key, {*decision.progress_from});
    else progress_->Forget(key);
  }
  if (!launchers_) return;
  if (decision.launchers_from.empty()) return launchers_->Forget(key);
  launchers_->Watch(key, decision.launchers_from);
  if (options_.launcher_key.empty()) return;  // no pod has a token to instruct it with
  for (const LauncherCall& call : decision.launcher_calls) {
    const std::string token = LauncherToken(options_.launcher_key, o.checked.job.metadata.uid, NodeRankLabel(call.pod));
    launchers_->Post(key, call.pod, LauncherCallTarget(call, token));
  }
}

void Reconciler::ReleaseUncreated(const std::string& job_key, const Decision& decision) {
  // Act gave back what the pods it could not create reserved; a pod it created is counted
  // once the cache shows it.
  std::set<std::string> sent;
  if (decision.create) {
    for (const json& pod : decision.create->pods) sent.insert(kube::KeyOf(pod));
  }
  for (const PodClaim& claim : decision.claims) {
    if (!sent.count(claim.pod)) cluster_.Release(job_key, claim.pod);
  }
}

void Reconciler::DeletePods(const std::string& job_key, const std::vector<json>& pods,
                            const std::set<std::string>& at_once) {
  for (const auto& pod : pods) {
    const std::string uid = kube::Uid(pod);
    cluster_.Deleting(job_key, uid, Clock::now());
    try {
      client_.Delete(res::Pods(), pod["metadata"].value("namespace", ""), pod["metadata"].value("name", ""),
                     "Background", at_once.count(uid) ? std::optional<int64_t>(0) : std::nullopt);
    } catch (const kube::KubeError& e) {
      if (e.kind() != kube::ErrorKind::kNotFound) {
        cluster_.DeleteFailed(job_key, uid);
        throw;
      }
    }
  }
}

bool Reconciler::WriteStatus(const Observed& o, const Decision& decision) {
  if (decision.status == o.status) return true;
  json object = o.object;
  object["status"] = api::ToJson(decision.status);
  const std::string replaced = o.object["metadata"].value("resourceVersion", "");
  json written;
  try {
    written = client_.UpdateStatus(res::TrainingJobs(), o.ns, object);
  } catch (const kube::KubeError& e) {
    if (e.kind() != kube::ErrorKind::kConflict) throw;
    std::lock_guard lock(mu_);
    Written& stale = written_[kube::ObjectKey(o.ns, o.name)];
    stale.replaced.insert(replaced);
    stale.object = nullptr;
    return false;
  }
  std::lock_guard lock(mu_);
  Written& ours = written_[kube::ObjectKey(o.ns, o.name)];
  ours.replaced.insert(replaced);
  ours.object = std::move(written);
  return true;
}

void Reconciler::Emit(const Observed& o, const PendingEvent& e) {
  const auto& meta = o.checked.job.metadata;
  const std::string now = kube::Rfc3339(o.now);
  json event = {{"apiVersion", "v1"},
                {"kind", "Event"},
                {"metadata", {{"generateName", o.name + "."}, {"namespace", o.ns}}},
                {"involvedObject",
                 {{"apiVersion", std::string(api::kApiVersion)}, {"kind", std::string(api::kKind)}, {"name", o.name},
                  {"namespace", o.ns}, {"uid", meta.uid},
                  {"resourceVersion", o.object["metadata"].value("resourceVersion", "")}}},
                {"type", e.type},
                {"reason", e.reason},
                {"message", e.message},
                {"source", {{"component", options_.component}}},
                {"firstTimestamp", now},
                {"lastTimestamp", now},
                {"count", 1}};
  spdlog::info("{}/{}: {}: {}", o.ns, o.name, e.reason, e.message);
  try {
    client_.Create(res::Events(), o.ns, event);
  } catch (const std::exception& ex) {
    spdlog::warn("{}/{}: recording event {}: {}", o.ns, o.name, e.reason, ex.what());  // events are best effort
  }
}

void Reconciler::Forget(const std::string& job_key) {
  if (progress_) progress_->Forget(job_key);
  if (launchers_) launchers_->Forget(job_key);
  cluster_.Forget(job_key);
  std::lock_guard lock(mu_);
  avoid_.erase(job_key);
  written_.erase(job_key);
  failure_seen_.erase(job_key);
}

}  // namespace meshtrain::controller
