// The TrainingJob reconciler: one level-triggered Reconcile(namespace, name) that
// reads top to bottom and is safe to run again at any point.
//
//  1. Read the job from the informer's cache; a job that is gone needs nothing
//     (owner references let Kubernetes delete what it owned).
//  2. Finished jobs: apply cleanPodPolicy and ttlSecondsAfterFinished, nothing else.
//  3. Validate with api/; an invalid spec fails the job (InvalidSpec, field paths). A valid
//     one gets the values derived for fields it left out in status.defaults, and fields it
//     sets that have no effect yet in the SpecWarnings condition and a Warning Event.
//  4. runPolicy: suspend deletes the pods and keeps status; activeDeadlineSeconds fails
//     the job (DeadlineExceeded).
//  5. Judge the running gang: a failed pod, a deleted pod or a NotReady node restarts the
//     whole gang (a permanent exit code, or passing backoffLimit, fails the job); a pod
//     stuck Pending past the timeout re-plans the gang without counting against
//     backoffLimit. status.restarts counts gangs replaced either way. Nodes that failed
//     the job are avoided for a while.
//  6. No pods: plan a gang placement from the informers' snapshot (Pending with the
//     reason when nothing fits, retried), then ensure the Service, the ConfigMap and one
//     Pod per node, each owned by the job.
//     Pods just created but not yet in the pod cache are waited for, not taken as deleted.
//  7. Pods exist: create any missing ones of an interrupted creation, count ready
//     workers, read progress from rank 0's metrics endpoint.
//  8. Write status through the status subresource when it changed and emit an Event for
//     each phase transition. On 409 the key is re-queued, to be reconciled again from the
//     re-read object; while the cache still lacks our own last write, the job is read
//     from the API server instead.
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

#include "api/field_error.h"
#include "api/training_job.h"
#include "operator/controller/metrics.h"
#include "operator/kube/client.h"
#include "operator/kube/informer.h"
#include "operator/scheduler/cluster.h"

namespace meshtrain::controller {

// The condition that lists the fields a valid spec sets but the engine does not act on yet.
inline constexpr const char* kSpecWarningsCondition = "SpecWarnings";

struct ReconcilerOptions {
  std::chrono::seconds pending_timeout{120};     // a pod Pending this long gets its gang re-planned
  std::chrono::seconds avoid_failed_node{600};   // how long a failed node is avoided
  std::chrono::seconds unschedulable_retry{10};  // retry period while nothing fits
  std::chrono::seconds progress_interval{5};     // how often rank 0's metrics are read
  std::chrono::seconds creation_observation_timeout{30};  // how long created pods may be absent from the cache
  std::string component = "meshtrain-operator";  // Event source
};

struct ReconcileResult {
  std::chrono::milliseconds requeue_after{0};  // 0: only when something changes
};

class Reconciler {
 public:
  Reconciler(kube::Client& client, kube::Informer& jobs, kube::Informer& pods, kube::Informer& nodes,
             OperatorMetrics* metrics, ReconcilerOptions options = {});

  // Throws kube::KubeError on API failures; the caller requeues with backoff.
  ReconcileResult Reconcile(const std::string& namespace_, const std::string& name);

 private:
  struct Context;
  void WriteStatus(Context& ctx);
  void Event(const Context& ctx, const std::string& type, const std::string& reason, const std::string& message);
  void DeletePods(const std::vector<nlohmann::json>& pods);
  // Deletes the gang and starts the next one. A `failure` counts against backoffLimit;
  // a re-plan of a gang stuck Pending does not.
  void Restart(Context& ctx, const std::string& reason, const std::string& message, const std::string& bad_node,
               bool failure);
  void Fail(Context& ctx, const std::string& reason, const std::string& message);
  // Sets the SpecWarnings condition (False once no warning is left) and queues a Warning
  // Event when the warnings changed.
  void ReportFieldsWithoutEffect(Context& ctx, const api::FieldErrors& warnings);
  bool CreateGang(Context& ctx);
  void ObserveProgress(Context& ctx, const nlohmann::json& rank0);
  std::set<std::string> AvoidedNodes(const std::string& job_key);
  // True while pods this reconciler created for the job have not yet appeared in the pod
  // cache (the watch lags the create): missing pods then mean "not seen yet", not "deleted".
  bool AwaitingCreatedPods(const std::string& job_key, const std::vector<nlohmann::json>& current);
  // The cluster as placement sees it: the node cache, less the GPUs our pods hold.
  scheduler::ClusterSnapshot Snapshot();

  kube::Client& client_;
  kube::Informer& jobs_;
  kube::Informer& pods_;
  kube::Informer& nodes_;
  OperatorMetrics* metrics_;
  const ReconcilerOptions options_;

  std::mutex mu_;
  // job key -> node -> when it failed the job
  std::map<std::string, std::map<std::string, std::chrono::steady_clock::time_point>> avoid_;
  std::map<std::string, std::chrono::steady_clock::time_point> last_scrape_;
  struct UnseenPods {
    std::set<std::string> names;
    std::chrono::steady_clock::time_point since;
  };
  std::map<std::string, UnseenPods> unseen_pods_;  // job key -> created pods the cache has not shown
  std::map<std::string, std::string> written_from_;  // job key -> resourceVersion our last status write replaced
  std::optional<scheduler::ClusterSnapshot> nodes_snapshot_;
  uint64_t nodes_snapshot_version_ = 0;
};

// Reads step, loss and tokens/s from a worker's Prometheus text exposition.
// Returns false when none of them is present.
bool ParseProgress(const std::string& metrics_text, api::ProgressStatus* progress);

}  // namespace meshtrain::controller
