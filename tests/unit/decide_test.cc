// Decide(), the reconciler's pure core, without a server: each case observes a job at
// some moment of its life and checks the status, the actions and the Events decided. The
// theme: every delete follows from a status already stored, and Events belong to the
// status they report, so a status write that conflicts and is retried repeats neither.

#include <algorithm>

#include <gtest/gtest.h>

#include "api/json_codec.h"
#include "api/layout.h"
#include "api/manifest.h"
#include "api/worker_contract.h"
#include "operator/controller/builders.h"
#include "operator/controller/decide.h"
#include "operator/kube/time.h"
#include "operator/scheduler/synthetic_cluster.h"
#include "tests/unit/tiny_job.h"

namespace meshtrain::controller {
namespace {

using nlohmann::json;

json JobObject(const json& run_policy = json::object()) {
  json job = test::TinyJob("tiny");
  job["metadata"] = {{"name", "tiny"}, {"namespace", "default"}, {"uid", "job-uid"}, {"generation", 1}};
  job["spec"]["runPolicy"] = run_policy;
  return job;
}

const auto kNow = std::chrono::system_clock::from_time_t(2'000'000'000);

// Gives `o` the cluster `view`, each of its nodes Ready.
void SetCluster(Observed* o, scheduler::ClusterView view) {
  for (const scheduler::ClusterNode& node : view.topology->nodes()) o->nodes.emplace(node.name, NodeState::kReady);
  o->cluster = std::move(view);
}

// The job as the reconciler observes it, every node Ready, in a cluster of 64 free nodes,
// without a ConfigMap.
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
  SetCluster(&o, scheduler::ClusterView::Of(scheduler::MakeSyntheticCluster(options)));
  for (const std::string& node : NodesOf(o.pods, std::nullopt)) o.nodes[node] = NodeState::kReady;
  o.config_map = json();  // none
  return o;
}

// Node `node` of `o` is not Ready.
void Lose(Observed* o, const std::string& node) { o->nodes[node] = NodeState::kNotReady; }

std::string PinnedNode(const json& pod) {
  return pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
            [0]["matchExpressions"][0]["values"][0];
}

// A created pod as the cache shows it once the kubelet reports `phase`.
json Running(json pod, const std::string& phase = "Running", std::optional<int> exit_code = std::nullopt) {
  pod["metadata"]["uid"] = "uid-" + pod["metadata"]["name"].get<std::string>();
  pod["metadata"]["creationTimestamp"] = kube::Rfc3339(kNow);
  pod["spec"]["nodeName"] = PinnedNode(pod);
  pod["status"] = {{"phase", phase},
                   {"conditions", json::array({{{"type", "Ready"}, {"status", phase == "Running" ? "True" : "False"}}})}};
  if (exit_code)
    pod["status"]["containerStatuses"] = json::array({{{"state", {{"terminated", {{"exitCode", *exit_code}}}}}}});
  return pod;
}

std::vector<std::string> Reasons(const Decision& d) {
  std::vector<std::string> out;
  for (const auto& e : d.events) out.push_back(e.reason);
  return out;
}

// A job whose gang 0 was created and whose two workers run.
struct RunningJob {
  json object = JobObject();
  api::TrainingJobStatus status;
  std::vector<json> pods;
  RunningJob() {
    const Decision created = Decide(Observe(object, {}), {});
    EXPECT_TRUE(created.create);
    for (const auto& pod : created.create->pods) pods.push_back(Running(pod));
    status = Decide(Observe(object, created.status, pods), {}).status;
    EXPECT_EQ(status.phase, "Running");
  }
};

TEST(Decide, ANewJobGetsItsGangPlacedAndOneEventPerFact) {
  const Decision d = Decide(Observe(JobObject(), {}), {});
  ASSERT_TRUE(d.create);
  ASSERT_EQ(d.create->pods.size(), 2u);
  EXPECT_EQ(d.create->pods[0]["metadata"]["name"], "tiny-g0-0");
  EXPECT_FALSE(d.create->replace_config_map);
  EXPECT_EQ(d.status.phase, "Starting");
  ASSERT_TRUE(d.status.placement);
  EXPECT_EQ(d.status.placement->nodes.size(), 2u);
  EXPECT_EQ(d.status.start_time, kube::Rfc3339(kNow));
  EXPECT_EQ(Reasons(d), (std::vector<std::string>{"GangCreated", "Starting"}));
  EXPECT_TRUE(d.delete_pods.empty());
  EXPECT_TRUE(d.placed);
}

// The cluster and the ConfigMap are read only for a pass that needs them: one made
// without them says so and decides nothing else; given them, it decides as ever.
TEST(Decide, APassThatLacksTheClusterOrTheConfigMapSaysSoAndDecidesNothingElse) {
  Observed o = Observe(JobObject(), {});
  o.cluster.reset();
  o.config_map.reset();
  const Decision lacking = Decide(o, {});
  EXPECT_TRUE(lacking.needs.cluster);
  EXPECT_TRUE(lacking.needs.config_map);
  EXPECT_FALSE(lacking.create);
  EXPECT_TRUE(lacking.claims.empty());
  EXPECT_TRUE(lacking.events.empty());
  EXPECT_FALSE(lacking.placed);
  EXPECT_EQ(lacking.status, o.status);
  const Decision whole = Decide(Observe(JobObject(), {}), {});
  o.cluster = Observe(JobObject(), {}).cluster;
  o.config_map = json();
  const Decision d = Decide(o, {});
  EXPECT_FALSE(d.needs.any());
  ASSERT_TRUE(d.create);
  EXPECT_EQ(d.create->pods, whole.create->pods);
  EXPECT_EQ(d.status, whole.status);

  RunningJob job;
  Observed running = Observe(job.object, job.status, job.pods);
  running.cluster.reset();
  running.config_map.reset();
  EXPECT_FALSE(Decide(running, {}).needs.any()) << "a gang that runs needs neither";
}

TEST(Decide, AFailedPodIsRecordedAsARestartBeforeAnyPodIsDeleted) {
  RunningJob job;
  job.pods[1] = Running(job.pods[1], "Failed", 1);
  const Decision restart = Decide(Observe(job.object, job.status, job.pods), {});
  EXPECT_EQ(restart.status.restarts, 1);
  EXPECT_EQ(restart.status.phase, "Restarting");
  EXPECT_TRUE(restart.delete_pods.empty()) << "the deletes wait for the restart to be stored";
  EXPECT_FALSE(restart.create);
  EXPECT_EQ(Reasons(restart), (std::vector<std::string>{"PodFailed", "Restarting"}));
  EXPECT_EQ(restart.avoid_node, PinnedNode(job.pods[1]));
  EXPECT_EQ(restart.restart_kind, "recreated");

  // The write conflicted: the retry sees the same objects and decides the same, no more.
  const Decision retry = Decide(Observe(job.object, job.status, job.pods), {});
  EXPECT_EQ(retry.status.restarts, 1);
  EXPECT_TRUE(retry.delete_pods.empty());

  // Once stored, the next pass deletes gang 0 and waits for it to go.
  const Decision cleanup = Decide(Observe(job.object, restart.status, job.pods), {});
  EXPECT_EQ(cleanup.delete_pods.size(), 2u);
  EXPECT_FALSE(cleanup.create);
  EXPECT_TRUE(cleanup.events.empty());
  EXPECT_EQ(cleanup.status, restart.status);
  Observed terminating = Observe(job.object, restart.status);
  terminating.terminating = 2;
  const Decision waiting = Decide(terminating, {});
  EXPECT_FALSE(waiting.create) << "gang 1 waits until gang 0's pods are gone";
  EXPECT_GT(waiting.requeue_after.count(), 0);

  const Decision next = Decide(Observe(job.object, restart.status), {});
  ASSERT_TRUE(next.create);
  EXPECT_EQ(next.create->pods.at(0)["metadata"]["name"], "tiny-g1-0");
  EXPECT_EQ(next.status.phase, "Starting");
  EXPECT_EQ(Reasons(next), (std::vector<std::string>{"GangCreated", "Starting"}));
}

TEST(Decide, ExitCode78FailsTheJobAndCleanPodPolicyDeletesOnTheNextPass) {
  RunningJob job;
  job.pods[0] = Running(job.pods[0], "Failed", api::worker::kExitPermanent);
  const Decision failed = Decide(Observe(job.object, job.status, job.pods), {});
  EXPECT_EQ(failed.status.phase, "Failed");
  EXPECT_EQ(failed.status.restarts, 0);
  EXPECT_TRUE(failed.delete_pods.empty());
  EXPECT_EQ(Reasons(failed), (std::vector<std::string>{"Failed"}));
  EXPECT_NE(failed.events[0].message.find("exit code 78"), std::string::npos) << failed.events[0].message;

  const Decision cleanup = Decide(Observe(job.object, failed.status, job.pods), {});
  ASSERT_EQ(cleanup.delete_pods.size(), 1u) << "cleanPodPolicy Running: the running pod only";
  EXPECT_EQ(cleanup.delete_pods[0]["metadata"]["name"], "tiny-g0-1");
  EXPECT_TRUE(cleanup.events.empty());
}

TEST(Decide, BackoffLimitTurnsARestartIntoAFailure) {
  RunningJob job;
  job.object["spec"]["runPolicy"]["backoffLimit"] = 0;
  job.pods[1] = Running(job.pods[1], "Failed", 1);
  const Decision d = Decide(Observe(job.object, job.status, job.pods), {});
  EXPECT_EQ(d.status.phase, "Failed");
  EXPECT_EQ(d.restart_kind, "");
  EXPECT_EQ(d.events.at(0).reason, "Failed");
  EXPECT_NE(d.events[0].message.find("backoffLimit 0"), std::string::npos) << d.events[0].message;
}

TEST(Decide, SuspendIsStoredFirstThenThePodsGo) {
  RunningJob job;
  job.object["spec"]["runPolicy"]["suspend"] = true;
  const Decision suspend = Decide(Observe(job.object, job.status, job.pods), {});
  EXPECT_EQ(suspend.status.phase, "Suspended");
  EXPECT_TRUE(suspend.delete_pods.empty());
  const Decision cleanup = Decide(Observe(job.object, suspend.status, job.pods), {});
  EXPECT_EQ(cleanup.delete_pods.size(), 2u);
  EXPECT_EQ(cleanup.status, suspend.status);
  EXPECT_TRUE(cleanup.events.empty());
}

TEST(Decide, ACreationWhoseStatusWasNotStoredIsFinishedFromItsConfigMap) {
  const json object = JobObject();
  const Decision first = Decide(Observe(object, {}), {});
  ASSERT_TRUE(first.create);
  // The pods and the ConfigMap were created, the status write conflicted, and one pod is
  // in the cache: the retry keeps the same placement and creates only the other pod.
  Observed retry = Observe(object, {}, {Running(first.create->pods[0], "Pending")});
  const json config_map = [&] {
    json cm = first.create->config_map;
    cm["metadata"]["resourceVersion"] = "7";
    return cm;
  }();
  retry.config_map = config_map;
  const Decision d = Decide(retry, {});
  ASSERT_TRUE(d.create);
  ASSERT_EQ(d.create->pods.size(), 1u);
  EXPECT_EQ(d.create->pods[0]["metadata"]["name"], "tiny-g0-1");
  EXPECT_EQ(d.create->pods[0], first.create->pods[1]);
  EXPECT_FALSE(d.create->replace_config_map);
  EXPECT_EQ(d.status.placement, first.status.placement);
  EXPECT_FALSE(d.placed) << "placement does not run again";
}

TEST(Decide, UnschedulableWarnsOnceAndRetries) {
  Observed o = Observe(JobObject(), {});
  o.cluster = scheduler::ClusterView::Of({});
  const Decision d = Decide(o, {});
  EXPECT_FALSE(d.create);
  EXPECT_EQ(d.status.phase, "Pending");
  EXPECT_EQ(Reasons(d), (std::vector<std::string>{"Unschedulable", "Pending"}));
  EXPECT_EQ(d.requeue_after, std::chrono::milliseconds(std::chrono::seconds(10)));
  Observed again = Observe(JobObject(), d.status);
  again.cluster = o.cluster;
  EXPECT_TRUE(Decide(again, {}).events.empty()) << "nothing changed: no second Warning";
}

// Without Kueue (the chart's kueue.enabled is false), a job labelled for a Kueue queue is
// told once, with a Warning and a condition, that the label is ignored, and is placed as
// any other job; with Kueue on there is no warning.
TEST(Decide, AQueueLabelWithoutKueueIsIgnoredWithOneWarning) {
  json object = JobObject();
  object["metadata"]["labels"] = {{kQueueNameLabel, "training"}};
  const auto ignored = [](const Decision& d) {
    const auto& c = d.status.conditions;
    return std::find_if(c.begin(), c.end(), [](const api::Condition& x) { return x.type == kQueueLabelIgnoredCondition; });
  };
  const Decision plain = Decide(Observe(JobObject(), {}), {});
  const Decision d = Decide(Observe(object, {}), {});
  ASSERT_TRUE(d.create);
  EXPECT_EQ(d.status.placement, plain.status.placement) << "placed as any other job";
  EXPECT_EQ(d.create->pods.size(), plain.create->pods.size());
  EXPECT_EQ(d.status.phase, "Starting");
  EXPECT_EQ(Reasons(d), (std::vector<std::string>{"QueueLabelIgnored", "GangCreated", "Starting"}));
  EXPECT_EQ(d.events[0].type, "Warning");
  EXPECT_EQ(d.events[0].message,
            "label kueue.x-k8s.io/queue-name=training is ignored: the operator runs without Kueue (the chart's "
            "kueue.enabled is false), so it places the job itself");
  ASSERT_NE(ignored(d), d.status.conditions.end());
  EXPECT_EQ(ignored(d)->status, "True");
  EXPECT_EQ(ignored(d)->reason, "KueueDisabled");

  // The next pass, from the stored status, warns no more.
  std::vector<json> pods;
  for (const auto& pod : d.create->pods) pods.push_back(Running(pod));
  const Decision running = Decide(Observe(object, d.status, pods), {});
  EXPECT_EQ(running.status.phase, "Running");
  EXPECT_EQ(Reasons(running), (std::vector<std::string>{"Running"}));
  EXPECT_EQ(ignored(running)->status, "True");

  // Another queue is a new warning; without the label the condition turns False, silently.
  json other = object;
  other["metadata"]["labels"][kQueueNameLabel] = "other";
  const Decision moved = Decide(Observe(other, running.status, pods), {});
  EXPECT_EQ(Reasons(moved), (std::vector<std::string>{"QueueLabelIgnored"}));
  other["metadata"].erase("labels");
  const Decision unlabelled = Decide(Observe(other, moved.status, pods), {});
  EXPECT_TRUE(unlabelled.events.empty());
  EXPECT_EQ(ignored(unlabelled)->status, "False");
  EXPECT_EQ(ignored(unlabelled)->reason, "NoQueueLabel");

  // With Kueue on: no warning, no condition; the job is Queued behind its Workload
  // (kueue_decide_test.cc).
  DecideOptions kueue;
  kueue.kueue = true;
  Observed queued = Observe(object, {});
  queued.workload = json();  // none yet
  const Decision on = Decide(queued, kueue);
  EXPECT_EQ(Reasons(on), (std::vector<std::string>{"Queued"}));
  EXPECT_EQ(on.status.phase, "Queued");
  EXPECT_TRUE(on.create_workload);
  EXPECT_FALSE(on.create);
  EXPECT_EQ(ignored(on), on.status.conditions.end());
}

TEST(Decide, ProgressComesFromTheObservationAndAResumeIsAnnouncedOnce) {
  RunningJob job;
  Observed o = Observe(job.object, job.status, job.pods);
  api::ProgressStatus progress;
  progress.step = 30;
  progress.resumed_from_step = 20;
  o.progress = progress;
  const Decision d = Decide(o, {});
  ASSERT_TRUE(d.progress_from);
  EXPECT_EQ((*d.progress_from)["metadata"]["name"], "tiny-g0-0");
  EXPECT_EQ(d.status.progress, progress);
  EXPECT_EQ(Reasons(d), (std::vector<std::string>{"Resumed"}));
  Observed later = Observe(job.object, d.status, job.pods);
  progress.step = 31;
  later.progress = progress;
  EXPECT_TRUE(Decide(later, {}).events.empty());
}

// A failure's time is stored with the restart it causes (so an operator restart keeps it);
// the first step the new gang trains measures the recovery, once, and clears it.
TEST(Decide, TheFirstStepAfterARestartMeasuresTheRecoveryFromTheFailure) {
  RunningJob job;
  std::vector<json> failed = job.pods;
  failed[1] = Running(failed[1], "Failed", 137);
  const Decision restart = Decide(Observe(job.object, job.status, failed), {});
  ASSERT_EQ(restart.restart_kind, "recreated");
  EXPECT_EQ(restart.status.last_failure_time, kube::MicroTime(kNow));

  api::TrainingJobStatus restarted = job.status;  // a gang runs, restarted by that failure
  restarted.last_failure_time = kube::MicroTime(kNow - std::chrono::milliseconds(500));
  api::ProgressStatus progress;
  progress.step = 20;
  progress.resumed_from_step = 20;  // resumed, no step yet
  Observed loading = Observe(job.object, restarted, job.pods);
  loading.progress = progress;
  const Decision before = Decide(loading, {});
  EXPECT_FALSE(before.recovery_seconds);
  EXPECT_EQ(before.status.last_failure_time, restarted.last_failure_time);

  progress.step = 21;
  Observed stepped = Observe(job.object, before.status, job.pods);
  stepped.progress = progress;
  stepped.now = kNow + std::chrono::seconds(12);
  const Decision recovered = Decide(stepped, {});
  ASSERT_TRUE(recovered.recovery_seconds);
  EXPECT_NEAR(*recovered.recovery_seconds, 12.5, 1e-6);
  EXPECT_EQ(recovered.status.last_failure_time, "");
  ASSERT_EQ(Reasons(recovered), (std::vector<std::string>{"Recovered"}));
  EXPECT_EQ(recovered.events[0].message, "the gang trained step 21 12.5 s after the failure that restarted it");

  Observed later = Observe(job.object, recovered.status, job.pods);
  progress.step = 22;
  later.progress = progress;
  later.now = kNow + std::chrono::seconds(20);
  EXPECT_FALSE(Decide(later, {}).recovery_seconds) << "measured once";
}

LauncherState L(int64_t attempt, std::string state, std::optional<int64_t> exit_code = std::nullopt,
                std::optional<int64_t> rank = std::nullopt, std::string reason = "") {
  return {attempt, std::move(state), exit_code, rank, std::move(reason)};
}

// Each pod's launcher state, as the poller read it.
std::map<std::string, LauncherState> Launchers(const std::vector<json>& pods, const std::vector<LauncherState>& states) {
  std::map<std::string, LauncherState> out;
  for (size_t i = 0; i < pods.size(); ++i) out[pods[i]["metadata"]["uid"].get<std::string>()] = states[i];
  return out;
}

std::string EnvOf(const json& pod, const std::string& name) {
  for (const auto& e : pod["spec"]["containers"][0]["env"])
    if (e["name"] == name) return e.value("value", "");
  return "";
}

TEST(Decide, AFailedRankRestartsTheGangInPlaceThroughItsLaunchers) {
  RunningJob job;
  Observed running = Observe(job.object, job.status, job.pods);
  running.launchers = Launchers(job.pods, {L(0, "running"), L(0, "running")});
  const Decision steady = Decide(running, {});
  EXPECT_EQ(steady.status.phase, "Running");
  EXPECT_TRUE(steady.launcher_calls.empty());
  EXPECT_EQ(steady.launchers_from.size(), 2u) << "a running gang's launchers are read";

  // Rank 9 (pod 1) was killed: its launcher stopped its ranks and holds.
  Observed failed = Observe(job.object, job.status, job.pods);
  failed.launchers = Launchers(job.pods, {L(0, "running"), L(0, "failed", 137, 9)});
  const Decision restart = Decide(failed, {});
  EXPECT_EQ(restart.restart_kind, "in_place");
  EXPECT_EQ(restart.status.restarts, 1);
  EXPECT_EQ(restart.status.failures, 1) << "counted against backoffLimit";
  EXPECT_EQ(GangOf(restart.status), 0) << "the same pods";
  EXPECT_EQ(restart.status.phase, "Restarting");
  EXPECT_EQ(restart.status.placement, job.status.placement);
  EXPECT_EQ(restart.status.last_failure_time, kube::MicroTime(kNow));
  EXPECT_TRUE(restart.delete_pods.empty());
  EXPECT_FALSE(restart.create);
  EXPECT_TRUE(restart.launcher_calls.empty()) << "the launchers follow the attempt once it is stored";
  ASSERT_EQ(Reasons(restart), (std::vector<std::string>{"Restarted", "Restarting"}));
  EXPECT_EQ(restart.events[0].message, "rank 9 in pod tiny-g0-1 on node " + PinnedNode(job.pods[1]) +
                                           " failed with exit code 137; restarting the gang in place: attempt 1 "
                                           "(backoffLimit 3)");
  EXPECT_EQ(restart.events[0].type, "Warning");

  auto pass = [&](std::vector<LauncherState> states) {
    Observed o = Observe(job.object, restart.status, job.pods);
    o.launchers = Launchers(job.pods, states);
    return Decide(o, {});
  };
  auto calls = [](const Decision& d) {
    std::vector<std::string> out;
    for (const auto& c : d.launcher_calls)
      out.push_back(c.action + " " + std::to_string(c.attempt) + " " + c.pod["metadata"]["name"].get<std::string>());
    return out;
  };
  // Stored: every launcher behind the attempt is stopped at it; none starts yet.
  const Decision stopping = pass({L(0, "running"), L(0, "failed", 137, 9)});
  EXPECT_EQ(calls(stopping), (std::vector<std::string>{"stop 1 tiny-g0-0", "stop 1 tiny-g0-1"}));
  EXPECT_EQ(stopping.status.phase, "Restarting");
  EXPECT_TRUE(stopping.delete_pods.empty());
  EXPECT_TRUE(stopping.events.empty());
  EXPECT_GT(stopping.requeue_after.count(), 0);
  EXPECT_EQ(calls(pass({L(1, "ready"), L(0, "failed", 137, 9)})), (std::vector<std::string>{"stop 1 tiny-g0-1"}))
      << "no launcher starts while another still runs the old attempt";
  // A launcher not read yet is asked too: its answer is its state.
  Observed unread = Observe(job.object, restart.status, job.pods);
  unread.launchers = Launchers({job.pods[0]}, {L(1, "ready")});
  EXPECT_EQ(calls(Decide(unread, {})), (std::vector<std::string>{"stop 1 tiny-g0-1"}));
  // The gang-wide barrier: all stopped, all start.
  EXPECT_EQ(calls(pass({L(1, "ready"), L(1, "ready")})), (std::vector<std::string>{"start 1 tiny-g0-0", "start 1 tiny-g0-1"}));
  EXPECT_EQ(calls(pass({L(1, "running"), L(1, "ready")})), (std::vector<std::string>{"start 1 tiny-g0-1"}))
      << "an interrupted pass is finished";
  const Decision resumed = pass({L(1, "running"), L(1, "running")});
  EXPECT_TRUE(resumed.launcher_calls.empty());
  EXPECT_EQ(resumed.status.phase, "Running");
  EXPECT_EQ(resumed.status.restarts, 1);
  EXPECT_EQ(Reasons(resumed), (std::vector<std::string>{"Running"}));
  EXPECT_TRUE(resumed.progress_from) << "rank 0's metrics are read again, from the new attempt";

  // A failure of the old attempt, reported late, is not a new one.
  Observed late = Observe(job.object, resumed.status, job.pods);
  late.launchers = Launchers(job.pods, {L(1, "running"), L(0, "failed", 137, 9)});
  EXPECT_EQ(Decide(late, {}).restart_kind, "");
}

TEST(Decide, ARankThatFailedInACollectiveIsNamedOnlyWhenNoOtherFailureIsReported) {
  RunningJob job;
  Observed victim = Observe(job.object, job.status, job.pods);
  victim.launchers = Launchers(job.pods, {L(0, "failed", api::worker::kExitCommFailure, 1), L(0, "running")});
  const Decision waiting = Decide(victim, {});
  EXPECT_EQ(waiting.restart_kind, "") << "pod 1's launcher may report the failure that caused rank 1's";
  EXPECT_GT(waiting.requeue_after.count(), 0);
  EXPECT_TRUE(waiting.events.empty());

  victim.failure_seen = kNow - std::chrono::seconds(3);
  const Decision waited = Decide(victim, {});
  EXPECT_EQ(waited.restart_kind, "in_place") << "the wait for the cause is short: pod 1's ranks may be stuck";
  EXPECT_EQ(waited.events.at(0).message.rfind("rank 1 in pod tiny-g0-0", 0), 0u) << waited.events[0].message;

  Observed both = Observe(job.object, job.status, job.pods);
  both.launchers = Launchers(job.pods, {L(0, "failed", api::worker::kExitCommFailure, 1), L(0, "failed", 137, 3)});
  const Decision root = Decide(both, {});
  EXPECT_EQ(root.restart_kind, "in_place");
  EXPECT_EQ(root.events.at(0).message.rfind("rank 3 in pod tiny-g0-1", 0), 0u) << root.events[0].message;

  Observed all_comm = Observe(job.object, job.status, job.pods);
  all_comm.launchers = Launchers(
      job.pods, {L(0, "failed", api::worker::kExitCommFailure, 1, "all_reduce timed out on rank 2"),
                 L(0, "failed", api::worker::kExitCommFailure, 2)});
  const Decision network = Decide(all_comm, {});
  EXPECT_EQ(network.restart_kind, "in_place");
  // With the peer it lost, in the failed rank's words.
  EXPECT_NE(network.events.at(0).message.find(
                "rank 1 in pod tiny-g0-0 on node " + PinnedNode(job.pods[0]) +
                " failed with exit code 76 in a collective: all_reduce timed out on rank 2; restarting"),
            std::string::npos)
      << network.events[0].message;
}

// A hang is found by rank 0, which exits 75; what it wrote names the stuck rank, and the
// Restarted Event quotes it: the rank that failed is not the one at fault.
TEST(Decide, TheRestartedEventQuotesWhatTheFailedRankSaid) {
  RunningJob job;
  Observed hung = Observe(job.object, job.status, job.pods);
  hung.launchers = Launchers(
      job.pods, {L(0, "failed", api::worker::kExitHang, 0,
                   "rank 11 made no progress for 3.0 s (its heartbeat stopped: stopped or hung)"),
                 L(0, "running")});
  const Decision restart = Decide(hung, {});
  EXPECT_EQ(restart.restart_kind, "in_place");
  ASSERT_EQ(Reasons(restart), (std::vector<std::string>{"Restarted", "Restarting"}));
  EXPECT_EQ(restart.events[0].message,
            "rank 0 in pod tiny-g0-0 on node " + PinnedNode(job.pods[0]) +
                " failed with exit code 75: rank 11 made no progress for 3.0 s (its heartbeat stopped: stopped or "
                "hung); restarting the gang in place: attempt 1 (backoffLimit 3)");
}

TEST(Decide, ALauncherAtExit78FailsTheJobAndInPlaceRestartsCountAgainstTheBackoffLimit) {
  RunningJob job;
  Observed config_error = Observe(job.object, job.status, job.pods);
  config_error.launchers = Launchers(job.pods, {L(0, "failed", 78, 0), L(0, "running")});
  const Decision failed = Decide(config_error, {});
  EXPECT_EQ(failed.status.phase, "Failed");
  EXPECT_EQ(failed.status.restarts, 0);
  EXPECT_NE(failed.status.conditions.back().message.find("a permanent failure; not restarting"), std::string::npos);

  job.object["spec"]["runPolicy"]["backoffLimit"] = 1;
  api::TrainingJobStatus once = job.status;
  once.restarts = once.failures = 1;  // one in-place restart already
  Observed again = Observe(job.object, once, job.pods);
  again.launchers = Launchers(job.pods, {L(1, "failed", 1, 3), L(1, "running")});
  const Decision over = Decide(again, {});
  EXPECT_EQ(over.status.phase, "Failed");
  EXPECT_EQ(over.restart_kind, "");
  EXPECT_NE(over.events.at(0).message.find("backoffLimit 1"), std::string::npos) << over.events[0].message;
}

TEST(Decide, AFailureAfterAPodFinishedRecreatesTheGang) {
  RunningJob job;
  std::vector<json> pods = job.pods;
  pods[0] = Running(pods[0], "Succeeded", 0);  // its ranks all exited 0, and so did its launcher
  Observed o = Observe(job.object, job.status, pods);
  o.launchers = Launchers({pods[1]}, {L(0, "failed", 137, 3)});
  const Decision d = Decide(o, {});
  EXPECT_EQ(d.restart_kind, "recreated") << "no launcher is left in pod 0 to restart";
  EXPECT_EQ(GangOf(d.status), 1);
}

TEST(Decide, ANodeLostDuringAnInPlaceRestartRecreatesTheGangUnderANewNumber) {
  RunningJob job;
  api::TrainingJobStatus in_place = job.status;
  in_place.restarts = 2;  // two in-place restarts: gang 0 still runs
  in_place.phase = "Restarting";
  const std::string lost = PinnedNode(job.pods[1]);
  Observed o = Observe(job.object, in_place, job.pods);
  Lose(&o, lost);
  const Decision restart = Decide(o, {});
  EXPECT_EQ(restart.restart_kind, "recreated");
  EXPECT_EQ(restart.status.restarts, 3);
  EXPECT_EQ(GangOf(restart.status), 3);
  EXPECT_EQ(restart.avoid_node, lost);

  const Decision cleanup = Decide(Observe(job.object, restart.status, job.pods), {});
  EXPECT_EQ(cleanup.delete_pods.size(), 2u) << "gang 0's pods go";
  const Decision created = Decide(Observe(job.object, restart.status), {});
  ASSERT_TRUE(created.create);
  EXPECT_EQ(created.create->pods.at(1)["metadata"]["name"], "tiny-g3-1");
  EXPECT_EQ(EnvOf(created.create->pods[1], "MESHTRAIN_ATTEMPT"), "3") << "the launchers start at the gang's attempt";
  EXPECT_EQ(created.status.gang, 3);
}

// Node replacement: the pod on a lost node moves to a free node near it, held at the next
// attempt, and the other pods restart in place; then every launcher starts together.
TEST(Decide, APodOnALostNodeMovesToAReplacementAndTheOthersRestartInPlace) {
  RunningJob job;
  const std::string lost = PinnedNode(job.pods[1]);
  auto calls = [](const Decision& d) {
    std::vector<std::string> out;
    for (const auto& c : d.launcher_calls)
      out.push_back(c.action + " " + std::to_string(c.attempt) + " " + c.pod["metadata"]["name"].get<std::string>());
    return out;
  };
  Observed o = Observe(job.object, job.status, job.pods);
  Lose(&o, lost);
  o.launchers = Launchers(job.pods, {L(0, "running"), L(0, "running")});
  Observed unread = o;
  unread.cluster.reset();
  EXPECT_TRUE(Decide(unread, {}).needs.cluster) << "the replacement is placed from the cluster";
  const Decision replace = Decide(o, {});
  EXPECT_EQ(replace.restart_kind, "replaced");
  EXPECT_EQ(replace.status.restarts, 1);
  EXPECT_EQ(replace.status.failures, 1);
  EXPECT_EQ(GangOf(replace.status), 0) << "the same gang: pod 0 stays";
  EXPECT_EQ(replace.status.phase, "Restarting");
  EXPECT_EQ(replace.avoid_node, lost);
  ASSERT_TRUE(replace.status.placement);
  const std::string spare = replace.status.placement->nodes.at(1).name;
  EXPECT_NE(spare, lost);
  EXPECT_NE(spare, PinnedNode(job.pods[0]));
  EXPECT_EQ(replace.status.placement->nodes[0], job.status.placement->nodes[0]);
  EXPECT_TRUE(replace.delete_pods.empty()) << "deletes follow the stored status";
  EXPECT_FALSE(replace.create);
  ASSERT_EQ(Reasons(replace), (std::vector<std::string>{"Restarted", "Restarting"}));
  EXPECT_EQ(replace.events[0].message.rfind("node " + lost + " of pod tiny-g0-1 is not Ready; its node rank 1 moves to node " +
                                                spare, 0),
            0u)
      << replace.events[0].message;
  EXPECT_NE(replace.events[0].message.find("and the other pods restart in place: attempt 1 (backoffLimit 3)"),
            std::string::npos)
      << replace.events[0].message;

  // Stored: the lost pod goes, its successor is created held at attempt 1 on the spare, the
  // ConfigMap's rank table names the spare, and pod 0's launcher is stopped at attempt 1.
  api::FieldErrors errors;
  json config_map = BuildConfigMap(Observe(job.object, {}).checked.job, job.object["spec"], api::RankTable{}, 0);
  config_map["metadata"]["resourceVersion"] = "7";
  Observed stored = Observe(job.object, replace.status, job.pods);
  Lose(&stored, lost);
  stored.launchers = Launchers(job.pods, {L(0, "running"), L(0, "failed", 76, 9)});
  stored.config_map = config_map;
  const Decision moving = Decide(stored, {});
  ASSERT_EQ(moving.delete_pods.size(), 1u);
  EXPECT_EQ(moving.delete_pods[0]["metadata"]["name"], "tiny-g0-1");
  EXPECT_EQ(moving.force_delete, (std::set<std::string>{"uid-tiny-g0-1"})) << "no kubelet will confirm its end";
  ASSERT_TRUE(moving.create);
  ASSERT_EQ(moving.create->pods.size(), 1u);
  const json successor = moving.create->pods[0];
  EXPECT_EQ(successor["metadata"]["name"], "tiny-g0-1-a1") << "the lost pod may still be terminating under its name";
  EXPECT_EQ(PinnedNode(successor), spare);
  EXPECT_EQ(EnvOf(successor, "MESHTRAIN_ATTEMPT"), "1");
  EXPECT_EQ(EnvOf(successor, "MESHTRAIN_LAUNCHER_HELD"), "1");
  EXPECT_TRUE(moving.create->replace_config_map);
  const api::RankTable table =
      api::DecodeRankTable(json::parse(moving.create->config_map["data"]["rank-table.json"].get<std::string>()), &errors);
  EXPECT_TRUE(errors.empty());
  ASSERT_EQ(table.nodes.size(), 2u);
  EXPECT_EQ(table.nodes[1].name, spare);
  EXPECT_EQ(table.nodes[1].ranks, (std::vector<int64_t>{8, 9, 10, 11, 12, 13, 14, 15}));
  EXPECT_EQ(moving.create->config_map["metadata"]["resourceVersion"], "7");
  EXPECT_EQ(calls(moving), (std::vector<std::string>{"stop 1 tiny-g0-0"}));
  EXPECT_TRUE(moving.events.empty());

  // The successor runs held; pod 0 has stopped: both start attempt 1 together.
  std::vector<json> pods = {job.pods[0], Running(successor)};
  auto pass = [&](std::vector<LauncherState> states) {
    Observed later = Observe(job.object, replace.status, pods);
    Lose(&later, lost);
    later.launchers = Launchers(pods, states);
    later.config_map = config_map;
    return Decide(later, {});
  };
  const Decision waiting = pass({L(0, "running"), L(1, "ready")});
  EXPECT_EQ(calls(waiting), (std::vector<std::string>{"stop 1 tiny-g0-0"}));
  EXPECT_FALSE(waiting.create) << "the gang is whole";
  EXPECT_TRUE(waiting.delete_pods.empty());
  EXPECT_EQ(calls(pass({L(1, "ready"), L(1, "ready")})),
            (std::vector<std::string>{"start 1 tiny-g0-0", "start 1 tiny-g0-1-a1"}));
  const Decision resumed = pass({L(1, "running"), L(1, "running")});
  EXPECT_EQ(resumed.status.phase, "Running");
  EXPECT_EQ(resumed.status.restarts, 1);
}

// Before the successor exists, no launcher starts: the barrier is the whole gang's. The
// launchers that wait are sent their stop again, which renews their hold, while the
// successor comes up; and a loss the gang already restarts for is counted once.
TEST(Decide, NoLauncherStartsWhileAReplacementIsMissing) {
  RunningJob job;
  const std::string lost = PinnedNode(job.pods[1]);
  const json config_map = BuildConfigMap(Observe(job.object, {}).checked.job, job.object["spec"], api::RankTable{}, 0);
  Observed o = Observe(job.object, job.status, job.pods);
  Lose(&o, lost);
  o.launchers = Launchers(job.pods, {L(0, "running"), L(0, "running")});
  const Decision replace = Decide(o, {});
  ASSERT_EQ(replace.restart_kind, "replaced");

  Observed without = Observe(job.object, replace.status, {job.pods[0]});
  Lose(&without, lost);
  without.launchers = Launchers({job.pods[0]}, {L(1, "ready")});
  without.config_map.reset();
  const Decision unread = Decide(without, {});
  EXPECT_TRUE(unread.needs.config_map) << "the successor's rank table is the ConfigMap's";
  EXPECT_FALSE(unread.needs.cluster);
  EXPECT_FALSE(unread.create);
  without.config_map = config_map;
  const Decision d = Decide(without, {});
  EXPECT_EQ(d.restart_kind, "");
  EXPECT_EQ(d.status.restarts, 1);
  EXPECT_EQ(d.status.failures, 1);
  EXPECT_EQ(d.status.phase, "Restarting");
  ASSERT_TRUE(d.create);
  ASSERT_EQ(d.create->pods.size(), 1u);
  EXPECT_EQ(d.create->pods[0]["metadata"]["name"], "tiny-g0-1-a1");
  ASSERT_EQ(d.launcher_calls.size(), 1u) << "pod 0 is ready, but its peer is not there yet: no start";
  EXPECT_EQ(d.launcher_calls[0].action, "stop") << "the stop that renews pod 0's hold";
  EXPECT_EQ(d.launcher_calls[0].attempt, 1);
  EXPECT_EQ(d.requeue_after, std::chrono::seconds(10)) << "renewed well inside the launchers' 60 s hold";

  // Ranks failed in collectives when the node went: the gang restarts in place (1 failure),
  // and the node's loss, seen during that restart, moves the pod without a second count.
  api::TrainingJobStatus in_place = job.status;
  in_place.restarts = in_place.failures = 1;
  in_place.phase = "Restarting";
  in_place.last_failure_time = "2033-05-18T03:33:19.000000Z";
  Observed during = Observe(job.object, in_place, job.pods);
  Lose(&during, lost);
  during.launchers = Launchers(job.pods, {L(1, "ready"), L(0, "failed", 76, 9)});
  const Decision moved = Decide(during, {});
  EXPECT_EQ(moved.restart_kind, "replaced");
  EXPECT_EQ(moved.status.restarts, 2);
  EXPECT_EQ(moved.status.failures, 1) << "one loss, counted once";
  EXPECT_EQ(moved.status.last_failure_time, in_place.last_failure_time) << "recovery counts from the first failure";
}

// No free node can take the lost pod's place: the gang is recreated as before (or shrinks,
// with spec.elastic), and the Event says why no replacement was found.
TEST(Decide, WithoutAReplacementNodeTheGangIsRecreated) {
  RunningJob job;
  const std::string lost = PinnedNode(job.pods[1]);
  Observed o = Observe(job.object, job.status, job.pods);
  Lose(&o, lost);
  o.launchers = Launchers(job.pods, {L(0, "running"), L(0, "running")});
  o.cluster = [] {
    scheduler::SyntheticClusterOptions options;
    options.nodes = 64;
    options.gpu_used_fraction = 1;  // every GPU is taken
    return scheduler::ClusterView::Of(scheduler::MakeSyntheticCluster(options));
  }();
  const Decision d = Decide(o, {});
  EXPECT_EQ(d.restart_kind, "recreated");
  ASSERT_EQ(Reasons(d), (std::vector<std::string>{"NoReplacement", "NodeNotReady", "Restarting"}));
  EXPECT_NE(d.events[0].message.find("no node can replace " + lost + ": "), std::string::npos) << d.events[0].message;

  Observed silent = Observe(job.object, job.status, job.pods);
  Lose(&silent, lost);
  silent.launchers = Launchers({job.pods[1]}, {L(0, "running")});  // pod 0's launcher does not answer
  EXPECT_EQ(Decide(silent, {}).restart_kind, "recreated") << "no in-place restart without every other launcher";
}

TEST(Decide, ANodeThatIsGoneRestartsTheGangAndIsAvoided) {
  RunningJob job;
  Observed o = Observe(job.object, job.status, job.pods);
  const std::string lost = PinnedNode(job.pods[0]);
  o.nodes.erase(lost);  // gone
  const Decision d = Decide(o, {});
  EXPECT_EQ(Reasons(d), (std::vector<std::string>{"NodeNotReady", "Restarting"}));
  EXPECT_EQ(d.avoid_node, lost);
  EXPECT_NE(d.events[0].message.find("is gone"), std::string::npos);
}

// A cluster of exactly `ready` free 8-GPU nodes, named node-0.., in one domain.
scheduler::ClusterView SmallCluster(int ready) {
  scheduler::SyntheticClusterOptions options;
  options.nodes = ready;
  options.gpu_used_fraction = 0;
  return scheduler::ClusterView::Of(scheduler::MakeSyntheticCluster(options));
}

// The status of a created gang once a node of it was lost: the gang is recreated (gang 1)
// wherever it now fits.
api::TrainingJobStatus Recreating(api::TrainingJobStatus status) {
  status.phase = "Restarting";
  status.restarts = status.gang.emplace(1);
  status.placement.reset();
  return status;
}

TEST(Decide, AnElasticJobWithNoSpareNodeShrinksAndGrowsBackAtItsNextCheckpoint) {
  json object = JobObject();
  object["spec"]["elastic"] = {{"minNodes", 1}};
  int cluster_nodes = 2;
  auto observe = [&](const api::TrainingJobStatus& status, std::vector<json> pods = {}) {
    Observed o = Observe(object, status, std::move(pods));
    SetCluster(&o, SmallCluster(cluster_nodes));
    return o;
  };
  const Decision created = Decide(observe({}), {});
  ASSERT_TRUE(created.create);
  ASSERT_EQ(created.create->pods.size(), 2u);
  ASSERT_TRUE(created.status.layout) << "an elastic job's layout is in status";
  EXPECT_EQ(created.status.layout->nodes, 2);
  EXPECT_EQ(created.restart_kind, "");

  // Its second node was lost and no other exists: the recreated gang has one node.
  const api::TrainingJobStatus lost = Recreating(created.status);
  cluster_nodes = 1;
  const Decision shrunk = Decide(observe(lost), {});
  ASSERT_TRUE(shrunk.create) << shrunk.status.conditions.back().message;
  ASSERT_EQ(shrunk.create->pods.size(), 1u);
  EXPECT_EQ(EnvOf(shrunk.create->pods[0], "MESHTRAIN_NNODES"), "1");
  const json written = json::parse(shrunk.create->config_map["data"]["job.json"].get<std::string>());
  EXPECT_EQ(written["spec"]["nodes"], 1) << "the workers run the gang's size";
  EXPECT_EQ(shrunk.status.placement->nodes.size(), 1u);
  ASSERT_TRUE(shrunk.status.layout);
  EXPECT_EQ(shrunk.status.layout->nodes, 1);
  EXPECT_EQ(shrunk.restart_kind, "shrunk");
  ASSERT_EQ(Reasons(shrunk), (std::vector<std::string>{"Shrunk", "GangCreated", "Starting"}));
  EXPECT_EQ(shrunk.events[0].message,
            "the gang runs on 1 of spec.nodes 2 (was 2): T=1, S=8, micro-batch 1, keep all, 16 micro-steps of "
            "accumulation per step keep the global batch of 16384 tokens");
  EXPECT_EQ(shrunk.events[0].type, "Warning");

  // Without spec.elastic it waits, Pending with the reason.
  json rigid = JobObject();
  Observed waiting = Observe(rigid, lost);
  SetCluster(&waiting, SmallCluster(1));
  const Decision pending = Decide(waiting, {});
  EXPECT_FALSE(pending.create);
  EXPECT_EQ(pending.status.phase, "Pending");
  EXPECT_EQ(Reasons(pending), (std::vector<std::string>{"Unschedulable", "Pending"}));

  // The shrunk gang runs; a new checkpoint with room for both nodes again grows it back.
  std::vector<json> pods = {Running(shrunk.create->pods[0])};
  api::TrainingJobStatus running = Decide(observe(shrunk.status, pods), {}).status;
  ASSERT_EQ(running.phase, "Running");
  running.progress.emplace().checkpoint_step = 20;
  api::ProgressStatus progress;
  progress.step = 25;
  progress.checkpoint_step = 20;
  Observed same = observe(running, pods);
  same.progress = progress;
  same.cluster.reset();
  const Decision no_checkpoint = Decide(same, {});
  EXPECT_EQ(no_checkpoint.restart_kind, "") << "no new checkpoint: no growth";
  EXPECT_FALSE(no_checkpoint.needs.any()) << "and no look at the cluster";
  progress.checkpoint_step = 40;
  cluster_nodes = 1;
  Observed no_room = observe(running, pods);
  no_room.progress = progress;
  EXPECT_EQ(Decide(no_room, {}).restart_kind, "") << "the node has not come back";
  cluster_nodes = 2;
  Observed room = observe(running, pods);
  room.progress = progress;
  const Decision grow = Decide(room, {});
  EXPECT_EQ(grow.restart_kind, "grown");
  EXPECT_EQ(grow.status.phase, "Restarting");
  ASSERT_EQ(Reasons(grow), (std::vector<std::string>{"Growing", "Restarting"}));
  EXPECT_EQ(grow.events[0].type, "Normal");
  EXPECT_EQ(grow.events[0].message,
            "all 2 nodes fit again; the gang of 1 grows back from the checkpoint of step 40; restarting the gang");
  EXPECT_EQ(grow.status.restarts, running.restarts + 1);
  EXPECT_EQ(grow.status.failures, running.failures) << "growing back is no failure: backoffLimit is kept for those";
  EXPECT_TRUE(grow.status.last_failure_time.empty()) << "not a failure";
  const Decision regrown = Decide(observe(grow.status), {});
  ASSERT_TRUE(regrown.create);
  EXPECT_EQ(regrown.create->pods.size(), 2u);
  EXPECT_EQ(Reasons(regrown), (std::vector<std::string>{"Grown", "GangCreated", "Starting"}));
}

TEST(Decide, PodsNotYetInTheCacheAreAwaitedNotTakenAsDeleted) {
  RunningJob job;
  Observed o = Observe(job.object, job.status, {job.pods[0]});
  o.awaiting_created_pods = true;
  const Decision d = Decide(o, {});
  EXPECT_EQ(d.status, job.status);
  EXPECT_TRUE(d.events.empty());
  EXPECT_EQ(d.requeue_after, std::chrono::seconds(5)) << "the pod's event enqueues the job sooner";
  EXPECT_FALSE(d.rests_on_absence);
  o.awaiting_created_pods = false;
  const Decision deleted = Decide(o, {});
  EXPECT_EQ(Reasons(deleted), (std::vector<std::string>{"PodDeleted", "Restarting"}));
  EXPECT_TRUE(deleted.rests_on_absence) << "a pod missing from the cache: the API server is asked before acting";
}

TEST(Decide, TheDeadlineFailsAStartedJob) {
  RunningJob job;
  job.object["spec"]["runPolicy"]["activeDeadlineSeconds"] = 60;
  Observed o = Observe(job.object, job.status, job.pods);
  o.now = kNow + std::chrono::seconds(61);
  const Decision d = Decide(o, {});
  EXPECT_EQ(d.status.phase, "Failed");
  EXPECT_EQ(d.status.conditions.back().reason, "DeadlineExceeded");
  o.now = kNow + std::chrono::seconds(30);
  EXPECT_EQ(Decide(o, {}).requeue_after, std::chrono::milliseconds(std::chrono::seconds(30)));
}

TEST(Decide, TheOperatorsWorkerDefaultsReachThePodsAndStatus) {
  json object = JobObject();
  object["spec"]["template"] = {{"nodeSelector", {{kInstanceTypeLabel, "p5.48xlarge"}}}};
  DecideOptions options;
  options.worker.efa_per_instance_type = {{"p5.48xlarge", 32}};
  options.worker.hugepages_2mi = "5120Mi";
  Observed o = Observe(object, {});
  SetCluster(&o, [] {
    scheduler::SyntheticClusterOptions cluster;
    cluster.nodes = 64;
    cluster.gpu_used_fraction = 0;
    cluster.efa_per_node = 32;
    scheduler::ClusterSnapshot snapshot = scheduler::MakeSyntheticCluster(cluster);
    for (auto& node : snapshot.nodes) node.labels[kInstanceTypeLabel] = "p5.48xlarge";
    return scheduler::ClusterView::Of(snapshot);
  }());
  const Decision d = Decide(o, options);
  ASSERT_TRUE(d.create) << d.status.conditions.at(0).message;
  const json& limits = d.create->pods.at(0)["spec"]["containers"][0]["resources"]["limits"];
  EXPECT_EQ(limits["vpc.amazonaws.com/efa"], "32");
  EXPECT_EQ(limits["hugepages-2Mi"], "5120Mi");
  bool recorded = false;
  for (const auto& derived : d.status.defaults) recorded = recorded || (derived.field == "spec.resources.efa" && derived.value == "32");
  EXPECT_TRUE(recorded) << "status.defaults says where the EFA count came from: " << api::ToJson(d.status).dump();
}

TEST(Decide, TheTtlDeletesAFinishedJob) {
  RunningJob job;
  job.object["spec"]["runPolicy"]["ttlSecondsAfterFinished"] = 5;
  api::TrainingJobStatus done = job.status;
  done.phase = "Succeeded";
  done.completion_time = kube::Rfc3339(kNow);
  Observed o = Observe(job.object, done);
  o.now = kNow + std::chrono::seconds(2);
  EXPECT_FALSE(Decide(o, {}).delete_job);
  o.now = kNow + std::chrono::seconds(5);
  EXPECT_TRUE(Decide(o, {}).delete_job);
}

// spec.parallelism.mode auto: the planner chooses the layout for the placed nodes; the
// workers' ConfigMap holds the resolved spec and status.layout the prediction.
api::Condition Scheduled(const api::TrainingJobStatus& status) {
  for (const api::Condition& c : status.conditions) {
    if (c.type == "Scheduled") return c;
  }
  return {};
}

// The job the workers of `d`'s gang read, which must be a valid manual job with exactly
// `layout` written in; checked and defaulted as they check it.
api::CheckedJob WorkersJob(const Decision& d, const api::LayoutStatus& layout) {
  const json worker_job = json::parse(d.create->config_map["data"]["job.json"].get<std::string>());
  const json& p = worker_job["spec"]["parallelism"];
  EXPECT_EQ(p["mode"], "manual");
  EXPECT_EQ(p["tensorParallelDegree"], layout.tensor_parallel_degree);
  EXPECT_EQ(p["hybridShardDegree"], layout.hybrid_shard_degree);
  EXPECT_EQ(p["contextParallelDegree"], layout.context_parallel_degree);
  EXPECT_EQ(worker_job["spec"]["training"]["microBatchSize"], layout.micro_batch_size);
  api::CheckedJob resolved = api::CheckTrainingJob(worker_job, "job.json", 0);
  EXPECT_TRUE(resolved.ok()) << resolved.errors.front().ToString();
  EXPECT_EQ(resolved.job.spec.parallelism.tensor_parallel_degree, layout.tensor_parallel_degree);
  EXPECT_EQ(resolved.job.spec.parallelism.context_parallel_degree, layout.context_parallel_degree);
  EXPECT_EQ(resolved.job.spec.parallelism.context_parallel_mode, layout.context_parallel_mode);
  return resolved;
}

json AutoJob(std::optional<int64_t> memory_limit_mib) {
  json object = JobObject();
  object["spec"]["parallelism"] = {{"mode", "auto"}};
  object["spec"]["training"].erase("microBatchSize");
  if (memory_limit_mib) object["spec"]["resources"] = {{"memoryLimitMiB", *memory_limit_mib}};
  return object;
}

TEST(Decide, ModeAutoWritesThePlannedLayoutIntoTheWorkersSpecAndStatus) {
  const json object = AutoJob(512);
  const Decision d = Decide(Observe(object, {}), {});
  ASSERT_TRUE(d.create) << Scheduled(d.status).message;
  ASSERT_TRUE(d.status.layout);
  const api::LayoutStatus& layout = *d.status.layout;
  EXPECT_EQ(layout.device, "CPU");  // the synthetic nodes carry no GPU instance type
  EXPECT_GT(layout.predicted_memory_bytes, 0);
  EXPECT_LE(layout.predicted_memory_bytes, int64_t(0.9 * (512 << 20)));
  EXPECT_GT(layout.predicted_step_seconds, 0);
  WorkersJob(d, layout);
  const std::vector<std::string> reasons = Reasons(d);
  EXPECT_NE(std::find(reasons.begin(), reasons.end(), "LayoutPlanned"), reasons.end());
  // A retry (the status write conflicted) plans the same layout for the same nodes.
  const Decision again = Decide(Observe(object, {}), {});
  ASSERT_TRUE(again.create);
  EXPECT_EQ(again.create->config_map, d.create->config_map);
  EXPECT_EQ(again.status.layout, d.status.layout);
}

// Llama 3.1 8B on sequences of 131072 tokens, 4 p5 nodes: the planner splits each
// sequence over C ranks, and the workers run with that C.
TEST(Decide, ModeAutoSplitsALongSequenceAndTheWorkersRunIt) {
  json object = AutoJob(std::nullopt);
  object["spec"]["nodes"] = 4;
  object["spec"]["model"] = {{"preset", "llama3.1-8b"}, {"seqLen", 131072}};
  object["spec"]["training"]["globalBatchTokens"] = 32 * 131072;
  object["spec"]["template"] = {{"nodeSelector", {{kInstanceTypeLabel, "p5.48xlarge"}}}};
  Observed o = Observe(object, {});
  SetCluster(&o, [] {
    scheduler::SyntheticClusterOptions cluster;
    cluster.nodes = 8;
    cluster.gpu_used_fraction = 0;
    scheduler::ClusterSnapshot snapshot = scheduler::MakeSyntheticCluster(cluster);
    for (auto& node : snapshot.nodes) node.labels[kInstanceTypeLabel] = "p5.48xlarge";
    return scheduler::ClusterView::Of(snapshot);
  }());
  const Decision d = Decide(o, {});
  ASSERT_TRUE(d.create) << Scheduled(d.status).message;
  ASSERT_TRUE(d.status.layout);
  const api::LayoutStatus& layout = *d.status.layout;
  EXPECT_GT(layout.context_parallel_degree, 1);
  EXPECT_EQ(layout.context_parallel_mode, "Ring");
  EXPECT_EQ(api::ToJson(d.status)["layout"]["contextParallelDegree"], layout.context_parallel_degree);
  const api::CheckedJob resolved = WorkersJob(d, layout);
  EXPECT_EQ(api::ParallelLayout::ForSpec(resolved.job.spec).context(), layout.context_parallel_degree);
  bool said = false;
  for (const auto& event : d.events) said |= event.reason == "LayoutPlanned" && event.message.find(" ring, ") != std::string::npos;
  EXPECT_TRUE(said) << "the LayoutPlanned Event names C";
}

TEST(Decide, ModeAutoWithoutAKnownDeviceOrRoomStaysPendingAndSaysWhy) {
  const Decision unknown = Decide(Observe(AutoJob(std::nullopt), {}), {});
  EXPECT_FALSE(unknown.create);
  EXPECT_EQ(unknown.status.phase, "Pending");
  EXPECT_EQ(Scheduled(unknown.status).reason, "NoLayout");
  EXPECT_NE(Scheduled(unknown.status).message.find("spec.resources.memoryLimitMiB"), std::string::npos);
  EXPECT_EQ(Reasons(unknown), (std::vector<std::string>{"NoLayout", "Pending"}));

  const Decision tiny = Decide(Observe(AutoJob(1), {}), {});
  EXPECT_FALSE(tiny.create);
  EXPECT_EQ(Scheduled(tiny.status).reason, "NoLayout");
  EXPECT_NE(Scheduled(tiny.status).message.find("no layout fits; the smallest needs "), std::string::npos)
      << Scheduled(tiny.status).message;
  // The shortfall of a sequence, in bytes, and the context degree that would hold it.
  EXPECT_NE(Scheduled(tiny.status).message.find(" bytes more than the "), std::string::npos)
      << Scheduled(tiny.status).message;
  EXPECT_NE(Scheduled(tiny.status).message.find("contextParallelDegree"), std::string::npos)
      << Scheduled(tiny.status).message;
}

// spec.elastic under mode auto: the shrunk gang's layout is planned again, by the planner,
// for the nodes it still has; the workers get that plan at that size.
TEST(Decide, AnElasticModeAutoJobIsPlannedAgainForTheNodesItKeeps) {
  json object = AutoJob(512);
  object["spec"]["elastic"] = {{"minNodes", 1}};
  int cluster_nodes = 2;
  auto observe = [&](const api::TrainingJobStatus& status) {
    Observed o = Observe(object, status);
    SetCluster(&o, SmallCluster(cluster_nodes));
    return o;
  };
  const Decision created = Decide(observe({}), {});
  ASSERT_TRUE(created.create) << Scheduled(created.status).message;
  ASSERT_TRUE(created.status.layout);
  EXPECT_EQ(created.status.layout->nodes, 2);

  cluster_nodes = 1;
  const Decision shrunk = Decide(observe(Recreating(created.status)), {});
  ASSERT_TRUE(shrunk.create) << Scheduled(shrunk.status).message;
  ASSERT_EQ(shrunk.create->pods.size(), 1u);
  EXPECT_EQ(shrunk.restart_kind, "shrunk");
  ASSERT_TRUE(shrunk.status.layout);
  const api::LayoutStatus& layout = *shrunk.status.layout;
  EXPECT_EQ(layout.nodes, 1);
  EXPECT_EQ(layout.device, "CPU");
  EXPECT_GT(layout.predicted_step_seconds, 0);
  EXPECT_LE(layout.predicted_memory_bytes, int64_t(0.9 * (512 << 20)));
  // The workers read a valid manual job of one node with the planner's layout for it.
  const api::CheckedJob resolved = WorkersJob(shrunk, layout);
  ASSERT_TRUE(resolved.ok());
  EXPECT_EQ(resolved.job.spec.nodes, 1);
  EXPECT_FALSE(resolved.job.spec.elastic.min_nodes) << "the operator shrinks; its workers need no spec.elastic";
  EXPECT_EQ(resolved.job.spec.training.global_batch_tokens, object["spec"]["training"]["globalBatchTokens"].get<int64_t>())
      << "the global batch is kept";
  EXPECT_LE(layout.hybrid_shard_degree * layout.tensor_parallel_degree, 8) << "a layout of one node's 8 ranks";
  const std::vector<std::string> reasons = Reasons(shrunk);
  EXPECT_NE(std::find(reasons.begin(), reasons.end(), "Shrunk"), reasons.end());
}

}  // namespace
}  // namespace meshtrain::controller
