// The operator never acts on a stale view: the ClusterState's ledger of its own pods in
// flight (creates and deletes the pod cache has not shown, and the GPUs those creates
// claim, against double booking),
// and the whole controller against the in-process test API server while its pod or node
// watches lag by seconds. No healthy gang may be restarted, and none is deleted twice.

#include <algorithm>
#include <set>
#include <thread>

#include <gtest/gtest.h>

#include "api/manifest.h"
#include "operator/controller/builders.h"
#include "operator/controller/cluster_state.h"
#include "operator/controller/controller.h"
#include "operator/kube/objects.h"
#include "operator/scheduler/placement.h"
#include "operator/scheduler/synthetic_cluster.h"
#include "tests/support/kube/api_server.h"
#include "tests/support/kube/kubelet_simulator.h"
#include "tests/unit/tiny_job.h"

namespace meshtrain::controller {
namespace {

using nlohmann::json;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
namespace res = kube::resources;

// A node of the synthetic cluster as the kubelet registers it.
json NodeJson(const std::string& name, int64_t gpus = 8) {
  scheduler::ClusterNode node;
  node.name = name;
  node.gpus = gpus;
  node.efa = 32;
  node.labels = {{"topology.k8s.aws/network-node-layer-3", "rack-1"}};
  return testing::NodeObject(node);
}

// A pod of job `job` pinned to `node`, asking for `gpus`.
json PodJson(const std::string& name, const std::string& job, const std::string& node, int64_t gpus,
             const std::string& phase = "Pending") {
  return {{"metadata", {{"name", name}, {"namespace", "default"}, {"labels", {{kJobNameLabel, job}}}}},
          {"spec",
           {{"nodeName", node},
            {"containers", json::array({{{"name", "worker"},
                                         {"resources", {{"limits", {{"nvidia.com/gpu", std::to_string(gpus)}}}}}}})}}},
          {"status", {{"phase", phase}}}};
}

TEST(ClusterState, CountsWhatTheOperatorsUnfinishedPodsHoldOnTheirNodes) {
  ClusterState state;
  const json node = NodeJson("n1");
  state.NodeChanged(nullptr, &node);
  EXPECT_EQ(state.Node("n1"), NodeState::kReady);
  EXPECT_EQ(state.Node("n2"), NodeState::kGone);
  const json pending = PodJson("a-0", "a", "n1", 4), running = PodJson("a-0", "a", "n1", 4, "Running"),
             done = PodJson("a-0", "a", "n1", 4, "Succeeded");
  state.PodChanged(nullptr, &pending);
  EXPECT_EQ(state.Used("n1"), std::make_pair(int64_t{4}, int64_t{0}));
  state.PodChanged(&pending, &running);
  EXPECT_EQ(state.Used("n1").first, 4) << "an update replaces what the pod held";
  state.PodChanged(&running, &done);
  EXPECT_EQ(state.Used("n1").first, 0) << "a finished pod holds nothing";
  state.PodChanged(&done, &running);
  state.PodChanged(&running, nullptr);
  EXPECT_EQ(state.Used("n1").first, 0) << "nor does a deleted one";

  // Placement reads the counters live, through the view it was handed.
  const scheduler::ClusterView view = state.View();
  scheduler::PlacementRequest request;
  request.gpus_per_node = 8;
  EXPECT_TRUE(scheduler::Place(request, view).ok());
  state.PodChanged(nullptr, &pending);
  EXPECT_FALSE(scheduler::Place(request, view).ok()) << scheduler::Place(request, view).reason;
}

TEST(ClusterState, TwoGangsPlacedFromTheSameCountersNeverShareAGpu) {
  ClusterState state;
  for (const char* name : {"n1", "n2"}) {
    const json node = NodeJson(name);
    state.NodeChanged(nullptr, &node);
  }
  const auto t0 = Clock::now();
  // Both placements read the cluster before either reserved: both chose n1 and n2.
  const std::vector<PodClaim> a = {{"default/a-0", "n1", 8, 0}, {"default/a-1", "n2", 8, 0}};
  const std::vector<PodClaim> b = {{"default/b-0", "n1", 8, 0}, {"default/b-1", "n2", 8, 0}};
  EXPECT_TRUE(state.Reserve("default/a", a, /*check=*/true, t0));
  EXPECT_FALSE(state.Reserve("default/b", b, /*check=*/true, t0)) << "b is placed again instead";
  EXPECT_EQ(state.Used("n1").first, 8);
  EXPECT_EQ(state.Reservations(), 2u);
  // a's pods reach the cache: they take over their claims, counted once.
  const json a0 = PodJson("a-0", "a", "n1", 8);
  state.PodChanged(nullptr, &a0);
  EXPECT_EQ(state.Used("n1").first, 8);
  EXPECT_EQ(state.Reservations(), 1u);
  EXPECT_TRUE(state.Reserve("default/a", {{"default/a-0", "n1", 8, 0}}, true, t0)) << "a pod already counted takes nothing more";
  EXPECT_EQ(state.Used("n1").first, 8);
  // a-1's create failed: its GPUs are free again, and b can have n2.
  state.Release("default/a", "default/a-1");
  EXPECT_EQ(state.Used("n2").first, 0);
  EXPECT_TRUE(state.Reserve("default/b", {{"default/b-1", "n2", 8, 0}}, true, t0));
  state.Forget("default/b");
  EXPECT_EQ(state.Used("n2").first, 0);
  EXPECT_TRUE(state.Reserve("default/c", {{"default/c-0", "n2", 4, 0}}, false, t0));
  state.Expire(t0 + 61s);
  EXPECT_EQ(state.Reservations(), 0u) << "a pod that never reached the cache gives its GPUs back in the end";
  EXPECT_EQ(state.Used("n2").first, 0);
  EXPECT_FALSE(state.Reserve("default/d", {{"default/d-0", "n9", 1, 0}}, true, t0)) << "no such node";
}

// Creates and deletes in flight: one record per pod, ended by the pod's event, by a
// failure, or past the timeout, with what the create claimed.
TEST(ClusterState, ACreateSentIsAwaitedUntilTheCacheShowsThePod) {
  ClusterState state(60s);
  const json node = NodeJson("n1");
  state.NodeChanged(nullptr, &node);
  const auto t0 = Clock::now();
  ASSERT_TRUE(state.Reserve("default/tiny", {{"default/tiny-g0-0", "n1", 4, 0}, {"default/tiny-g0-1", "n1", 4, 0}},
                            true, t0));
  EXPECT_TRUE(state.InFlight("default/tiny", t0).empty()) << "claimed, but no create is sent yet";
  state.Creating("default/tiny", {"default/tiny-g0-0", "default/tiny-g0-1"}, t0);
  EXPECT_EQ(state.InFlight("default/tiny", t0).creations,
            (std::set<std::string>{"default/tiny-g0-0", "default/tiny-g0-1"}));
  const json shown = PodJson("tiny-g0-0", "tiny", "n1", 4);
  state.PodChanged(nullptr, &shown);
  EXPECT_EQ(state.InFlight("default/tiny", t0 + 5s).creations, (std::set<std::string>{"default/tiny-g0-1"}));
  EXPECT_EQ(state.Used("n1").first, 8) << "the pod shown counts from the cache, the other from its claim";
  state.Release("default/tiny", "default/tiny-g0-1");  // its create failed: it will never show
  EXPECT_TRUE(state.InFlight("default/tiny", t0 + 5s).empty());
  EXPECT_EQ(state.Used("n1").first, 4);
}

TEST(ClusterState, ADeleteSentKeepsItsPodTerminatingUntilTheCacheDropsIt) {
  ClusterState state(60s);
  const auto t0 = Clock::now();
  state.Deleting("default/tiny", "uid-0", t0);
  state.Deleting("default/tiny", "uid-1", t0);
  EXPECT_EQ(state.InFlight("default/tiny", t0 + 10s).deletions, (std::set<std::string>{"uid-0", "uid-1"}));
  json gone = PodJson("tiny-g0-1", "tiny", "n1", 0);
  gone["metadata"]["uid"] = "uid-1";
  state.PodChanged(&gone, nullptr);
  state.DeleteFailed("default/tiny", "uid-0");
  EXPECT_TRUE(state.InFlight("default/tiny", t0 + 10s).empty());
}

TEST(ClusterState, APodTheCacheNeverShowsIsWaitedForOnlyUntilTheTimeout) {
  ClusterState state(30s);
  const json node = NodeJson("n1");
  state.NodeChanged(nullptr, &node);
  const auto t0 = Clock::now();
  ASSERT_TRUE(state.Reserve("default/tiny", {{"default/tiny-g0-0", "n1", 8, 0}}, true, t0));
  state.Creating("default/tiny", {"default/tiny-g0-0"}, t0);
  state.Deleting("default/tiny", "uid-9", t0 + 20s);
  const ClusterState::InFlightPods late = state.InFlight("default/tiny", t0 + 31s);
  EXPECT_TRUE(late.creations.empty()) << "past the timeout the reconciler asks the API server instead";
  EXPECT_EQ(state.Used("n1").first, 0) << "and the claim ends with the record: one expiry";
  EXPECT_EQ(late.deletions, (std::set<std::string>{"uid-9"}));
  state.Expire(t0 + 51s);
  EXPECT_TRUE(state.InFlight("default/tiny", t0 + 51s).empty());
  state.Deleting("default/tiny", "uid-10", t0);
  state.Forget("default/tiny");
  EXPECT_TRUE(state.InFlight("default/tiny", t0).empty());
}

TEST(ClusterState, AHeartbeatKeepsTheTopologyAndALabelChangeRebuildsIt) {
  ClusterState state;
  json node = NodeJson("n1");
  state.NodeChanged(nullptr, &node);
  const scheduler::ClusterView before = state.View();
  json beat = node;
  beat["status"]["conditions"][0]["lastHeartbeatTime"] = "2030-01-01T00:00:00Z";
  state.NodeChanged(&node, &beat);
  EXPECT_EQ(state.View().topology, before.topology);
  json relabelled = beat;
  relabelled["metadata"]["labels"]["topology.k8s.aws/network-node-layer-3"] = "rack-2";
  state.NodeChanged(&beat, &relabelled);
  const scheduler::ClusterView after = state.View();
  EXPECT_NE(after.topology, before.topology);
  EXPECT_EQ(after.Node("n1")->labels.at("topology.k8s.aws/network-node-layer-3"), "rack-2");
  json not_ready = relabelled;
  not_ready["status"]["conditions"][0]["status"] = "False";
  state.NodeChanged(&relabelled, &not_ready);
  EXPECT_EQ(state.Node("n1"), NodeState::kNotReady);
  state.NodeChanged(&not_ready, nullptr);
  EXPECT_EQ(state.Node("n1"), NodeState::kGone);
  EXPECT_EQ(state.View().topology->size(), 0u);
}

// The whole controller against the in-process API server, whose pod or node watch lags.
class LaggingCache : public ::testing::Test {
 protected:
  void SetUp() override {
    testing::ApiServer::Options options;
    options.bookmark_interval_ms = 100;
    server_ = std::make_unique<testing::ApiServer>(options);
    server_->Start(0);
    server_->Create("apiextensions.k8s.io/customresourcedefinitions", "",
                    api::ReadManifestFile("crds/trainingjobs.meshtrain.dev.yaml").at(0).object);
    scheduler::SyntheticClusterOptions cluster;
    cluster.nodes = 8;
    cluster.gpu_used_fraction = 0;
    for (const scheduler::ClusterNode& node : scheduler::MakeSyntheticCluster(cluster).nodes)
      server_->Create("/nodes", "", testing::NodeObject(node));
    kube::KubeConfig config;
    config.server = server_->Url();
    kube::ClientOptions client_options;
    client_options.initial_backoff = 10ms;
    operator_client_ = std::make_unique<kube::Client>(config, client_options);
    client_options.user_agent = "reconciler-test";  // not counted as the operator's requests
    client_ = std::make_unique<kube::Client>(config, client_options);
    ControllerOptions controller_options;
    controller_options.workers = 2;
    controller_ = std::make_unique<Controller>(*operator_client_, &metrics_, controller_options);
    thread_ = std::thread([this] { controller_->Run(stop_.get_token()); });
    ASSERT_TRUE(Eventually([&] { return controller_->Ready(); }, 10s));
  }
  void TearDown() override {
    stop_.request_stop();
    if (thread_.joinable()) thread_.join();
    controller_.reset();
    server_->Stop();
  }

