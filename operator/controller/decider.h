// The inside of Decide (decide.h), private to the files that implement it: one pass's
// Decider holds the observation and builds up the decision. Its methods are split by
// concern, one file each:
//
//   decide.cc           the narrative (Judge), read top to bottom, and what every outcome
//                       writes: conditions, a failure, a restart under a new gang;
//   decide_gang.cc      judging the current gang from its pods and their nodes, and
//                       reading a gang that runs (its phase, rank 0's progress);
//   decide_in_place.cc  restarts in place: the launchers' attempts, a lost node's pod
//                       moved to a replacement, the pods it lacks created held;
//   decide_elastic.cc   spec.elastic: a smaller gang when the whole does not fit, and
//                       growing back to spec.nodes;
//   decide_plan.cc      planning a new gang: its placement, its layout, its rank table and
//                       the objects that carry them;
//   decide_kueue.cc     with Kueue: the job's Workload, waiting for its admission, following
//                       it (or its TAS assignment) when placing, eviction, and Finished;
//   decide_stop.cc      a suspended or evicted gang: its ranks checkpoint (through their
//                       launchers) before its pods go.
//
// Thread-safety: a Decider is used by one thread, for one pass.

#pragma once

#include <chrono>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "api/rank_table.h"
#include "api/training_job.h"
#include "operator/controller/decide.h"
#include "operator/controller/kueue.h"
#include "operator/scheduler/placement.h"

namespace meshtrain::controller {

// The value of `label` on `object`; empty without it.
std::string LabelOf(const nlohmann::json& object, const char* label);
// The rank table in a ConfigMap of BuildConfigMap; errors go to `*errors`.
api::RankTable RankTableOf(const nlohmann::json& config_map, api::FieldErrors* errors);

class Decider {
 public:
  Decider(const Observed& observed, const DecideOptions& options);
  Decision Run();

 private:
  // The current gang as this pass finds it.
  struct Gang {
    int64_t number = 0;                // status.gang, or restarts before it is set
    std::vector<nlohmann::json> pods;  // its pods, each on the node its node rank is placed on
    bool stale_left = false;           // pods of older gangs are left, or still terminating
    bool restarting_in_place = false;  // Restarting with a placement: the same pods go on
    bool started = false;              // Starting, Running, or restarting in place
    int succeeded = 0, ready = 0;      // its pods Succeeded, and Running and Ready
  };

  // decide.cc: the narrative, and what every outcome writes.
  void Judge();
  void CleanUpFinished();
  // spec.runPolicy's suspend and activeDeadlineSeconds; true when they decided the pass.
  bool ApplyRunPolicy();
  void SetCondition(const std::string& type, bool value, const std::string& reason, const std::string& message);
  void Fail(const std::string& reason, const std::string& message);
  bool WithinBackoffLimit(const std::string& message);
  void Restart(const std::string& reason, const std::string& message, const std::string& bad_node, bool failure,
               const char* kind = "recreated");
  void RecordRestart(const std::string& reason, const char* kind, const std::string& message, PendingEvent event,
                     bool failure);
  void ReportStandingWarning(const char* type, const std::string& reason, const std::string& event,
                             const std::string& message, const std::string& cleared);
  // Whether the job's stored condition `type` is True with `reason` and `message`: a
  // warning that says it again needs no new Event.
  bool ConditionStands(const char* type, const std::string& reason, const std::string& message) const;
  void ReportFieldsWithoutEffect();
  void ReportQueueWarnings();
  // True, noting that the pass needs it (Decision::needs), when the observation lacks it.
  bool LacksCluster();
  bool LacksConfigMap();
  // The job's ConfigMap, when it has one. REQUIRES: !LacksConfigMap().
  std::optional<nlohmann::json> ExistingConfigMap() const;
  // The state of `node`; one the observation does not know is gone, and the decision then
  // rests on its absence.
  NodeState NodeOf(const std::string& node);
  // The state of `node`, with no such consequence.
  NodeState StateOf(const std::string& node) const;
  // What `pod` will hold on its node.
  static PodClaim ClaimOf(const nlohmann::json& pod);
  int64_t generation() const { return job_.metadata.generation; }
  int64_t nodes() const { return job_.spec.nodes; }
  // The placed gang's size: spec.nodes, or fewer while an elastic job is shrunk.
  int64_t gang_size() const { return d_.status.placement ? int64_t(d_.status.placement->nodes.size()) : nodes(); }

  // decide_gang.cc: the current gang.
  Gang FindGang();
  // A failed pod, a pod on a lost node, or one Pending too long restarts (or fails) the
  // gang; true when one did. Counts the pods that succeeded and are ready.
  bool JudgePods(Gang* gang);
  // Fewer pods than the gang: a gang restarting in place gets those it lacks, another one
  // is restarted; true when that decided the pass.
  bool JudgeMissingPods(const Gang& gang);
  // A gang that exists: its phase from its pods, and while it runs, its progress.
  void ReadGang(const Gang& gang);
  void TakeProgress();
  // The node rank of a pod of the gang; -1 when its label is not one of status.placement's.
  int64_t NodeRankOf(const nlohmann::json& pod) const;
  // A pod not on the node status.placement gives its node rank: it was replaced.
  bool MovedAway(const nlohmann::json& pod) const;

