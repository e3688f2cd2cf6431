// What one reconcile of a TrainingJob decides: a pure function from what was observed (the
// job, its pods, the states of their nodes, rank 0's latest progress, its launchers'
// states, the time, and for a pass that places or restarts a gang, the cluster and the
// job's ConfigMap) to the status to write, the objects to create and delete, and the
// Events to emit once that status is saved. It writes nothing, calls no API and reads no
// clock: `now` is the time. Tests give plain values, so Decide is unit-tested without a
// server.
//
// The cluster and the ConfigMap are read only for a pass that needs them (one that places a
// gang, or restarts one in place, or grows one): a decision made without one that it needs
// says so (Decision::needs) and holds nothing else; the caller reads what it lacked into
// the Observed and decides again.
//
// Every delete follows from the status as stored, never from a decision of the same
// pass: a restart, a failure or a suspension is first written to status (restarts + 1,
// Failed, Suspended), and the pass after that write deletes the old gang, the finished
// job's pods (spec.runPolicy.cleanPodPolicy) or the suspended job's pods. So do the
// requests to the launchers of a gang restarted in place: they carry the stored attempt. A
// status write that conflicts (409) therefore leaves nothing done that a retry would do
// again: the retry decides afresh from re-read objects. Creates are idempotent
// (AlreadyExists is success), and each pass creates only the pods the cache does not show.
//
// Thread-safety: Decide keeps no state, and may run on any thread. Observed::cluster's
// counters are live (ClusterState::View): a placement made from them is checked when its
// claims are reserved (Decision::check_claims).

#pragma once

#include <chrono>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "api/manifest.h"
#include "api/training_job.h"
#include "operator/controller/cluster_types.h"
#include "operator/controller/launcher_client.h"
#include "operator/controller/worker_defaults.h"
#include "operator/controller/worker_readings.h"
#include "operator/scheduler/cluster.h"
#include "operator/scheduler/topology.h"