  static bool Eventually(const std::function<bool()>& done, Clock::duration limit) {
    for (const auto deadline = Clock::now() + limit; Clock::now() < deadline; std::this_thread::sleep_for(20ms))
      if (done()) return true;
    return done();
  }
  // The watches of `resource` ("pods", "nodes") send each event `ms` after it happened.
  void DelayWatches(const std::string& resource, int ms) {
    testing::Faults faults;
    faults.watch_delay_ms = ms;
    faults.watch_delay_resource = resource;
    server_->SetFaults(faults);
  }
  void CreateJob(const std::string& name) { client_->Create(res::TrainingJobs(), "default", test::TinyJob(name)); }
  // The job's pods as the API server has them now.
  std::vector<json> Pods(const std::string& job) {
    return client_->List(res::Pods(), "default", {std::string(kJobNameLabel) + "=" + job, "", ""})["items"];
  }
  json Status(const std::string& job) { return client_->Get(res::TrainingJobs(), "default", job).value("status", json::object()); }
  // As a kubelet reports it: Running and Ready, or Failed with exit code 1.
  void SetPhase(const json& pod, const std::string& phase) {
    server_->Mutate("/pods", "default", pod["metadata"]["name"], [&](json& stored) {
      stored["status"]["phase"] = phase;
      stored["status"]["conditions"] = json::array({{{"type", "Ready"}, {"status", phase == "Running" ? "True" : "False"}}});
      if (phase == "Failed")
        stored["status"]["containerStatuses"] = json::array({{{"state", {{"terminated", {{"exitCode", 1}}}}}}});
    });
  }
  int64_t OperatorRequests(const std::string& verb) {
    return server_->Stats()["requests"].value("meshtrain-operator " + verb, int64_t{0});
  }
  double Counter(const std::string& family, const std::string& label_value) {
    for (const auto& f : metrics_.registry()->Collect()) {
      if (f.name != family) continue;
      for (const auto& m : f.metric)
        for (const auto& l : m.label)
          if (l.value == label_value) return m.counter.value;
    }
    return -1;
  }
  // Starts `job` and waits until it runs.
  void Run(const std::string& job) {
    ASSERT_TRUE(Eventually([&] { return Pods(job).size() == 2; }, 15s)) << "the gang's pods were not created";
    for (const json& pod : Pods(job)) SetPhase(pod, "Running");
    ASSERT_TRUE(Eventually([&] { return Status(job).value("phase", "") == "Running"; }, 15s)) << Status(job).dump();
  }

