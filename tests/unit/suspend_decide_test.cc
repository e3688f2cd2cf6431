// Decide() for a suspension that loses no step (decide_stop.cc): the stored suspension
// asks the gang's launchers to have their ranks checkpoint and stop, the pods go once every
// launcher reported or the bound passed, and a rank that did not checkpoint is named in a
// Warning Event. Each step follows from a stored status, as every delete does.

#include <gtest/gtest.h>

#include "api/manifest.h"
#include "api/worker_contract.h"
#include "operator/controller/decide.h"
#include "operator/controller/worker_readings.h"
#include "operator/kube/time.h"
#include "operator/scheduler/synthetic_cluster.h"
#include "tests/unit/tiny_job.h"

namespace meshtrain::controller {
namespace {

using nlohmann::json;

const auto kNow = std::chrono::system_clock::from_time_t(2'000'000'000);

json JobObject(bool checkpoint = true) {
  json job = test::TinyJob("tiny");
  job["metadata"] = {{"name", "tiny"}, {"namespace", "default"}, {"uid", "job-uid"}, {"generation", 1}};
  if (checkpoint) job["spec"]["checkpoint"] = {{"path", "/ckpt/tiny"}, {"interval", 10}};
  return job;
}

Observed Observe(const json& object, const api::TrainingJobStatus& status, std::vector<json> pods = {}) {
  Observed o;
  o.ns = "default";
  o.name = "tiny";
  o.object = object;
  o.checked = api::CheckTrainingJob(object, "test", 0);
  o.checked.job.metadata.generation = 1;
  o.checked.job.metadata.uid = "job-uid";
  o.checked.job.metadata.namespace_ = "default";
  o.status = status;
  o.pods = std::move(pods);
  o.now = kNow;
  scheduler::SyntheticClusterOptions options;
  options.nodes = 64;
  options.gpu_used_fraction = 0;
  o.cluster = scheduler::ClusterView::Of(scheduler::MakeSyntheticCluster(options));
  for (const auto& node : o.cluster->topology->nodes()) o.nodes.emplace(node.name, NodeState::kReady);
  o.config_map = json();
  return o;
}

std::string PinnedNode(const json& pod) {
  return pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
            [0]["matchExpressions"][0]["values"][0];
}

json Running(json pod) {
  pod["metadata"]["uid"] = "uid-" + pod["metadata"]["name"].get<std::string>();
  pod["spec"]["nodeName"] = PinnedNode(pod);
  pod["status"] = {{"phase", "Running"}, {"conditions", json::array({{{"type", "Ready"}, {"status", "True"}}})}};
  return pod;
}

// Rank 0's progress: at `step`, with a checkpoint of `checkpoint`.
api::ProgressStatus Progress(int64_t step, int64_t checkpoint) {
  api::ProgressStatus progress;
  progress.step = step;
  progress.checkpoint_step = checkpoint;
  return progress;
}

const api::Condition* ConditionOf(const api::TrainingJobStatus& status, const std::string& type) {
  for (const auto& c : status.conditions)
    if (c.type == type) return &c;
  return nullptr;
}

std::vector<std::string> Reasons(const Decision& d) {
  std::vector<std::string> out;
  for (const auto& e : d.events) out.push_back(e.reason);
  return out;
}

const std::string kStoppedLine = "stopped after step 13 (asked by rank 0); checkpoint of step 13 written under /ckpt/tiny";

// A running gang of two pods (ranks 0..7 and 8..15) whose launchers run attempt 0, at
// step 12 with a checkpoint of step 10; then told to suspend.
struct SuspendedJob {
  json object = JobObject();
  api::TrainingJobStatus status;
  std::vector<json> pods;
  explicit SuspendedJob(json job = JobObject()) : object(std::move(job)) {
    const Decision created = Decide(Observe(object, {}), {});
    EXPECT_TRUE(created.create);
    for (const auto& pod : created.create->pods) pods.push_back(Running(pod));
    status = Decide(Observe(object, created.status, pods), {}).status;
    EXPECT_EQ(status.phase, "Running");
    object["spec"]["runPolicy"]["suspend"] = true;
  }
  // The job observed with each pod's launcher in `states` (by pod index; "" none read).
  Observed At(const api::TrainingJobStatus& stored, const std::vector<LauncherState>& states) const {
    Observed o = Observe(object, stored, pods);
    for (size_t i = 0; i < pods.size() && i < states.size(); ++i)
      if (!states[i].state.empty()) o.launchers[pods[i]["metadata"]["uid"]] = states[i];
    o.progress = Progress(12, 10);
    return o;
  }
};

LauncherState RunningLauncher() { return {0, "running", {}, {}, "", {}}; }
LauncherState Stopping() { return {0, "stopping", {}, {}, "", {}}; }
LauncherState Suspended(int64_t first_rank, int64_t late_rank = -1) {
  LauncherState s{0, "suspended", {}, {}, "", {}};
  for (int64_t r = first_rank; r < first_rank + 8; ++r) {
    if (r == late_rank) s.ranks.push_back({r, 137, ""});
    else s.ranks.push_back({r, api::worker::kExitStopped, kStoppedLine});
  }
  return s;
}

TEST(SuspendDecide, TheRanksCheckpointThroughTheirLaunchersThenThePodsGo) {
  SuspendedJob job;
  const std::vector<LauncherState> running = {RunningLauncher(), RunningLauncher()};
  // 1. The suspension is stored, with Checkpointing=True; nothing is deleted or asked yet.
  const Decision suspend = Decide(job.At(job.status, running), {});
  EXPECT_EQ(suspend.status.phase, "Suspended");
  const api::Condition* checkpointing = ConditionOf(suspend.status, kCheckpointingCondition);
  ASSERT_TRUE(checkpointing);
  EXPECT_EQ(checkpointing->status, "True");
  EXPECT_EQ(checkpointing->reason, "Suspended");
  EXPECT_NE(checkpointing->message.find("step 12, checkpoint of step 10"), std::string::npos) << checkpointing->message;
  EXPECT_TRUE(suspend.delete_pods.empty());
  EXPECT_TRUE(suspend.launcher_calls.empty());

  // 2. Stored: each launcher is asked to suspend, at the stored attempt, and read.
  const Decision ask = Decide(job.At(suspend.status, running), {});
  EXPECT_TRUE(ask.delete_pods.empty());
  ASSERT_EQ(ask.launcher_calls.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(ask.launcher_calls[i].action, "suspend");
    EXPECT_EQ(ask.launcher_calls[i].attempt, 0);
    EXPECT_EQ(ask.launcher_calls[i].pod, job.pods[i]);
  }
  EXPECT_EQ(ask.launchers_from, job.pods);
  EXPECT_EQ(ask.status, suspend.status);
  EXPECT_TRUE(ask.events.empty());
  EXPECT_GT(ask.requeue_after.count(), 0);

  // 3. One launcher has reported, the other's ranks are stopping: no call is repeated.
  const Decision waiting = Decide(job.At(suspend.status, {Suspended(0), Stopping()}), {});
  EXPECT_TRUE(waiting.delete_pods.empty());
  EXPECT_TRUE(waiting.launcher_calls.empty());
  EXPECT_EQ(waiting.status, suspend.status);

  // 4. Both reported, every rank stopped after its checkpoint: the outcome is stored, with
  //    a Normal Event quoting the ranks; the pods are still there.
  const Decision done = Decide(job.At(suspend.status, {Suspended(0), Suspended(8)}), {});
  EXPECT_TRUE(done.delete_pods.empty());
  checkpointing = ConditionOf(done.status, kCheckpointingCondition);
  ASSERT_TRUE(checkpointing);
  EXPECT_EQ(checkpointing->status, "False");
  EXPECT_EQ(checkpointing->reason, "Checkpointed");
  ASSERT_EQ(Reasons(done), std::vector<std::string>{"Checkpointed"});
  EXPECT_EQ(done.events[0].type, "Normal");
  EXPECT_EQ(done.events[0].message, "the ranks " + kStoppedLine + "; deleting the pods");

  // 5. Stored: the pods go, and nothing more is said.
  const Decision cleanup = Decide(job.At(done.status, {Suspended(0), Suspended(8)}), {});
  EXPECT_EQ(cleanup.delete_pods.size(), 2u);
  EXPECT_TRUE(cleanup.events.empty());
  EXPECT_TRUE(cleanup.launcher_calls.empty());
  EXPECT_EQ(cleanup.status, done.status);

  // Unsuspended once they are gone: a new gang is planned, which resumes from the checkpoint.
  job.object["spec"]["runPolicy"]["suspend"] = false;
  Observed gone = Observe(job.object, cleanup.status);
  const Decision resumed = Decide(gone, {});
  EXPECT_EQ(resumed.status.phase, "Starting");
  ASSERT_TRUE(resumed.create);
  EXPECT_EQ(resumed.create->pods.size(), 2u);
}

TEST(SuspendDecide, ARankThatDoesNotCheckpointIsNamedAndThePodsGoAnyway) {
  SuspendedJob job;
  const api::TrainingJobStatus suspended =
      Decide(job.At(job.status, {RunningLauncher(), RunningLauncher()}), {}).status;
  ASSERT_EQ(ConditionOf(suspended, kCheckpointingCondition)->status, "True");

  // The launcher killed rank 11 past its grace, and says so.
  const Decision late = Decide(job.At(suspended, {Suspended(0), Suspended(8, 11)}), {});
  ASSERT_EQ(Reasons(late), std::vector<std::string>{"CheckpointTimedOut"});
  EXPECT_EQ(late.events[0].type, "Warning");
  EXPECT_EQ(late.events[0].message,
            "rank 11 (pod tiny-g0-1, exit code 137, killed past the launcher's grace): did not checkpoint and stop "
            "within the bound; deleting the pods anyway");
  EXPECT_EQ(ConditionOf(late.status, kCheckpointingCondition)->reason, "CheckpointTimedOut");
  EXPECT_TRUE(late.delete_pods.empty());
  EXPECT_EQ(Decide(job.At(late.status, {}), {}).delete_pods.size(), 2u);

  // A launcher that never reports: within the bound the job waits; past it, the pod's ranks
  // are named and the pods go.
  Observed silent = job.At(suspended, {Suspended(0), Stopping()});
  silent.now = kNow + std::chrono::seconds(129);
  EXPECT_TRUE(Decide(silent, {}).events.empty());
  silent.now = kNow + std::chrono::seconds(130);
  const Decision timed_out = Decide(silent, {});
  ASSERT_EQ(Reasons(timed_out), std::vector<std::string>{"CheckpointTimedOut"});
  const std::string node = PinnedNode(job.pods[1]);
  EXPECT_EQ(timed_out.events[0].message, "the ranks of pod tiny-g0-1 on node " + node +
                                             " (its launcher did not report within 130 s): did not checkpoint and "
                                             "stop within the bound; deleting the pods anyway");
  EXPECT_TRUE(timed_out.launcher_calls.empty());
  EXPECT_TRUE(timed_out.delete_pods.empty());
  Observed after = job.At(timed_out.status, {Suspended(0), Stopping()});
  after.now = silent.now;
  EXPECT_EQ(Decide(after, {}).delete_pods.size(), 2u);

  // The bound is the operator's option.
  DecideOptions quick;
  quick.checkpoint_timeout = std::chrono::seconds(5);
  silent.now = kNow + std::chrono::seconds(5);
  EXPECT_EQ(Reasons(Decide(silent, quick)), std::vector<std::string>{"CheckpointTimedOut"});
}

TEST(SuspendDecide, WithNothingToSaveThePodsGoAtOnce) {
  const std::vector<LauncherState> running = {RunningLauncher(), RunningLauncher()};
  // No checkpoint path.
  SuspendedJob plain(JobObject(false));
  const Decision no_path = Decide(plain.At(plain.status, running), {});
  EXPECT_EQ(no_path.status.phase, "Suspended");
  EXPECT_FALSE(ConditionOf(no_path.status, kCheckpointingCondition));
  EXPECT_EQ(Decide(plain.At(no_path.status, running), {}).delete_pods.size(), 2u);

  // No step since the newest checkpoint.
  SuspendedJob job;
  Observed saved = job.At(job.status, running);
  saved.progress = Progress(10, 10);
  const Decision nothing_new = Decide(saved, {});
  EXPECT_FALSE(ConditionOf(nothing_new.status, kCheckpointingCondition));
  saved.status = nothing_new.status;
  EXPECT_EQ(Decide(saved, {}).delete_pods.size(), 2u);

  // No launcher to ask (none read, as without the operator's launcher key).
  const Decision unread = Decide(job.At(job.status, {}), {});
  EXPECT_FALSE(ConditionOf(unread.status, kCheckpointingCondition));
  EXPECT_EQ(Decide(job.At(unread.status, {}), {}).delete_pods.size(), 2u);
}

TEST(SuspendDecide, UnsuspendedWhileCheckpointingTheOldGangGoesFirst) {
  SuspendedJob job;
  const api::TrainingJobStatus suspended =
      Decide(job.At(job.status, {RunningLauncher(), RunningLauncher()}), {}).status;
  job.object["spec"]["runPolicy"]["suspend"] = false;
  const Decision d = Decide(job.At(suspended, {Stopping(), Stopping()}), {});
  EXPECT_EQ(d.status.phase, "Suspended") << "no new gang while the old one is there";
  EXPECT_EQ(d.delete_pods.size(), 2u);
  EXPECT_FALSE(d.create);
  EXPECT_EQ(ConditionOf(d.status, kCheckpointingCondition)->status, "False");
  EXPECT_EQ(ConditionOf(d.status, kCheckpointingCondition)->reason, "Resumed");
  // Once they are gone, a new gang.
  const Decision again = Decide(Observe(job.object, d.status), {});
  EXPECT_EQ(again.status.phase, "Starting");
  EXPECT_TRUE(again.create);
}

TEST(SuspendDecide, ASuspendedLaunchersAnswerIsReadRankByRank) {
  const json answer = {{"attempt", 1},
                       {"state", "suspended"},
                       {"ranks",
                        {{{"rank", 2}, {"exitCode", 79}, {"reason", "stopped after step 7\n(asked by rank 2)"}},
                         {{"rank", 3}, {"exitCode", 137}}}}};
  const std::optional<LauncherState> s = ParseLauncherState(answer);
  ASSERT_TRUE(s);
  EXPECT_EQ(s->state, "suspended");
  EXPECT_EQ(s->ranks, (std::vector<RankEnd>{{2, 79, "stopped after step 7 (asked by rank 2)"}, {3, 137, ""}}));
  json malformed = answer;
  malformed["ranks"][1]["exitCode"] = "killed";
  EXPECT_FALSE(ParseLauncherState(malformed)) << "a rank without its exit code is not a launcher's answer";
}

}  // namespace
}  // namespace meshtrain::controller