namespace meshtrain::controller {

// The condition that lists the fields a valid spec sets but the engine does not act on yet.
inline constexpr const char* kSpecWarningsCondition = "SpecWarnings";
// The label that names a job's Kueue LocalQueue (docs/operator.md, "Kueue").
inline constexpr const char* kQueueNameLabel = "kueue.x-k8s.io/queue-name";
// True while the job carries kQueueNameLabel and the operator runs without Kueue.
inline constexpr const char* kQueueLabelIgnoredCondition = "QueueLabelIgnored";
// With Kueue: True while a queued job sets spec.elastic.minNodes below spec.nodes, which
// has no effect there (the Workload is admitted whole), with a Warning Event.
inline constexpr const char* kElasticUnderKueueCondition = "ElasticUnderKueue";
// With Kueue: True while the job waits for its Workload's admission (phase Queued).
inline constexpr const char* kQueuedCondition = "Queued";
// True while a suspended or evicted gang's ranks checkpoint before their pods go
// (decide_stop.cc); False once they have (Checkpointed) or the bound passed
// (CheckpointTimedOut), and the pods then go.
inline constexpr const char* kCheckpointingCondition = "Checkpointing";

struct DecideOptions {
  WorkerDefaults worker;  // what pods get unless the job says otherwise
  std::chrono::seconds pending_timeout{120};     // a pod Pending this long gets its gang re-planned
  std::chrono::seconds unschedulable_retry{10};  // retry period while nothing fits
  // The chart's kueue.enabled (--kueue). true: a job with kQueueNameLabel runs once Kueue
  // admits its Workload (kueue.h), where the admission lets it. false: the label is
  // ignored, with a Warning Event (QueueLabelIgnored), and the job is placed as any other.
  bool kueue = false;
  // How long a suspended or evicted gang's ranks may take to checkpoint and stop, from the
  // stored suspension, before its pods go anyway: above the launchers' own grace (100 s,
  // after which they kill the ranks and report them), below what a user would wait.
  std::chrono::seconds checkpoint_timeout{130};
};

struct Observed {
  std::string ns, name;
  nlohmann::json object;           // the TrainingJob as read
  api::CheckedJob checked;         // its validation, with generation and uid filled in
  api::TrainingJobStatus status;   // as stored
  std::vector<nlohmann::json> pods;  // owned by the job, every gang, less those being deleted
  int64_t terminating = 0;           // owned pods being deleted that the cache still shows
  // The state of each node that a pod of `pods` is bound or pinned to, and of each node
  // the rank table of `config_map` names (NodesOf): a node not here is gone.
  std::map<std::string, NodeState> nodes;
  std::set<std::string> avoided_nodes;  // nodes that failed this job recently
  // The pod cache has not shown every pod the operator created, or still shows one it
  // deleted: it is older than the operator's own writes, and the job is not judged from it.
  bool awaiting_created_pods = false;
  // The pods and nodes were read from the API server, not from the caches: a pod or node
  // missing here is gone.
  bool live = false;
  std::optional<api::ProgressStatus> progress;  // rank 0's latest, read off the reconcile path
  // Pod uid -> its launcher's latest state (the current gang's pods that answered).
  std::map<std::string, LauncherState> launchers;
  // When a launcher was first seen failed at the stored attempt (the reconciler's memory);
  // unset: none has been.
  std::optional<std::chrono::system_clock::time_point> failure_seen;
  std::chrono::system_clock::time_point now;
  // Read for a pass that needs them (Decision::needs); unset until then.
  std::optional<scheduler::ClusterView> cluster;  // the nodes and what is in use on them
  std::optional<nlohmann::json> config_map;       // the job's ConfigMap; null when it has none
  // With Kueue, for a job in a queue: its Workload (null when it has none), and the
  // ResourceFlavors its admission names, by name (one not found is absent).
  std::optional<nlohmann::json> workload;
  std::optional<std::map<std::string, nlohmann::json>> flavors;
  // For a pass that creates the Workload of a job carrying kPriorityClassLabel (kueue.h):
  // the WorkloadPriorityClass it names (null when there is none).
  std::optional<nlohmann::json> priority_class;
};

// The nodes Observed::nodes must hold: those `pods` are bound or pinned to, and those the
// rank table of `config_map` (when it is an object) names.
std::set<std::string> NodesOf(const std::vector<nlohmann::json>& pods, const std::optional<nlohmann::json>& config_map);

struct PendingEvent {
  std::string type, reason, message;  // type: Normal | Warning
  bool operator==(const PendingEvent&) const = default;
};

// The objects of a gang: each is created, and AlreadyExists counts as done.
struct GangObjects {
  nlohmann::json service;
  nlohmann::json config_map;
  std::optional<nlohmann::json> network_policy;  // when the operator's defaults enable one
  // The Store key Secret is not here: its key is drawn when it is created (Reconciler::Act),
  // before the pods that mount it.
  bool replace_config_map = false;  // an older gang's ConfigMap exists: update it instead
  std::vector<nlohmann::json> pods;  // only those the cache does not show
};

struct Decision {
  api::TrainingJobStatus status;  // written when it differs from the stored one
  std::vector<nlohmann::json> delete_pods;
  // The uids among delete_pods whose node is NotReady or gone: deleted at once
  // (gracePeriodSeconds 0), as no kubelet will confirm their end, and a pod left
  // terminating keeps its DNS name (publishNotReadyAddresses) and holds up a new gang.
  std::set<std::string> force_delete;
  std::optional<GangObjects> create;
  // What the pods to be created, or a replacement's pod chosen now, will hold: reserved
  // before anything is written. With check_claims (a placement made in this pass), only if
  // the nodes still have it free; otherwise the job is decided again.
  std::vector<PodClaim> claims;
  bool check_claims = false;
  // This decision took a pod or a node missing from the caches as gone (a deleted pod, a
  // lost node). Unless `live`, the reconciler reads them from the API server and decides
  // again before acting: a cache that lags is no reason to destroy a gang.
  bool rests_on_absence = false;
  bool delete_job = false;             // ttlSecondsAfterFinished passed
  std::vector<PendingEvent> events;    // emitted only after the status is saved
  std::chrono::milliseconds requeue_after{0};  // 0: only when something changes
  std::string avoid_node;              // a node that failed the job: avoid it for a while
  // When this pass restarted the gang: "in_place" (same pods, next attempt), "replaced"
  // (a lost node's pod moves to another node, the others stay, next attempt), "recreated"
  // (new pods), or "grown" (new pods, back at spec.nodes); or created it smaller than
  // the last gang: "shrunk" (spec.elastic, after a recreation).
  std::string restart_kind;
  // Requests to the gang's launchers, which follow the stored status.restarts: stop the
  // older attempt, then, once every launcher has, start this one.
  std::vector<LauncherCall> launcher_calls;
  std::vector<nlohmann::json> launchers_from;  // while the gang runs: read its launchers' states
  // Seconds from the failure that restarted the gang to the operator seeing it train a
  // step, when this pass saw that step.
  std::optional<double> recovery_seconds;
  bool placed = false;  // a placement search ran (the caller times it)
  std::optional<nlohmann::json> progress_from;  // rank 0's pod, while the gang runs: read its progress
  // With Kueue: the job's Workload to create (AlreadyExists is success), and the Workload
  // (as read, with its resourceVersion) whose status to write through workloads/status.
  std::optional<nlohmann::json> create_workload;
  std::optional<nlohmann::json> workload_status;
  // A Workload that no longer matches the job (its queue or its size changed): deleted
  // once the job has no pod, and a new one is created the pass after.
  std::string delete_workload;
  // What the pass lacked: with either set, the decision holds nothing else (its status is
  // the stored one); read it into the Observed and decide again.
  struct Needs {
    bool cluster = false;
    bool config_map = false;
    bool workload = false;  // Observed::workload
    bool flavors = false;   // Observed::flavors, those of Observed::workload's admission
    bool priority_class = false;  // Observed::priority_class, the one the job's label names
    bool any() const { return cluster || config_map || workload || flavors || priority_class; }
  } needs;

  void Requeue(std::chrono::milliseconds after) {
    if (requeue_after.count() == 0 || after < requeue_after) requeue_after = after;
  }
};

// The decision for `observed`; see the top of this file.
Decision Decide(const Observed& observed, const DecideOptions& options);

// The number of the pod set that runs the job: status.gang, or `restarts` while it is unset
// (before the job's first gang is placed).
int64_t GangOf(const api::TrainingJobStatus& status);

// The node-rank-0 pod of gang `gang` among `pods`, whose metrics carry the job's progress.
std::optional<nlohmann::json> Rank0Pod(const std::vector<nlohmann::json>& pods, int64_t gang);

}  // namespace meshtrain::controller