  // decide_in_place.cc: restarts in place.
  void RestartInPlace(const std::string& message);
  void BeginNextAttempt(const std::string& reason, const char* kind, bool new_failure, const std::string& message,
                        const std::string& event);
  bool ReplacePod(const std::vector<nlohmann::json>& current, const nlohmann::json& lost, const std::string& what);
  // The placement status.placement records. REQUIRES: it has one.
  scheduler::Placement StoredPlacement() const;
  bool CreateHeldPods(int64_t gang, const std::vector<nlohmann::json>& current);
  bool DriveLaunchers(const std::vector<nlohmann::json>& current, bool restarting_in_place);

  // decide_elastic.cc: spec.elastic.
  std::optional<api::TrainingJob> JobOfSize(int64_t size) const;
  bool PlaceSmaller(const scheduler::ClusterView& cluster, api::TrainingJob* sized, scheduler::Placement* placement,
                    scheduler::PlacementRequest* request, std::string* reason) const;
  void Grow(const std::vector<nlohmann::json>& current);

  // decide_kueue.cc: Kueue admission.
  // The job is in a Kueue queue: --kueue, and it carries kQueueNameLabel.
  bool InQueue() const;
  bool LacksWorkload();
  bool LacksFlavors();
  bool LacksPriorityClass();
  // The priority of the Workload to create: none without kPriorityClassLabel, else that of
  // the WorkloadPriorityClass it names. False when that decided the pass: the pass lacks
  // the class (Decision::needs), or it does not exist or has no value (the job is Queued
  // saying so, and its Workload waits for the class).
  bool WorkloadPriorityOf(std::optional<WorkloadPriority>* priority);
  // A job in a queue without an admission to run under: its Workload is created, the job
  // is Queued, and once that is stored its pods go; after an eviction, the admission is
  // cleared once they have. True when that decided the pass; false when the job runs
  // (admitted_ is then its Workload).
  bool AwaitAdmission();
  void Queue(const std::string& reason, const std::string& message);
  // Reads the admission of admitted_ into admission_, and the job's pods' node selector and
  // tolerations from it; false, with the job Pending and why, when it cannot be followed
  // (or the pass lacks the flavors).
  bool FollowAdmission();
  // Pending, with Scheduled=False AdmissionNotFollowed saying `message` (an Event when it
  // changes), retried later; returns false.
  bool AdmissionNotFollowed(const std::string& message);
  // TAS: the placement the admission gives (the node of each pod index); false, with why,
  // when a node is not usable.
  bool AssignedPlacement(const scheduler::ClusterView& cluster, const std::vector<std::string>& levels,
                         scheduler::Placement* placement);
  // Whether a rank table left by an interrupted creation runs where the admission allows.
  bool AdmissionAllows(const api::RankTable& table, const scheduler::ClusterView& cluster) const;
  // What Kueue expects on the pods of an admitted Workload.
  void MarkForKueue(nlohmann::json* pod) const;
  // Finished=True on the Workload of a job that ended.
  void FinishWorkload();
  // PodsReady=True on the Workload of a gang whose `ready` pods all run (waitForPodsReady).
  void ReportPodsReady(int64_t ready);

  // decide_stop.cc: before a suspended or evicted gang's pods go.
  // At the pass that records the stop (`why`: Suspended, Evicted): when the job has a
  // checkpoint path, its gang runs with launchers to ask, and it trained since its last
  // checkpoint, sets Checkpointing=True (that pass's write starts the bound) and returns
  // true.
  bool BeginCheckpointBeforeStop(const std::string& why);
  // At a pass after the stop is stored: while the stored Checkpointing is True, asks the
  // current gang's launchers to suspend and waits for their report, or the bound; then
  // records how it went (Checkpointing=False, an Event naming any rank that did not
  // checkpoint). True when that decided the pass (the pods stay); false when they may go.
  bool CheckpointBeforeStop();
  // The current gang's pods whose containers run.
  std::vector<nlohmann::json> RunningGangPods() const;

  // decide_plan.cc: a new gang.
  void CreateGang(int64_t gang, const std::vector<nlohmann::json>& current);
  std::optional<api::RankTable> ReusableTable(const std::optional<nlohmann::json>& existing, int64_t gang) const;
  std::optional<api::LayoutStatus> PlanLayout(const api::TrainingJobSpec& spec, const scheduler::Placement& placement,
                                              const scheduler::ClusterView& cluster,
                                              const std::vector<std::string>& levels, nlohmann::json* written_spec);
  void ReportLayout(const api::LayoutStatus& layout, const api::TrainingJobSpec& spec);

  // A status write lets the next pass act on it (the job's own update enqueues it too).
  static constexpr std::chrono::milliseconds kAfterOwnWrite{100};
  // How often a job whose WorkloadPriorityClass is missing looks for it again.
  static constexpr std::chrono::seconds kAwaitPriorityClass{10};
  // While the pod cache lags our own writes: in case no event comes (records in flight end).
  static constexpr std::chrono::seconds kAwaitCache{5};
  // Well inside a launcher's hold (MESHTRAIN_LAUNCHER_HOLD_SECONDS, 60 by default).
  static constexpr std::chrono::seconds kRenewHold{10};

  const Observed& o_;
  const DecideOptions& options_;
  api::TrainingJob job_;  // the job with the operator's worker defaults applied
  std::vector<api::DerivedDefault> defaults_;
  Decision d_;
  const nlohmann::json* admitted_ = nullptr;  // with Kueue: the Workload admitted to run
  std::optional<KueueAdmission> admission_;   // its admission, once FollowAdmission read it
};

}  // namespace meshtrain::controller
