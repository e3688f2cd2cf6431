// Decide() with Kueue on (DecideOptions::kueue), without a server: a job labelled
// kueue.x-k8s.io/queue-name gets its Workload (validated here against Kueue v0.19.2's
// Workload CRD, tests/data/kueue), waits Queued with no pod until the Workload is
// Admitted, runs where the admission lets it (quota only: among the nodes its flavors
// allow; TAS: pod r on the r-th node of the assignment), goes back to Queued when evicted
// (the pods after the status, then the admission cleared), and finishes its Workload; with
// kueue.x-k8s.io/priority-class, the Workload takes that WorkloadPriorityClass's priority.

#include <algorithm>

#include <gtest/gtest.h>

#include "api/manifest.h"
#include "operator/controller/builders.h"
#include "operator/controller/decide.h"
#include "operator/controller/kueue.h"
#include "operator/kube/time.h"
#include "operator/scheduler/synthetic_cluster.h"
#include "tests/support/kube/schema_validation.h"
#include "tests/unit/tiny_job.h"

namespace meshtrain::controller {
namespace {

using nlohmann::json;

const auto kNow = std::chrono::system_clock::from_time_t(2'000'000'000);

json QueuedJob(const std::string& mode = "") {
  json job = test::TinyJob("tiny");
  job["metadata"] = {{"name", "tiny"}, {"namespace", "default"}, {"uid", "job-uid"}, {"generation", 1},
                     {"labels", {{kQueueNameLabel, "training"}}}};
  if (!mode.empty()) job["spec"]["topology"] = {{"mode", mode}};
  return job;
}

DecideOptions Kueue() {
  DecideOptions options;
  options.kueue = true;
  return options;
}

// The job as observed, in a cluster of 64 free nodes, every node Ready, with `workload`
// (null: none), no ResourceFlavor and no WorkloadPriorityClass.
Observed Observe(const json& object, const api::TrainingJobStatus& status, const json& workload,
                 std::vector<json> pods = {}) {
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
  o.workload = workload;
  o.flavors = std::map<std::string, json>{};
  o.priority_class = json();
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

json Condition(const std::string& type, const std::string& status, const std::string& time = "2033-05-18T03:33:20Z",
               const std::string& reason = "Reason") {
  return {{"type", type}, {"status", status}, {"reason", reason}, {"message", type + " " + status},
          {"lastTransitionTime", time}};
}

// The Workload the first pass of the job writes, as Kueue leaves it once it admitted it with
// `assignment` (flavor "p5" for the GPUs).
json Admitted(const json& job, const json& assignment = json()) {
  json workload = *Decide(Observe(job, {}, json()), Kueue()).create_workload;
  workload["metadata"]["resourceVersion"] = "7";
  workload["metadata"]["generation"] = 1;
  json podset = {{"name", kWorkloadPodSet}, {"count", 2}, {"flavors", {{"nvidia.com/gpu", "p5"}}}};
  if (!assignment.is_null()) podset["topologyAssignment"] = assignment;
  workload["status"] = {{"admission", {{"clusterQueue", "training"}, {"podSetAssignments", json::array({podset})}}},
                        {"conditions", json::array({Condition("QuotaReserved", "True"), Condition("Admitted", "True")})}};
  return workload;
}

// A v1beta2 topologyAssignment of one pod on each of `nodes`, in order.
json Assignment(const std::vector<std::string>& nodes) {
  return {{"levels", json::array({kHostnameLabel})},
          {"slices", json::array({{{"domainCount", nodes.size()},
                                   {"valuesPerLevel", json::array({{{"individual", {{"roots", nodes}}}}})},
                                   {"podCounts", {{"universal", 1}}}}})}};
}

json KueueCrdSchema(const std::string& kind) {
  const std::string path = "tests/data/kueue/kueue.x-k8s.io_" + kind + ".yaml";
  const auto documents = api::ReadManifestFile(path);
  for (const json& version : documents.at(0).object["spec"]["versions"])
    if (version["name"] == "v1beta2") return version["schema"]["openAPIV3Schema"];
  throw std::runtime_error(path + ": no v1beta2");
}

// QueuedJob() labelled with the WorkloadPriorityClass `name`.
json PrioritizedJob(const std::string& name) {
  json job = QueuedJob();
  job["metadata"]["labels"][kPriorityClassLabel] = name;
  return job;
}

// A WorkloadPriorityClass as the API server returns it.
json PriorityClass(const std::string& name, const json& value) {
  return {{"apiVersion", "kueue.x-k8s.io/v1beta2"},
          {"kind", "WorkloadPriorityClass"},
          {"metadata", {{"name", name}, {"resourceVersion", "3"}}},
          {"value", value},
          {"description", "ahead of the team's experiments"}};
}

std::string Joined(const std::vector<std::string>& errors) {
  std::string out;
  for (const auto& e : errors) out += "\n  " + e;
  return out;
}

// Gives one node of `o`'s cluster other than `spared` a NoSchedule taint the tiny job does
// not tolerate; returns its name.
std::string TaintANode(Observed* o, const std::vector<std::string>& spared) {
  scheduler::ClusterSnapshot snapshot{o->cluster->topology->nodes()};
  for (scheduler::ClusterNode& node : snapshot.nodes) {
    if (std::find(spared.begin(), spared.end(), node.name) != spared.end()) continue;
    node.taints.push_back({"team", "research", "NoSchedule"});
    o->cluster = scheduler::ClusterView::Of(snapshot);
    return node.name;
  }
  return "";
}

TEST(KueueDecide, AQueuedJobGetsItsWorkloadAndNoPod) {
  // The Workload is read first: a pass without it says so.
  Observed lacking = Observe(QueuedJob(), {}, json());
  lacking.workload.reset();
  EXPECT_TRUE(Decide(lacking, Kueue()).needs.workload);

  const Decision d = Decide(Observe(QueuedJob(), {}, json()), Kueue());
  ASSERT_TRUE(d.create_workload);
  EXPECT_FALSE(d.create);
  EXPECT_TRUE(d.claims.empty());
  EXPECT_EQ(d.status.phase, "Queued");
  ASSERT_NE(ConditionOf(d.status, kQueuedCondition), nullptr);
  EXPECT_EQ(ConditionOf(d.status, kQueuedCondition)->status, "True");
  EXPECT_EQ(ConditionOf(d.status, kQueuedCondition)->reason, "WorkloadCreated");
  EXPECT_EQ(ConditionOf(d.status, kQueueLabelIgnoredCondition), nullptr);
  const json& w = *d.create_workload;
  EXPECT_EQ(w["apiVersion"], "kueue.x-k8s.io/v1beta2");
  EXPECT_EQ(w["kind"], "Workload");
  EXPECT_EQ(w["metadata"]["name"], WorkloadName("tiny", "job-uid"));
  EXPECT_EQ(w["metadata"]["namespace"], "default");
  EXPECT_EQ(w["metadata"]["ownerReferences"][0]["uid"], "job-uid");
  EXPECT_EQ(w["metadata"]["ownerReferences"][0]["kind"], "TrainingJob");
  EXPECT_EQ(w["metadata"]["ownerReferences"][0]["controller"], true);
  EXPECT_EQ(w["spec"]["queueName"], "training");
  ASSERT_EQ(w["spec"]["podSets"].size(), 1u);
  const json& podset = w["spec"]["podSets"][0];
  EXPECT_EQ(podset["name"], kWorkloadPodSet);
  EXPECT_EQ(podset["count"], 2);
  EXPECT_EQ(podset["template"]["spec"]["containers"][0]["resources"]["requests"]["nvidia.com/gpu"], "8");
  // spec.topology's default mode Preferred, at the deepest level above the node.
  EXPECT_EQ(podset["topologyRequest"],
            (json{{"preferred", "topology.k8s.aws/network-node-layer-3"}, {"podIndexLabel", kNodeRankLabel}}));
  // The name is the job's: the same every pass, another for a job recreated under the name.
  EXPECT_EQ(WorkloadName("tiny", "job-uid"), WorkloadName("tiny", "job-uid"));
  EXPECT_NE(WorkloadName("tiny", "job-uid"), WorkloadName("tiny", "other-uid"));
  EXPECT_LE(WorkloadName(std::string(253, 'a'), "u").size(), 253u);
}

// spec.elastic under Kueue: the Workload asks for the whole gang, so minNodes has no
// effect; the job says so in a condition and one Warning Event, and the condition clears
// once the job leaves its queue.
TEST(KueueDecide, AnElasticJobInAQueueIsWarnedThatItRunsWhole) {
  json job = QueuedJob();
  job["spec"]["elastic"] = {{"minNodes", 1}};
  const Decision d = Decide(Observe(job, {}, json()), Kueue());
  const api::Condition* c = ConditionOf(d.status, kElasticUnderKueueCondition);
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->status, "True");
  EXPECT_NE(c->message.find("spec.elastic.minNodes 1 has no effect under Kueue"), std::string::npos) << c->message;
  EXPECT_NE(c->message.find("all 2 nodes"), std::string::npos) << c->message;
  auto warned = [](const Decision& pass) {
    return std::count_if(pass.events.begin(), pass.events.end(),
                         [](const PendingEvent& e) { return e.reason == "ElasticUnderKueue" && e.type == "Warning"; });
  };
  EXPECT_EQ(warned(d), 1);
  ASSERT_TRUE(d.create_workload);
  EXPECT_EQ((*d.create_workload)["spec"]["podSets"][0]["count"], 2);
  EXPECT_FALSE((*d.create_workload)["spec"]["podSets"][0].contains("minCount"));
  // The next pass, with the condition stored: no second Event.
  const Decision again = Decide(Observe(job, d.status, *d.create_workload), Kueue());
  EXPECT_EQ(warned(again), 0);
  ASSERT_NE(ConditionOf(again.status, kElasticUnderKueueCondition), nullptr);
  EXPECT_EQ(ConditionOf(again.status, kElasticUnderKueueCondition)->status, "True");
  // Out of the queue (Kueue off), the operator shrinks the gang itself: False.
  const Decision unqueued = Decide(Observe(job, d.status, json()), DecideOptions{});
  ASSERT_NE(ConditionOf(unqueued.status, kElasticUnderKueueCondition), nullptr);
  EXPECT_EQ(ConditionOf(unqueued.status, kElasticUnderKueueCondition)->status, "False");
  EXPECT_EQ(ConditionOf(unqueued.status, kElasticUnderKueueCondition)->reason, "NotQueued");
  // A job that is not elastic never has the condition.
  EXPECT_EQ(ConditionOf(Decide(Observe(QueuedJob(), {}, json()), Kueue()).status, kElasticUnderKueueCondition),
            nullptr);
}

TEST(KueueDecide, TheWorkloadPassesKueuesCrd) {
  const json schema = KueueCrdSchema("workloads");
  json job = QueuedJob("Required");
  job["spec"]["template"] = {{"nodeSelector", {{"node.kubernetes.io/instance-type", "p5.48xlarge"}}},
                             {"tolerations", json::array({{{"key", "nvidia.com/gpu"}, {"operator", "Exists"},
                                                           {"effect", "NoSchedule"}}})}};
  job["spec"]["resources"] = {{"efa", 32}};
  json workload = *Decide(Observe(job, {}, json()), Kueue()).create_workload;
  const json podset = workload["spec"]["podSets"][0];
  EXPECT_EQ(podset["topologyRequest"]["required"], "topology.k8s.aws/network-node-layer-3");
  EXPECT_EQ(podset["template"]["spec"]["nodeSelector"]["node.kubernetes.io/instance-type"], "p5.48xlarge");
  EXPECT_EQ(podset["template"]["spec"]["tolerations"][0]["key"], "nvidia.com/gpu");
  EXPECT_EQ(podset["template"]["spec"]["containers"][0]["resources"]["limits"]["vpc.amazonaws.com/efa"], "32");
  auto errors = testing::ValidateAgainstSchema(schema, workload, true);
  EXPECT_TRUE(errors.empty()) << workload.dump(2) << Joined(errors);

  // So does the status a job integration writes: admitted by the simulator's shape, cleared
  // after an eviction, and finished.
  json admitted = Admitted(QueuedJob(), Assignment({"node-a", "node-b"}));
  errors = testing::ValidateAgainstSchema(schema, admitted, true);
  EXPECT_TRUE(errors.empty()) << Joined(errors);
  admitted["status"]["conditions"].push_back(Condition("Evicted", "True", "2033-05-18T03:40:00Z", "Preempted"));
  json requeued = WorkloadRequeued(admitted, kNow);
  errors = testing::ValidateAgainstSchema(schema, requeued, true);
  EXPECT_TRUE(errors.empty()) << Joined(errors);
  // A Workload with a mistake fails: the check can fail.
  json bad = workload;
  bad["spec"]["podSets"][0]["topologyRequest"]["requiredLevel"] = "x";
  EXPECT_FALSE(testing::ValidateAgainstSchema(schema, bad, true).empty());
}

TEST(KueueDecide, TheJobWaitsQueuedUntilItsWorkloadIsAdmitted) {
  json workload = Admitted(QueuedJob());
  workload["status"] = {{"conditions", json::array({Condition("QuotaReserved", "False")})}};
  const Decision first = Decide(Observe(QueuedJob(), {}, json()), Kueue());
  const Decision waiting = Decide(Observe(QueuedJob(), first.status, workload), Kueue());
  EXPECT_EQ(waiting.status.phase, "Queued");
  EXPECT_FALSE(waiting.create);
  EXPECT_FALSE(waiting.create_workload);
  EXPECT_FALSE(waiting.workload_status);
  EXPECT_TRUE(waiting.events.empty());
  EXPECT_EQ(ConditionOf(waiting.status, kQueuedCondition)->reason, "WaitingForAdmission");

  // Admitted, quota only, to the flavor p5 whose nodes are those of one layer-1 domain.
  const Observed probe = Observe(QueuedJob(), {}, json());
  std::string domain;
  for (const auto& node : probe.cluster->topology->nodes())
    if (node.taints.empty() && node.labels.count("topology.k8s.aws/network-node-layer-1"))
      domain = node.labels.at("topology.k8s.aws/network-node-layer-1");
  ASSERT_FALSE(domain.empty());
  Observed o = Observe(QueuedJob(), waiting.status, Admitted(QueuedJob()));
  o.flavors.reset();
  EXPECT_TRUE(Decide(o, Kueue()).needs.flavors) << "the flavors are read for a pass that places";
  o.flavors = std::map<std::string, json>{
      {"p5", {{"metadata", {{"name", "p5"}}},
              {"spec", {{"nodeLabels", {{"topology.k8s.aws/network-node-layer-1", domain}}},
                        {"tolerations", json::array({{{"key", "team"}, {"operator", "Equal"}, {"value", "research"},
                                                      {"effect", "NoSchedule"}}})}}}}}};
  const Decision d = Decide(o, Kueue());
  ASSERT_TRUE(d.create);
  EXPECT_EQ(d.status.phase, "Starting");
  EXPECT_EQ(ConditionOf(d.status, kQueuedCondition)->status, "False");
  EXPECT_EQ(ConditionOf(d.status, kQueuedCondition)->reason, "Admitted");
  EXPECT_NE(std::find_if(d.events.begin(), d.events.end(), [](const PendingEvent& e) { return e.reason == "Admitted"; }),
            d.events.end());
  ASSERT_EQ(d.create->pods.size(), 2u);
  for (const json& pod : d.create->pods) {
    const auto* node = o.cluster->Node(PinnedNode(pod));
    ASSERT_NE(node, nullptr);
    EXPECT_EQ(node->labels.at("topology.k8s.aws/network-node-layer-1"), domain) << "the operator chose among the flavor's nodes";
    EXPECT_EQ(pod["spec"]["nodeSelector"]["topology.k8s.aws/network-node-layer-1"], domain);
    EXPECT_EQ(pod["spec"]["tolerations"].back()["key"], "team");
    EXPECT_EQ(pod["metadata"]["annotations"][kWorkloadAnnotation], WorkloadName("tiny", "job-uid"));
    EXPECT_EQ(pod["metadata"]["labels"][kPodSetLabel], kWorkloadPodSet);
    EXPECT_FALSE(pod["metadata"]["labels"].contains(kTasLabel));
  }
  EXPECT_TRUE(d.check_claims);
  EXPECT_FALSE(o.object["spec"].contains("template")) << "the user's spec is not edited";

  // A flavor whose nodes carry a taint the job does not tolerate: the Scheduled condition
  // names the admission and the taint, and nothing starts.
  const std::string tainted = TaintANode(&o, {});
  ASSERT_FALSE(tainted.empty());
  o.flavors = std::map<std::string, json>{
      {"p5", {{"metadata", {{"name", "p5"}}}, {"spec", {{"nodeLabels", {{kHostnameLabel, tainted}}}}}}}};
  const Decision untolerated = Decide(o, Kueue());
  EXPECT_FALSE(untolerated.create);
  EXPECT_TRUE(untolerated.claims.empty());
  EXPECT_EQ(untolerated.status.phase, "Pending");
  ASSERT_NE(ConditionOf(untolerated.status, "Scheduled"), nullptr);
  const std::string why = ConditionOf(untolerated.status, "Scheduled")->message;
  EXPECT_NE(why.find("the admission of Workload " + WorkloadName("tiny", "job-uid")), std::string::npos) << why;
  EXPECT_NE(why.find("untolerated taint"), std::string::npos) << why;

  // A flavor that is not there is named, and nothing starts.
  o.flavors = std::map<std::string, json>{};
  const Decision missing = Decide(o, Kueue());
  EXPECT_FALSE(missing.create);
  EXPECT_EQ(missing.status.phase, "Pending");
  EXPECT_EQ(ConditionOf(missing.status, "Scheduled")->reason, "AdmissionNotFollowed");
}

TEST(KueueDecide, ATasAssignmentPlacesPodRankROnTheRthNode) {
  // Two nodes the operator would not choose in that order: its own placement, reversed.
  const Decision plain = Decide(Observe(test::TinyJob("tiny"), {}, json()), {});
  ASSERT_TRUE(plain.status.placement);
  std::vector<std::string> nodes = {plain.status.placement->nodes[1].name, plain.status.placement->nodes[0].name};
  const Decision first = Decide(Observe(QueuedJob(), {}, json()), Kueue());
  Observed o = Observe(QueuedJob(), first.status, Admitted(QueuedJob(), Assignment(nodes)));
  o.flavors = std::map<std::string, json>{{"p5", {{"metadata", {{"name", "p5"}}}, {"spec", json::object()}}}};
  const Decision d = Decide(o, Kueue());
  ASSERT_TRUE(d.create);
  ASSERT_EQ(d.create->pods.size(), 2u);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(d.status.placement->nodes[r].name, nodes[r]);
    EXPECT_EQ(PinnedNode(d.create->pods[r]), nodes[r]);
    EXPECT_EQ(NodeRankLabel(d.create->pods[r]), r);
    EXPECT_EQ(d.create->pods[r]["metadata"]["labels"][kTasLabel], "true");
  }
  EXPECT_FALSE(d.placed) << "no placement search: Kueue's TAS placed the job";
  EXPECT_FALSE(d.check_claims);

  // A node the cluster does not have is named, and nothing is half-started.
  o.workload = Admitted(QueuedJob(), Assignment({nodes[0], "no-such-node"}));
  const Decision bad = Decide(o, Kueue());
  EXPECT_FALSE(bad.create);
  EXPECT_TRUE(bad.claims.empty());
  EXPECT_EQ(bad.status.phase, "Pending");
  const api::Condition* scheduled = ConditionOf(bad.status, "Scheduled");
  ASSERT_NE(scheduled, nullptr);
  EXPECT_EQ(scheduled->reason, "AdmissionNotFollowed");
  EXPECT_NE(scheduled->message.find("no-such-node"), std::string::npos) << scheduled->message;

  // So is an assigned node whose taint the job does not tolerate.
  const std::string tainted = TaintANode(&o, nodes);
  ASSERT_FALSE(tainted.empty());
  o.workload = Admitted(QueuedJob(), Assignment({nodes[0], tainted}));
  const Decision untolerated = Decide(o, Kueue());
  EXPECT_FALSE(untolerated.create);
  EXPECT_TRUE(untolerated.claims.empty());
  ASSERT_NE(ConditionOf(untolerated.status, "Scheduled"), nullptr);
  EXPECT_EQ(ConditionOf(untolerated.status, "Scheduled")->reason, "AdmissionNotFollowed");
  const std::string why = ConditionOf(untolerated.status, "Scheduled")->message;
  EXPECT_NE(why.find(tainted + " (pod 1) is with the untolerated taint"), std::string::npos) << why;
}

TEST(KueueDecide, TopologyAssignmentsReadInSliceAndDomainOrder) {
  std::string error;
  const json assignment = {
      {"levels", json::array({"topology.k8s.aws/network-node-layer-3", kHostnameLabel})},
      {"slices",
       json::array({{{"domainCount", 2},
                     {"valuesPerLevel", json::array({{{"universal", "nn-3"}},
                                                     {{"individual", {{"prefix", "ip-"}, {"roots", {"a", "b"}}}}}})},
                     {"podCounts", {{"individual", {1, 2}}}}},
                    {{"domainCount", 1},
                     {"valuesPerLevel", json::array({{{"universal", "nn-4"}}, {{"universal", "ip-c"}}})},
                     {"podCounts", {{"universal", 1}}}}})}};
  EXPECT_EQ(TopologyNodes(assignment, &error), (std::vector<std::string>{"ip-a", "ip-b", "ip-b", "ip-c"}));
  EXPECT_TRUE(error.empty());
  json no_host = assignment;
  no_host["levels"] = json::array({"a", "b"});
  EXPECT_TRUE(TopologyNodes(no_host, &error).empty());
  EXPECT_NE(error.find("kubernetes.io/hostname"), std::string::npos);
}

TEST(KueueDecide, AnEvictedJobIsQueuedThenItsPodsGoThenItsAdmissionIsCleared) {
  const Decision plain = Decide(Observe(test::TinyJob("tiny"), {}, json()), {});
  std::vector<std::string> nodes = {plain.status.placement->nodes[0].name, plain.status.placement->nodes[1].name};
  json workload = Admitted(QueuedJob(), Assignment(nodes));
  const Decision first = Decide(Observe(QueuedJob(), {}, json()), Kueue());
  Observed o = Observe(QueuedJob(), first.status, workload);
  o.flavors = std::map<std::string, json>{{"p5", {{"metadata", {{"name", "p5"}}}}}};
  const Decision started = Decide(o, Kueue());
  ASSERT_TRUE(started.create);
  std::vector<json> pods;
  for (const json& pod : started.create->pods) pods.push_back(Running(pod));
  const Decision running = Decide(Observe(QueuedJob(), started.status, workload, pods), Kueue());
  EXPECT_EQ(running.status.phase, "Running");

  // Running: PodsReady=True on the Workload, once.
  ASSERT_TRUE(running.workload_status);
  EXPECT_TRUE(WorkloadConditionTrue(*running.workload_status, "PodsReady"));
  workload = *running.workload_status;
  EXPECT_FALSE(Decide(Observe(QueuedJob(), running.status, workload, pods), Kueue()).workload_status);

  // Evicted (preempted): first the status, with no pod deleted.
  json evicted = workload;
  evicted["status"]["conditions"].push_back(Condition("Evicted", "True", "2033-05-18T03:40:00Z", "Preempted"));
  const Decision queued = Decide(Observe(QueuedJob(), running.status, evicted, pods), Kueue());
  EXPECT_EQ(queued.status.phase, "Queued");
  EXPECT_EQ(ConditionOf(queued.status, kQueuedCondition)->reason, "Evicted");
  EXPECT_EQ(ConditionOf(queued.status, "Running")->status, "False");
  EXPECT_FALSE(queued.status.placement);
  EXPECT_TRUE(queued.delete_pods.empty());
  EXPECT_FALSE(queued.workload_status);
  // Then the pods, as for a suspend.
  const Decision stopping = Decide(Observe(QueuedJob(), queued.status, evicted, pods), Kueue());
  EXPECT_EQ(stopping.delete_pods.size(), 2u);
  EXPECT_FALSE(stopping.workload_status) << "the quota is held until the pods are gone";
  EXPECT_TRUE(stopping.events.empty());
  // Then the admission is cleared: QuotaReserved=False, Admitted=False, Requeued=True.
  const Decision cleared = Decide(Observe(QueuedJob(), stopping.status, evicted), Kueue());
  ASSERT_TRUE(cleared.workload_status);
  const json& w = *cleared.workload_status;
  EXPECT_FALSE(w["status"].contains("admission"));
  EXPECT_FALSE(WorkloadConditionTrue(w, "QuotaReserved"));
  EXPECT_FALSE(WorkloadConditionTrue(w, "Admitted"));
  EXPECT_TRUE(WorkloadConditionTrue(w, "Requeued"));
  EXPECT_FALSE(WorkloadConditionTrue(w, "PodsReady"));
  EXPECT_EQ(w["metadata"]["resourceVersion"], "7") << "a conditional write of the Workload as read";
  // Cleared, it waits, writing nothing more.
  const Decision waiting = Decide(Observe(QueuedJob(), cleared.status, w), Kueue());
  EXPECT_FALSE(waiting.workload_status);
  EXPECT_EQ(waiting.status.phase, "Queued");

  // Admitted again (QuotaReserved after the eviction): it starts again.
  json again = Admitted(QueuedJob(), Assignment(nodes));
  again["status"]["conditions"] = json::array({Condition("Evicted", "True", "2033-05-18T03:40:00Z", "Preempted"),
                                               Condition("QuotaReserved", "True", "2033-05-18T03:50:00Z"),
                                               Condition("Admitted", "True", "2033-05-18T03:50:00Z")});
  Observed readmitted = Observe(QueuedJob(), waiting.status, again);
  readmitted.flavors = o.flavors;
  const Decision restarted = Decide(readmitted, Kueue());
  ASSERT_TRUE(restarted.create);
  EXPECT_EQ(restarted.status.phase, "Starting");
}

// With a checkpoint path, an evicted gang's ranks checkpoint (through their launchers)
// before its pods go, as for a suspend; then the admission is cleared.
TEST(KueueDecide, AnEvictedGangCheckpointsBeforeItsPodsGo) {
  json job = QueuedJob();
  job["spec"]["checkpoint"] = {{"path", "/ckpt/tiny"}, {"interval", 10}};
  json workload = Admitted(job);
  Observed o = Observe(job, Decide(Observe(job, {}, json()), Kueue()).status, workload);
  o.flavors = std::map<std::string, json>{{"p5", {{"metadata", {{"name", "p5"}}}}}};
  const Decision started = Decide(o, Kueue());
  ASSERT_TRUE(started.create);
  std::vector<json> pods;
  for (const json& pod : started.create->pods) pods.push_back(Running(pod));
  const Decision running = Decide(Observe(job, started.status, workload, pods), Kueue());
  ASSERT_EQ(running.status.phase, "Running");
  workload = *running.workload_status;
  json evicted = workload;
  evicted["status"]["conditions"].push_back(Condition("Evicted", "True", "2033-05-18T03:40:00Z", "Preempted"));
  const auto at = [&](const api::TrainingJobStatus& status, const std::string& state) {
    Observed seen = Observe(job, status, evicted, pods);
    seen.progress = Progress(15, 10);
    for (const json& pod : pods) {
      LauncherState s{0, state, {}, {}, "", {}};
      if (state == "suspended") {
        const int64_t first = pod["metadata"]["name"] == "tiny-g0-0" ? 0 : 8;
        for (int64_t r = first; r < first + 8; ++r) s.ranks.push_back({r, 79, "stopped after step 16 (asked by rank 0)"});
      }
      seen.launchers[pod["metadata"]["uid"]] = s;
    }
    return seen;
  };
  const Decision queued = Decide(at(running.status, "running"), Kueue());
  EXPECT_EQ(queued.status.phase, "Queued");
  ASSERT_TRUE(ConditionOf(queued.status, kCheckpointingCondition));
  EXPECT_EQ(ConditionOf(queued.status, kCheckpointingCondition)->status, "True");
  EXPECT_EQ(ConditionOf(queued.status, kCheckpointingCondition)->reason, "Evicted");
  EXPECT_TRUE(queued.delete_pods.empty());
  // Stored: the launchers are asked; the pods and the quota stay.
  const Decision asking = Decide(at(queued.status, "running"), Kueue());
  EXPECT_EQ(asking.launcher_calls.size(), 2u);
  EXPECT_EQ(asking.launcher_calls[0].action, "suspend");
  EXPECT_TRUE(asking.delete_pods.empty());
  EXPECT_FALSE(asking.workload_status);
  // Both suspended: the outcome, then the pods, then the admission.
  const Decision checkpointed = Decide(at(queued.status, "suspended"), Kueue());
  EXPECT_EQ(ConditionOf(checkpointed.status, kCheckpointingCondition)->reason, "Checkpointed");
  ASSERT_EQ(checkpointed.events.size(), 1u);
  EXPECT_EQ(checkpointed.events[0].message, "the ranks stopped after step 16 (asked by rank 0); deleting the pods");
  EXPECT_TRUE(checkpointed.delete_pods.empty());
  const Decision stopping = Decide(at(checkpointed.status, "suspended"), Kueue());
  EXPECT_EQ(stopping.delete_pods.size(), 2u);
  EXPECT_FALSE(stopping.workload_status);
  const Decision cleared = Decide(Observe(job, stopping.status, evicted), Kueue());
  ASSERT_TRUE(cleared.workload_status);
  EXPECT_TRUE(WorkloadConditionTrue(*cleared.workload_status, "Requeued"));
}

// Under a TAS assignment the operator never places a pod itself: a lost node's pod is not
// moved to a node it picks; the gang is recreated on the assignment, waits for Kueue to
// assign another node (status.unhealthyNodes, then a new topologyAssignment), and follows
// that assignment.
TEST(KueueDecide, ALostNodeUnderATasAssignmentWaitsForKueueAndFollowsItsReassignment) {
  const Decision plain = Decide(Observe(test::TinyJob("tiny"), {}, json()), {});
  std::vector<std::string> nodes = {plain.status.placement->nodes[0].name, plain.status.placement->nodes[1].name};
  const json workload = Admitted(QueuedJob(), Assignment(nodes));
  const Decision first = Decide(Observe(QueuedJob(), {}, json()), Kueue());
  Observed o = Observe(QueuedJob(), first.status, workload);
  o.flavors = std::map<std::string, json>{{"p5", {{"metadata", {{"name", "p5"}}}}}};
  const Decision started = Decide(o, Kueue());
  ASSERT_TRUE(started.create);
  std::vector<json> pods;
  for (const json& pod : started.create->pods) pods.push_back(Running(pod));
  Observed lost = Observe(QueuedJob(), started.status, workload, pods);
  lost.nodes[nodes[1]] = NodeState::kNotReady;
  for (const json& pod : pods) lost.launchers[pod["metadata"]["uid"]] = LauncherState{0, "running", {}, {}, ""};
  const Decision d = Decide(lost, Kueue());
  EXPECT_EQ(d.status.phase, "Restarting");
  EXPECT_EQ(d.restart_kind, "recreated") << "not replaced on a node of the operator's choosing";
  EXPECT_TRUE(d.claims.empty());
  EXPECT_FALSE(d.create);

  // Passes of the job against `w`, its pods as the cluster keeps them: deleted ones go,
  // created ones run, but a pod bound to the lost node stays Pending there.
  std::vector<json> gang;
  api::TrainingJobStatus status = d.status;
  auto passes = [&](const json& w, int count) {
    for (int pass = 0; pass < count; ++pass) {
      Observed next = Observe(QueuedJob(), status, w, gang);
      next.nodes[nodes[1]] = NodeState::kNotReady;
      next.flavors = std::map<std::string, json>{{"p5", {{"metadata", {{"name", "p5"}}}}}};
      for (const json& pod : gang) next.launchers[pod["metadata"]["uid"]] = LauncherState{0, "running", {}, {}, ""};
      const Decision step = Decide(next, Kueue());
      EXPECT_FALSE(step.placed) << "no placement search: Kueue places the job";
      status = step.status;
      for (const json& gone : step.delete_pods)
        std::erase_if(gang, [&](const json& pod) { return pod["metadata"]["name"] == gone["metadata"]["name"]; });
      if (!step.create) continue;
      for (const json& pod : step.create->pods) {
        json made = Running(pod);
        if (PinnedNode(pod) == nodes[1]) {  // unschedulable there
          made["spec"].erase("nodeName");
          made["status"] = {{"phase", "Pending"}};
        }
        gang.push_back(made);
      }
    }
  };
  // The old gang goes, and the new one follows the assignment as it stands: pod 1 waits on
  // the lost node rather than on one the operator picks.
  passes(workload, 4);
  ASSERT_EQ(gang.size(), 2u) << status.phase;
  for (size_t r = 0; r < gang.size(); ++r) EXPECT_EQ(PinnedNode(gang[r]), nodes[r]);
  // Kueue marks the node unhealthy and assigns another in its place (its TAS node-failure
  // replacement): the gang follows, pod r on the new assignment's r-th node.
  std::string spare;
  for (const auto& node : o.cluster->topology->nodes())
    if (node.name != nodes[0] && node.name != nodes[1]) spare = node.name;
  ASSERT_FALSE(spare.empty());
  json reassigned = Admitted(QueuedJob(), Assignment({nodes[0], spare}));
  reassigned["status"]["unhealthyNodes"] = json::array({{{"name", nodes[1]}}});
  passes(reassigned, 6);
  ASSERT_EQ(gang.size(), 2u) << status.phase;
  std::vector<std::string> placed;
  for (const json& pod : gang) placed.push_back(PinnedNode(pod));
  EXPECT_EQ(placed, (std::vector<std::string>{nodes[0], spare})) << status.phase;
}

// Kueue's PodSets are immutable: a Workload for another queue or size is replaced, once the
// job (Queued first) has no pod.
TEST(KueueDecide, AWorkloadThatNoLongerMatchesTheJobIsReplaced) {
  const json workload = Admitted(QueuedJob());
  json bigger = QueuedJob();
  bigger["spec"]["nodes"] = 4;
  const Decision first = Decide(Observe(QueuedJob(), {}, json()), Kueue());
  const Decision d = Decide(Observe(bigger, first.status, workload), Kueue());
  EXPECT_EQ(d.status.phase, "Queued");
  EXPECT_EQ(ConditionOf(d.status, kQueuedCondition)->reason, "WorkloadOutdated");
  EXPECT_NE(ConditionOf(d.status, kQueuedCondition)->message.find("counts 2 pods, the job has spec.nodes 4"),
            std::string::npos);
  EXPECT_EQ(d.delete_workload, WorkloadName("tiny", "job-uid"));
  EXPECT_FALSE(d.create);
  // With its pods still there, they go first.
  const Decision plain = Decide(Observe(test::TinyJob("tiny"), {}, json()), {});
  const Decision stopping = Decide(Observe(bigger, first.status, workload, {Running(plain.create->pods[0])}), Kueue());
  EXPECT_EQ(stopping.delete_pods.size(), 1u);
  EXPECT_TRUE(stopping.delete_workload.empty());
  // Another queue too; the same job and queue keep their Workload.
  json moved = QueuedJob();
  moved["metadata"]["labels"][kQueueNameLabel] = "other";
  EXPECT_FALSE(Decide(Observe(moved, first.status, workload), Kueue()).delete_workload.empty());
  EXPECT_TRUE(Decide(Observe(QueuedJob(), first.status, workload), Kueue()).delete_workload.empty());
}

// kueue.x-k8s.io/priority-class, as on Kueue's job integrations: the Workload names the
// WorkloadPriorityClass and takes its value, read only for the pass that writes it.
TEST(KueueDecide, ThePriorityClassLabelGivesTheWorkloadItsPriority) {
  const json job = PrioritizedJob("research-high");
  Observed lacking = Observe(job, {}, json());
  lacking.priority_class.reset();
  const Decision asks = Decide(lacking, Kueue());
  EXPECT_TRUE(asks.needs.priority_class);
  EXPECT_FALSE(asks.create_workload);

  Observed o = Observe(job, {}, json());
  o.priority_class = PriorityClass("research-high", 1000);
  const Decision d = Decide(o, Kueue());
  EXPECT_FALSE(d.needs.any());
  ASSERT_TRUE(d.create_workload);
  const json& spec = (*d.create_workload)["spec"];
  EXPECT_EQ(spec["priorityClassRef"],
            (json{{"group", "kueue.x-k8s.io"}, {"kind", "WorkloadPriorityClass"}, {"name", "research-high"}}));
  EXPECT_EQ(spec["priority"], 1000);
  EXPECT_EQ(d.status.phase, "Queued");
  EXPECT_EQ(ConditionOf(d.status, kQueuedCondition)->reason, "WorkloadCreated");
  // Both pass Kueue's CRDs.
  json written = *d.create_workload, priority_class = *o.priority_class;
  auto errors = testing::ValidateAgainstSchema(KueueCrdSchema("workloads"), written, true);
  EXPECT_TRUE(errors.empty()) << written.dump(2) << Joined(errors);
  errors = testing::ValidateAgainstSchema(KueueCrdSchema("workloadpriorityclasses"), priority_class, true);
  EXPECT_TRUE(errors.empty()) << Joined(errors);
  // A negative value, within int32, is a priority too.
  o.priority_class = PriorityClass("research-high", -5);
  EXPECT_EQ((*Decide(o, Kueue()).create_workload)["spec"]["priority"], -5);

  // Without the label: neither field, and the class is not read.
  Observed plain = Observe(QueuedJob(), {}, json());
  plain.priority_class.reset();
  const Decision unprioritized = Decide(plain, Kueue());
  EXPECT_FALSE(unprioritized.needs.priority_class);
  ASSERT_TRUE(unprioritized.create_workload);
  EXPECT_FALSE((*unprioritized.create_workload)["spec"].contains("priorityClassRef"));
  EXPECT_FALSE((*unprioritized.create_workload)["spec"].contains("priority"));
  // Once the Workload exists, neither is it.
  json workload = *d.create_workload;
  workload["status"] = {{"conditions", json::array({Condition("QuotaReserved", "False")})}};
  Observed waiting = Observe(job, d.status, workload);
  waiting.priority_class.reset();
  const Decision later = Decide(waiting, Kueue());
  EXPECT_FALSE(later.needs.priority_class);
  EXPECT_EQ(ConditionOf(later.status, kQueuedCondition)->reason, "WaitingForAdmission");
  EXPECT_TRUE(later.delete_workload.empty());
}

// As Kueue's job framework, no Workload without its priority: while the class the label
// names is missing (or has no int32 value), the job waits Queued, says why, and looks again.
TEST(KueueDecide, AMissingPriorityClassHoldsTheWorkloadBack) {
  const json job = PrioritizedJob("research-high");
  const Decision d = Decide(Observe(job, {}, json()), Kueue());
  EXPECT_FALSE(d.create_workload);
  EXPECT_FALSE(d.create);
  EXPECT_EQ(d.status.phase, "Queued");
  const api::Condition* queued = ConditionOf(d.status, kQueuedCondition);
  ASSERT_NE(queued, nullptr);
  EXPECT_EQ(queued->status, "True");
  EXPECT_EQ(queued->reason, "PriorityClassNotFound");
  EXPECT_EQ(queued->message,
            "the label kueue.x-k8s.io/priority-class names WorkloadPriorityClass research-high, which does not "
            "exist; the job's Workload is created once it does");
  const PendingEvent warning{"Warning", "PriorityClassNotFound", queued->message};
  EXPECT_EQ(std::count(d.events.begin(), d.events.end(), warning), 1);
  EXPECT_GT(d.requeue_after.count(), 0);
  EXPECT_LE(d.requeue_after, std::chrono::seconds(10));
  // The next pass, with that stored: still no Workload, no second Event, a look in 10 s.
  const Decision again = Decide(Observe(job, d.status, json()), Kueue());
  EXPECT_FALSE(again.create_workload);
  EXPECT_EQ(std::count(again.events.begin(), again.events.end(), warning), 0);
  EXPECT_EQ(again.requeue_after, std::chrono::seconds(10));
  EXPECT_EQ(ConditionOf(again.status, kQueuedCondition)->reason, "PriorityClassNotFound");
  // A class with no int32 value holds it back too.
  Observed bad = Observe(job, d.status, json());
  bad.priority_class = PriorityClass("research-high", int64_t{1} << 40);
  const Decision invalid = Decide(bad, Kueue());
  EXPECT_FALSE(invalid.create_workload);
  EXPECT_EQ(ConditionOf(invalid.status, kQueuedCondition)->reason, "PriorityClassInvalid");
  EXPECT_NE(ConditionOf(invalid.status, kQueuedCondition)->message.find("research-high, whose value is not an int32"),
            std::string::npos)
      << ConditionOf(invalid.status, kQueuedCondition)->message;
  // Once the class exists, the Workload is written with its priority.
  Observed found = Observe(job, d.status, json());
  found.priority_class = PriorityClass("research-high", 1000);
  const Decision created = Decide(found, Kueue());
  ASSERT_TRUE(created.create_workload);
  EXPECT_EQ((*created.create_workload)["spec"]["priority"], 1000);
  EXPECT_EQ(ConditionOf(created.status, kQueuedCondition)->reason, "WorkloadCreated");
}

// The operator writes no Workload spec after creating it: a Workload whose priority class
// is not the one the job's label names (now) is replaced, as for another queue.
TEST(KueueDecide, AChangedPriorityClassLabelReplacesTheWorkload) {
  json workload = Admitted(QueuedJob());
  workload["spec"]["priorityClassRef"] = {{"group", "kueue.x-k8s.io"}, {"kind", "WorkloadPriorityClass"},
                                          {"name", "research-high"}};
  workload["spec"]["priority"] = 1000;
  const Decision first = Decide(Observe(QueuedJob(), {}, json()), Kueue());
  // The same class: kept, whatever the class's value is now.
  const Observed same = Observe(PrioritizedJob("research-high"), first.status, workload);
  EXPECT_TRUE(Decide(same, Kueue()).delete_workload.empty());
  EXPECT_EQ(WorkloadMismatch(workload, same.checked.job, "training"), "");
  // Another class, or none.
  const Decision moved = Decide(Observe(PrioritizedJob("research-low"), first.status, workload), Kueue());
  EXPECT_EQ(moved.delete_workload, WorkloadName("tiny", "job-uid"));
  EXPECT_EQ(ConditionOf(moved.status, kQueuedCondition)->reason, "WorkloadOutdated");
  EXPECT_NE(ConditionOf(moved.status, kQueuedCondition)->message.find(
                "its priority class is WorkloadPriorityClass research-high, the job's label "
                "kueue.x-k8s.io/priority-class names research-low"),
            std::string::npos)
      << ConditionOf(moved.status, kQueuedCondition)->message;
  const Decision dropped = Decide(Observe(QueuedJob(), first.status, workload), Kueue());
  EXPECT_EQ(dropped.delete_workload, WorkloadName("tiny", "job-uid"));
  EXPECT_NE(ConditionOf(dropped.status, kQueuedCondition)->message.find("names none"), std::string::npos);
  // A label on a job whose Workload has no class.
  const Decision added = Decide(Observe(PrioritizedJob("research-high"), first.status, Admitted(QueuedJob())), Kueue());
  EXPECT_EQ(added.delete_workload, WorkloadName("tiny", "job-uid"));
  EXPECT_NE(ConditionOf(added.status, kQueuedCondition)->message.find("its priority class is none"), std::string::npos);
}

TEST(KueueDecide, AFinishedJobFinishesItsWorkload) {
  api::TrainingJobStatus done;
  done.phase = "Succeeded";
  done.completion_time = kube::Rfc3339(kNow);
  done.conditions.push_back({"Succeeded", "True", "AllPodsSucceeded", "every rank finished", kube::Rfc3339(kNow), 1});
  const json workload = Admitted(QueuedJob());
  const Decision d = Decide(Observe(QueuedJob(), done, workload), Kueue());
  ASSERT_TRUE(d.workload_status);
  EXPECT_TRUE(WorkloadConditionTrue(*d.workload_status, "Finished"));
  const json finished = (*d.workload_status)["status"]["conditions"].back();
  EXPECT_EQ(finished["reason"], "Succeeded");
  EXPECT_EQ(finished["message"], "the TrainingJob succeeded: every rank finished");
  // Once Finished, nothing more is written; without Kueue, nothing is read.
  EXPECT_FALSE(Decide(Observe(QueuedJob(), done, *d.workload_status), Kueue()).workload_status);
  Observed off = Observe(QueuedJob(), done, json());
  off.workload.reset();
  const Decision without = Decide(off, {});
  EXPECT_FALSE(without.needs.workload);
  EXPECT_FALSE(without.workload_status);
  // A failed job finishes its Workload too, with the reason Failed and its own words.
  api::TrainingJobStatus failed;
  failed.phase = "Failed";
  failed.completion_time = kube::Rfc3339(kNow);
  failed.conditions.push_back(
      {"Failed", "True", "BackoffLimitExceeded", "the gang failed 4 time(s)", kube::Rfc3339(kNow), 1});
  const Decision f = Decide(Observe(QueuedJob(), failed, workload), Kueue());
  ASSERT_TRUE(f.workload_status);
  EXPECT_TRUE(WorkloadConditionTrue(*f.workload_status, "Finished"));
  const json finished_failed = (*f.workload_status)["status"]["conditions"].back();
  EXPECT_EQ(finished_failed["reason"], "Failed");
  EXPECT_EQ(finished_failed["message"], "the TrainingJob failed: the gang failed 4 time(s)");
}

// An admission check's podSetUpdates for the job's PodSet reach every pod: its labels,
// annotations, node selector and tolerations (another PodSet's do not); the job's own spec
// is not edited.
TEST(KueueDecide, PodSetUpdatesReachThePods) {
  const Decision first = Decide(Observe(QueuedJob(), {}, json()), Kueue());
  json workload = Admitted(QueuedJob());
  const Observed probe = Observe(QueuedJob(), {}, json());
  std::string domain;
  for (const auto& node : probe.cluster->topology->nodes())
    if (node.labels.count("topology.k8s.aws/network-node-layer-1"))
      domain = node.labels.at("topology.k8s.aws/network-node-layer-1");
  ASSERT_FALSE(domain.empty());
  const json toleration = {{"key", "reserved"}, {"operator", "Exists"}, {"effect", "NoSchedule"}};
  workload["status"]["admissionChecks"] = json::array(
      {{{"name", "provisioning"},
        {"state", "Ready"},
        {"podSetUpdates",
         json::array({{{"name", kWorkloadPodSet},
                       {"labels", {{"team", "vision"}}},
                       {"annotations", {{"cost-center", "42"}}},
                       {"nodeSelector", {{"topology.k8s.aws/network-node-layer-1", domain}}},
                       {"tolerations", json::array({toleration})}},
                      {{"name", "another"}, {"labels", {{"stranger", "yes"}}}}})}}});
  Observed o = Observe(QueuedJob(), first.status, workload);
  o.flavors = std::map<std::string, json>{{"p5", {{"metadata", {{"name", "p5"}}}, {"spec", json::object()}}}};
  const Decision d = Decide(o, Kueue());
  ASSERT_TRUE(d.create) << d.status.phase;
  ASSERT_EQ(d.create->pods.size(), 2u);
  for (const json& pod : d.create->pods) {
    EXPECT_EQ(pod["metadata"]["labels"]["team"], "vision") << pod.dump();
    EXPECT_FALSE(pod["metadata"]["labels"].contains("stranger"));
    EXPECT_EQ(pod["metadata"]["annotations"]["cost-center"], "42");
    EXPECT_EQ(pod["spec"]["nodeSelector"]["topology.k8s.aws/network-node-layer-1"], domain);
    const json& tolerations = pod["spec"]["tolerations"];
    EXPECT_NE(std::find(tolerations.begin(), tolerations.end(), toleration), tolerations.end()) << tolerations.dump();
    const auto* node = o.cluster->Node(PinnedNode(pod));
    ASSERT_NE(node, nullptr);
    EXPECT_EQ(node->labels.at("topology.k8s.aws/network-node-layer-1"), domain);
  }
  EXPECT_FALSE(o.object["spec"].contains("template")) << "the user's spec is not edited";
}

}  // namespace
}  // namespace meshtrain::controller
