// The TrainingJob reconciler: one level-triggered Reconcile(namespace, name), in the
// shape of JobSet's controller:
//
//  1. observe: the job, its pods and their nodes from the informers' caches, rank 0's
//     latest progress and the launchers' states from the PodPollers, and for a pass that
//     places or restarts a gang, the cluster (ClusterState::View) and the job's ConfigMap
//     (one GET); with Kueue, for a job in a queue, its Workload (one GET) and for a pass
//     that places it, the ResourceFlavors of its admission;
//  2. decide: Decide() (decide.h), a pure function from that to the status, the objects
//     to create and delete, the launchers' next attempt, and the Events; a decision that
//     lacks the cluster or the ConfigMap says so, and is made again once they are read;
//  3. act: idempotent deletes, creates and launcher requests (with Kueue, the Workload's
//     create and its status: a 409 there is left to the Workload's next event);
//  4. write the status once, through the status subresource, when it changed;
//  5. emit the Events, only once that write has succeeded.
//
// On 409 the key is re-queued, to be decided again from the re-read object: as every
// delete follows from a status already stored (decide.h), the retry replays no delete
// and no Event.
//
// Never on a stale view:
// - While the job cache still holds the version our last status write replaced, the job
//   is the object that write returned (after a 409: read from the API server).
// - Pods we create or delete are in flight (ClusterState) until the pod cache shows them:
//   meanwhile the job is not judged from the cache.
// - A decision that takes a pod or node missing from the caches as gone (a deleted pod, a
//   lost node) is made again from the API server's answer (a list of the job's pods, a get
//   of each node the caches lack) before anything is done: a deletion is believed when the
//   watch says so, or the API server.
//
// Cost: one reconcile reads the job's pods through the pod cache's index by job, nodes
// and free GPUs from the ClusterState (no copy of the cluster), and places a new gang
// with the topology's index: the job's pods plus the placement search. A gang's pods take
// their GPUs in the ClusterState before they are created (Reserve), so that concurrent
// reconciles never double-book a GPU.
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

#include "operator/controller/cluster_state.h"
#include "operator/controller/decide.h"
#include "operator/controller/metrics.h"
#include "operator/controller/pod_poller.h"
#include "operator/kube/client.h"
#include "operator/kube/informer.h"

namespace meshtrain::controller {

struct ReconcilerOptions {
  DecideOptions decide;
  // The operator's key, from which each pod's launcher token derives (launcher_client.h);
  // empty: pods get no token, and a failed rank restarts its gang by recreating the pods.
  std::string launcher_key;
  std::chrono::seconds avoid_failed_node{600};  // how long a failed node is avoided
  // How long the pod cache may take to show a pod created or deleted (ClusterState's pods
  // in flight) before the operator stops waiting for it and gives back what it claimed.
  std::chrono::seconds in_flight_timeout{60};
  std::string component = "meshtrain-operator";  // Event source
};

struct ReconcileResult {
  std::chrono::milliseconds requeue_after{0};  // 0: only when something changes
};

// The index of the pod informer by job: "namespace/job-name" of a pod's job label.
inline constexpr const char* kPodsByJob = "job";
// The index of the pod informer by node: the node a pod is bound or pinned to.
inline constexpr const char* kPodsByNode = "node";
// The index functions: the pod informer must have both (Controller adds them).
std::vector<std::string> PodJobKeys(const nlohmann::json& pod);
std::vector<std::string> PodNodes(const nlohmann::json& pod);

class Reconciler {
 public:
  // `pods` has the indexes kPodsByJob and kPodsByNode. `cluster` is fed by the pod and
  // node informers' events (Controller).
  // `progress` (rank 0's metrics) may be null: status.progress is then never filled.
  // `launchers` (each pod's launcher state) may be null: a failed rank then restarts the
  // gang only once its pod fails, by recreating it.
  Reconciler(kube::Client& client, kube::Informer& jobs, kube::Informer& pods, ClusterState& cluster,
             PodPoller* progress, PodPoller* launchers, OperatorMetrics* metrics, ReconcilerOptions options = {});

  // Throws kube::KubeError on API failures; the caller requeues with backoff.
  ReconcileResult Reconcile(const std::string& namespace_, const std::string& name);

 private:
  // Nullopt when the job is gone.
  std::optional<Observed> Observe(const std::string& namespace_, const std::string& name);
  // The job's pods and the nodes the caches lack, from the API server.
  void ObserveLive(Observed* observed);
  // The states of the nodes Decide may ask about (NodesOf) that `observed` lacks: from the
  // node cache, and when `live`, from the API server for those it does not have.
  void ObserveNodes(Observed* observed);
  // Decides `observed`, reading into it what a decision lacks (Decision::needs) and
  // deciding again; `*seconds` is how long the last Decide took.
  Decision DecideObserved(Observed* observed, double* seconds);
  // With Kueue: the job's Workload from the API server (null when it has none), the
  // ResourceFlavors its admission names, and the WorkloadPriorityClass the job's
  // kPriorityClassLabel names (null when there is none).
  nlohmann::json ReadWorkload(const Observed& observed);
  std::map<std::string, nlohmann::json> ReadFlavors(const nlohmann::json& workload);
  nlohmann::json ReadPriorityClass(const Observed& observed);
  void Act(const Observed& observed, const Decision& decision);
  // Gives back the claims of the decision that are not for pods it creates (a replacement's
  // node): the decision was not stored.
  void ReleaseUncreated(const std::string& job_key, const Decision& decision);
  // False when the write conflicted (409).
  bool WriteStatus(const Observed& observed, const Decision& decision);
  void Emit(const Observed& observed, const PendingEvent& event);
  // Deletes `pods`; those whose uid is in `at_once` with gracePeriodSeconds 0.
  void DeletePods(const std::string& job_key, const std::vector<nlohmann::json>& pods,
                  const std::set<std::string>& at_once);
  void Forget(const std::string& job_key);

  kube::Client& client_;
  kube::Informer& jobs_;
  kube::Informer& pods_;
  ClusterState& cluster_;
  PodPoller* progress_;
  PodPoller* launchers_;
  OperatorMetrics* metrics_;
  const ReconcilerOptions options_;

  std::mutex mu_;
  // job key -> node -> when it failed the job
  std::map<std::string, std::map<std::string, std::chrono::steady_clock::time_point>> avoid_;
  // job key -> (attempt, when a launcher was first seen failed at it)
  std::map<std::string, std::pair<int64_t, std::chrono::system_clock::time_point>> failure_seen_;
  // Our status writes that the job cache has not caught up with: while it shows a version
  // one of them replaced, the job is `object`.
  struct Written {
    std::set<std::string> replaced;  // resourceVersions our writes replaced
    nlohmann::json object;            // what the last write returned; null after a 409: read the job afresh
  };
  std::map<std::string, Written> written_;  // by job key
};

}  // namespace meshtrain::controller