  std::unique_ptr<testing::ApiServer> server_;
  std::unique_ptr<kube::Client> operator_client_, client_;
  OperatorMetrics metrics_;
  std::unique_ptr<Controller> controller_;
  std::stop_source stop_;
  std::thread thread_;
};

TEST_F(LaggingCache, PodsCreatedThatTheCacheHasNotShownAreNotTakenAsDeleted) {
  DelayWatches("pods", 2000);
  for (const char* job : {"a", "b", "c"}) CreateJob(job);
  for (const char* job : {"a", "b", "c"}) Run(job);
  std::set<std::string> nodes;
  for (const char* job : {"a", "b", "c"}) {
    EXPECT_EQ(Status(job).value("restarts", -1), 0) << job << ": " << Status(job).dump();
    for (const json& pod : Pods(job)) nodes.insert(kube::PinnedNode(pod));
  }
  EXPECT_EQ(nodes.size(), 6u) << "no two pods of 8 GPUs on one 8-GPU node";
  EXPECT_EQ(OperatorRequests("DELETE"), 0);
}

TEST_F(LaggingCache, PodsDeletedThatTheCacheStillShowsAreDeletedOnce) {
  CreateJob("tiny");
  Run("tiny");
  DelayWatches("pods", 2000);
  const json failed = Pods("tiny").at(1);
  SetPhase(failed, "Failed");
  // The failure restarts the gang once; its two pods are deleted once, and the new gang
  // comes up once the cache has seen them go.
  ASSERT_TRUE(Eventually(
      [&] {
        const std::vector<json> pods = Pods("tiny");
        return pods.size() == 2 && std::all_of(pods.begin(), pods.end(), [](const json& pod) {
                 return pod["metadata"]["labels"].value(kGangLabel, "") == "1";
               });
      },
      20s));
  for (const json& pod : Pods("tiny")) SetPhase(pod, "Running");
  ASSERT_TRUE(Eventually([&] { return Status("tiny").value("phase", "") == "Running"; }, 15s)) << Status("tiny").dump();
  EXPECT_EQ(Status("tiny").value("restarts", -1), 1);
  EXPECT_EQ(Status("tiny").value("failures", -1), 1);
  EXPECT_EQ(OperatorRequests("DELETE"), 2);
}

TEST_F(LaggingCache, ANodeMissingFromALaggingCacheIsNoLostNode) {
  CreateJob("tiny");
  Run("tiny");
  DelayWatches("nodes", 2000);
  // The node is replaced by one of the same name: for a moment the cache has neither.
  const std::string name = kube::PinnedNode(Pods("tiny").at(0));
  const json node = client_->Get(res::Nodes(), "", name);
  client_->Delete(res::Nodes(), "", name);
  std::this_thread::sleep_for(500ms);
  json again = node;
  again["metadata"].erase("resourceVersion");
  again["metadata"].erase("uid");
  client_->Create(res::Nodes(), "", again);
  ASSERT_TRUE(Eventually([&] { return Counter("meshtrain_operator_absence_checks_total", "cache_lagging") >= 1; }, 10s))
      << "the operator never missed the node";
  std::this_thread::sleep_for(1s);  // the node's return reaches the cache
  EXPECT_EQ(Status("tiny").value("restarts", -1), 0) << Status("tiny").dump();
  EXPECT_EQ(Counter("meshtrain_operator_absence_checks_total", "gone"), 0);
  EXPECT_EQ(OperatorRequests("DELETE"), 0);
}

}  // namespace
}  // namespace meshtrain::controller
