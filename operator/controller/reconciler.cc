#include "operator/controller/reconciler.h"

#include <openssl/rand.h>
#include <spdlog/spdlog.h>

#include <stdexcept>

#include "api/json_codec.h"
#include "api/manifest.h"
#include "operator/controller/builders.h"
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

Reconciler::Reconciler(kube::Client& client, kube::Informer& jobs, kube::Informer& pods, kube::Informer& nodes,
                       PodPoller* progress, PodPoller* launchers, OperatorMetrics* metrics, ReconcilerOptions options)
    : client_(client),
      jobs_(jobs),
      pods_(pods),
      nodes_(nodes),
      progress_(progress),
      launchers_(launchers),
      metrics_(metrics),
      options_(std::move(options)) {}

ReconcileResult Reconciler::Reconcile(const std::string& ns, const std::string& name) {
  const std::string key = kube::ObjectKey(ns, name);
  const std::optional<Observed> observed = Observe(ns, name);
  if (!observed) {
    Forget(key);
    return {};
  }
  const Decision decision = Decide(*observed, options_.decide);
  if (decision.delete_job) {
    client_.Delete(res::TrainingJobs(), ns, name);
    spdlog::info("{}: deleted {} s after it finished (ttlSecondsAfterFinished)", key,
                 *observed->checked.job.spec.run_policy.ttl_seconds_after_finished);
    return {};
  }
  Act(*observed, decision);
  if (!WriteStatus(*observed, decision)) {
    // Our view was stale: decide again from the re-read object rather than overwrite a
    // status computed from newer facts.
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
  bool stale_cache = false;
  {
    // The cache still holds the version our last status write replaced: acting on that old
    // status would undo the write, so read the job from the API server instead.
    std::lock_guard lock(mu_);
    auto it = written_from_.find(key);
    if (it != written_from_.end()) {
      stale_cache = it->second == o.object["metadata"].value("resourceVersion", "");
      written_from_.erase(it);
    }
  }
  if (stale_cache) {
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

  // The job's pods, less those being deleted (by us, or by anyone: deletionTimestamp).
  const std::vector<json> owned = pods_.Select([&](const json& pod) {
    const json& pod_meta = pod["metadata"];
    if (pod_meta.value("namespace", "") != ns) return false;
    auto labels = pod_meta.find("labels");
    if (labels == pod_meta.end() || labels->value(kJobNameLabel, "") != name) return false;
    for (const auto& ref : pod_meta.value("ownerReferences", json::array()))
      if (ref.value("uid", "") == meta.uid) return true;
    return false;
  });
  {
    std::lock_guard lock(mu_);
    std::set<std::string>& deleting = deleting_[key];
    std::set<std::string> still_cached;
    for (const auto& pod : owned) {
      if (deleting.count(kube::Uid(pod))) still_cached.insert(kube::Uid(pod));
      if (deleting.count(kube::Uid(pod)) || pod["metadata"].contains("deletionTimestamp")) ++o.terminating;
      else o.pods.push_back(pod);
    }
    deleting = std::move(still_cached);

    // Until the pod cache has shown each created pod once, a missing one is not yet seen,
    // not deleted. A pod deleted before the cache ever showed it would be awaited forever:
    // give up after a while.
    if (auto it = unseen_pods_.find(key); it != unseen_pods_.end()) {
      for (const auto& pod : owned) it->second.names.erase(pod["metadata"].value("name", ""));
      if (it->second.names.empty() || Clock::now() - it->second.since > options_.creation_observation_timeout)
        unseen_pods_.erase(it);
      else
        o.awaiting_created_pods = true;
    }
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
  o.node = [this](const std::string& node) {
    const auto object = nodes_.Get(node);
    if (!object) return NodeState::kGone;
    return kube::ConditionTrue(*object, "Ready") ? NodeState::kReady : NodeState::kNotReady;
  };
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
  o.cluster = [this] { return Snapshot(); };
  o.config_map = [this, ns, name]() -> std::optional<json> {
    try {
      return client_.Get(res::ConfigMaps(), ns, ConfigMapName(name));
    } catch (const kube::KubeError& e) {
      if (e.kind() != kube::ErrorKind::kNotFound) throw;
      return std::nullopt;
    }
  };
  return o;
}

void Reconciler::Act(const Observed& o, const Decision& decision) {
  const std::string key = kube::ObjectKey(o.ns, o.name);
  DeletePods(key, decision.delete_pods, decision.force_delete);
  if (decision.placement_seconds && metrics_) metrics_->Placed(*decision.placement_seconds);
  if (decision.create) {
    const GangObjects& gang = *decision.create;
    auto create = [&](const kube::ResourceType& type, const json& object) {
      try {
        client_.Create(type, o.ns, object);
      } catch (const kube::KubeError& e) {
        if (e.kind() != kube::ErrorKind::kConflict) throw;  // AlreadyExists: an earlier pass made it
      }
    };
    // The Secret before the pods that mount it. A job keeps its first Secret: when it
    // exists, AlreadyExists leaves it as it is.
    create(res::Secrets(), BuildJobSecret(o.checked.job, NewStoreKey(), options_.launcher_key));
    if (gang.network_policy) create(res::NetworkPolicies(), *gang.network_policy);
    create(res::Services(), gang.service);
    if (gang.replace_config_map) client_.Update(res::ConfigMaps(), o.ns, gang.config_map);
    else create(res::ConfigMaps(), gang.config_map);
    {
      std::lock_guard lock(mu_);
      auto& expected = unseen_pods_[key];
      expected.since = Clock::now();
      for (const auto& pod : gang.pods) expected.names.insert(pod["metadata"].value("name", ""));
    }
    for (json pod : gang.pods) {
      if (!options_.launcher_key.empty()) MountLauncherToken(&pod);
      create(res::Pods(), pod);
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

void Reconciler::DeletePods(const std::string& job_key, const std::vector<json>& pods,
                            const std::set<std::string>& at_once) {
  for (const auto& pod : pods) {
    {
      std::lock_guard lock(mu_);
      deleting_[job_key].insert(kube::Uid(pod));
    }
    try {
      client_.Delete(res::Pods(), pod["metadata"].value("namespace", ""), pod["metadata"].value("name", ""),
                     "Background", at_once.count(kube::Uid(pod)) ? std::optional<int64_t>(0) : std::nullopt);
    } catch (const kube::KubeError& e) {
      if (e.kind() != kube::ErrorKind::kNotFound) throw;
    }
  }
}

bool Reconciler::WriteStatus(const Observed& o, const Decision& decision) {
  if (decision.status == o.status) return true;
  json object = o.object;
  object["status"] = api::ToJson(decision.status);
  try {
    client_.UpdateStatus(res::TrainingJobs(), o.ns, object);
  } catch (const kube::KubeError& e) {
    if (e.kind() != kube::ErrorKind::kConflict) throw;
    return false;
  }
  std::lock_guard lock(mu_);
  written_from_[kube::ObjectKey(o.ns, o.name)] = o.object["metadata"].value("resourceVersion", "");
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
  std::lock_guard lock(mu_);
  avoid_.erase(job_key);
  written_from_.erase(job_key);
  unseen_pods_.erase(job_key);
  deleting_.erase(job_key);
  failure_seen_.erase(job_key);
}

scheduler::ClusterSnapshot Reconciler::Snapshot() {
  // The nodes change rarely: rebuild their part only when the node cache changed.
  scheduler::ClusterSnapshot snapshot;
  {
    std::lock_guard lock(mu_);
    if (!nodes_snapshot_ || nodes_snapshot_version_ != nodes_.version()) {
      nodes_snapshot_version_ = nodes_.version();
      nodes_snapshot_ = scheduler::SnapshotFromKubectl(json{{"items", nodes_.List()}}, json());
    }
    snapshot = *nodes_snapshot_;
  }
  // The GPUs held by this operator's pods, bound or only pinned, that are still running.
  std::map<std::string, std::pair<int64_t, int64_t>> used;  // node -> (gpus, efa)
  pods_.ForEach([&](const json& pod) {
    const std::string phase = kube::PodPhase(pod);
    if (phase == "Succeeded" || phase == "Failed") return;
    auto& [gpus, efa] = used[kube::PinnedNode(pod)];
    const std::string where = "pod " + kube::KeyOf(pod) + " spec";
    gpus += scheduler::PodRequest(pod["spec"], "nvidia.com/gpu", where);
    efa += scheduler::PodRequest(pod["spec"], "vpc.amazonaws.com/efa", where);
  });
  for (auto& node : snapshot.nodes) {
    if (auto it = used.find(node.name); it != used.end()) {
      node.gpus_used += it->second.first;
      node.efa_used += it->second.second;
    }
  }
  return snapshot;
}

}  // namespace meshtrain::controller
