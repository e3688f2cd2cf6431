// The TrainingJob reconciler: one level-triggered Reconcile(namespace, name), in the
// shape of JobSet's controller:
//
//  1. observe: the job, its pods and nodes from the informers' caches, and rank 0's
//     latest progress and the launchers' states from the PodPollers (no network call);
//  2. decide: Decide() (decide.h), a pure function from that to the status, the objects
//     to create and delete, the launchers' next attempt, and the Events;
//  3. act: idempotent deletes, creates and launcher requests;
//  4. write the status once, through the status subresource, when it changed;
//  5. emit the Events, only once that write has succeeded.
//
// On 409 the key is re-queued, to be decided again from the re-read object: as every
// delete follows from a status already stored (decide.h), the retry replays no delete
// and no Event. While the cache still lacks our own last write, the job is read from the
// API server instead. Pods we deleted or created are remembered until the cache shows it
// (Kubernetes' "expectations"), so a lagging watch causes neither a second delete nor a
// false "pod deleted".
//
// Thread-safety: Reconcile may run concurrently for different keys (the work queue never
// runs one key twice at once).

#pragma once

#include <chrono>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>

#include <nlohmann/json.hpp>

#include "operator/controller/decide.h"
#include "operator/controller/metrics.h"
#include "operator/controller/pod_poller.h"
#include "operator/kube/client.h"
#include "operator/kube/informer.h"
#include "operator/scheduler/cluster.h"

namespace meshtrain::controller {

struct ReconcilerOptions {
  DecideOptions decide;
  // The operator's key, from which each pod's launcher token derives (launcher_client.h);
  // empty: pods get no token, and a failed rank restarts its gang by recreating the pods.
  std::string launcher_key;
  std::chrono::seconds avoid_failed_node{600};  // how long a failed node is avoided
  std::chrono::seconds creation_observation_timeout{30};  // how long created pods may be absent from the cache
  std::string component = "meshtrain-operator";  // Event source
};

struct ReconcileResult {
  std::chrono::milliseconds requeue_after{0};  // 0: only when something changes
};

class Reconciler {
 public:
  // `progress` (rank 0's metrics) may be null: status.progress is then never filled.
  // `launchers` (each pod's launcher state) may be null: a failed rank then restarts the
  // gang only once its pod fails, by recreating it.
  Reconciler(kube::Client& client, kube::Informer& jobs, kube::Informer& pods, kube::Informer& nodes,
             PodPoller* progress, PodPoller* launchers, OperatorMetrics* metrics, ReconcilerOptions options = {});

  // Throws kube::KubeError on API failures; the caller requeues with backoff.
  ReconcileResult Reconcile(const std::string& namespace_, const std::string& name);

 private:
  // Nullopt when the job is gone.
  std::optional<Observed> Observe(const std::string& namespace_, const std::string& name);
  void Act(const Observed& observed, const Decision& decision);
  // False when the write conflicted (409).
  bool WriteStatus(const Observed& observed, const Decision& decision);
  void Emit(const Observed& observed, const PendingEvent& event);
  // Deletes `pods`; those whose uid is in `at_once` with gracePeriodSeconds 0.
  void DeletePods(const std::string& job_key, const std::vector<nlohmann::json>& pods,
                  const std::set<std::string>& at_once);
  void Forget(const std::string& job_key);
  // The cluster as placement sees it: the node cache, less the GPUs our pods hold.
  scheduler::ClusterSnapshot Snapshot();

  kube::Client& client_;
  kube::Informer& jobs_;
  kube::Informer& pods_;
  kube::Informer& nodes_;
  PodPoller* progress_;
  PodPoller* launchers_;
  OperatorMetrics* metrics_;
  const ReconcilerOptions options_;

  std::mutex mu_;
  // job key -> node -> when it failed the job
  std::map<std::string, std::map<std::string, std::chrono::steady_clock::time_point>> avoid_;
  struct UnseenPods {
    std::set<std::string> names;
    std::chrono::steady_clock::time_point since;
  };
  std::map<std::string, UnseenPods> unseen_pods_;  // job key -> created pods the cache has not shown
  std::map<std::string, std::set<std::string>> deleting_;  // job key -> uids of pods we deleted, still cached
  // job key -> (attempt, when a launcher was first seen failed at it)
  std::map<std::string, std::pair<int64_t, std::chrono::system_clock::time_point>> failure_seen_;
  std::map<std::string, std::string> written_from_;  // job key -> resourceVersion our last status write replaced
  std::optional<scheduler::ClusterSnapshot> nodes_snapshot_;
  uint64_t nodes_snapshot_version_ = 0;
};

}  // namespace meshtrain::controller
