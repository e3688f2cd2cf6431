// The test API server's Kueue admission simulator (tests/support/kube/kueue_simulator.h),
// in process: a quota in nodes, admission in creation order, TAS assignments in node
// order, eviction, the quota given back by the job, and Finished.

#include <chrono>
#include <thread>

#include <gtest/gtest.h>

#include "api/manifest.h"
#include "operator/controller/kueue.h"
#include "tests/support/kube/api_server.h"
#include "tests/support/kube/kueue_simulator.h"

namespace meshtrain::testing {
namespace {

using nlohmann::json;
using namespace std::chrono_literals;

bool Eventually(const std::function<bool()>& done) {
  for (const auto deadline = std::chrono::steady_clock::now() + 10s; std::chrono::steady_clock::now() < deadline;
       std::this_thread::sleep_for(10ms))
    if (done()) return true;
  return done();
}

class KueueSimulatorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    server_ = std::make_unique<ApiServer>(ApiServer::Options{});
    server_->Start(0);
    server_->Create("apiextensions.k8s.io/customresourcedefinitions", "",
                    api::ReadManifestFile("tests/data/kueue/kueue.x-k8s.io_workloads.yaml").at(0).object);
    KueueSimulatorOptions options;
    options.quota_nodes = 2;
    options.nodes = {"n3", "n2", "n1", "n0"};
    simulator_ = std::make_unique<KueueSimulator>(*server_, options);
    simulator_->Start();
  }
  void TearDown() override {
    simulator_->Stop();
    server_->Stop();
  }
  void CreateWorkload(const std::string& job, int priority = 0) {
    json workload = {
        {"apiVersion", "kueue.x-k8s.io/v1beta2"},
        {"kind", "Workload"},
        {"metadata", {{"name", "wl-" + job}, {"namespace", "default"}, {"labels", {{"meshtrain.dev/job-name", job}}}}},
        {"spec",
         {{"queueName", "training"},
          {"podSets",
           json::array({{{"name", "workers"},
                         {"count", 2},
                         {"topologyRequest", {{"preferred", "layer"}, {"podIndexLabel", "meshtrain.dev/node-rank"}}},
                         {"template",
                          {{"spec",
                            {{"containers",
                              json::array({{{"name", "worker"},
                                            {"resources", {{"requests", {{"nvidia.com/gpu", "8"}}}}}}})}}}}}}})}}}};
    if (priority != 0) workload["spec"]["priority"] = priority;
    server_->Create(KueueSimulator::kWorkloads, "default", workload);
  }
  json Workload(const std::string& job) { return server_->Get(KueueSimulator::kWorkloads, "default", "wl-" + job).value(); }
  bool Admitted(const std::string& job) { return controller::WorkloadConditionTrue(Workload(job), "Admitted"); }
  std::vector<std::string> Nodes(const std::string& job) {
    std::string error;
    return controller::TopologyNodes(
        Workload(job)["status"]["admission"]["podSetAssignments"][0]["topologyAssignment"], &error);
  }

  std::unique_ptr<ApiServer> server_;
  std::unique_ptr<KueueSimulator> simulator_;
};

TEST_F(KueueSimulatorTest, AdmitsInOrderWithinTheQuotaAndEvicts) {
  CreateWorkload("a");
  CreateWorkload("b");
  ASSERT_TRUE(Eventually([&] { return Admitted("a"); }));
  EXPECT_EQ(Nodes("a"), (std::vector<std::string>{"n3", "n2"})) << "TAS in the nodes' order, pod index order";
  EXPECT_EQ(Workload("a")["status"]["admission"]["podSetAssignments"][0]["flavors"]["nvidia.com/gpu"], "default-flavor");
  EXPECT_TRUE(controller::WorkloadConditionTrue(Workload("a"), "QuotaReserved"));
  std::this_thread::sleep_for(300ms);
  EXPECT_FALSE(Admitted("b")) << "no quota left";

  simulator_->SetQuota(4);
  ASSERT_TRUE(Eventually([&] { return Admitted("b"); }));
  EXPECT_EQ(Nodes("b"), (std::vector<std::string>{"n1", "n0"}));

  // Evicted: the quota is held until the job gives it back; then queued again.
  simulator_->SetQuota(2);
  ASSERT_TRUE(simulator_->Evict("default", "a"));
  ASSERT_TRUE(Eventually([&] { return controller::WorkloadEvicted(Workload("a")); }));
  EXPECT_FALSE(simulator_->Evict("default", "nobody"));
  server_->Mutate(KueueSimulator::kWorkloads, "default", "wl-a",
                  [](json& w) { w = controller::WorkloadRequeued(w, std::chrono::system_clock::now()); });
  std::this_thread::sleep_for(300ms);
  EXPECT_FALSE(Admitted("a")) << "b holds the quota";
  // b finishes: a is admitted again, and no longer counts as evicted.
  server_->Mutate(KueueSimulator::kWorkloads, "default", "wl-b", [](json& w) {
    controller::SetWorkloadCondition(&w, "Finished", true, "Succeeded", "done", std::chrono::system_clock::now());
  });
  ASSERT_TRUE(Eventually([&] { return Admitted("a"); }));
  EXPECT_FALSE(controller::WorkloadEvicted(Workload("a")));
  EXPECT_EQ(Nodes("a"), (std::vector<std::string>{"n3", "n2"}));
}

// A Workload of higher priority that does not fit evicts a lower one, waits for its quota,
// and is admitted first; the evicted one comes back once the quota is free again.
TEST_F(KueueSimulatorTest, AHigherPriorityPreemptsALowerOne) {
  CreateWorkload("low");
  ASSERT_TRUE(Eventually([&] { return Admitted("low"); }));
  CreateWorkload("same");  // of the same priority: it waits, and preempts nobody
  std::this_thread::sleep_for(300ms);
  EXPECT_FALSE(controller::WorkloadEvicted(Workload("low")));
  CreateWorkload("high", 100);
  ASSERT_TRUE(Eventually([&] { return controller::WorkloadEvicted(Workload("low")); }));
  EXPECT_NE(controller::WorkloadConditionMessage(Workload("low"), "Evicted").find("default/wl-high, priority 100"),
            std::string::npos)
      << controller::WorkloadConditionMessage(Workload("low"), "Evicted");
  std::this_thread::sleep_for(300ms);
  EXPECT_FALSE(Admitted("high")) << "the evicted Workload still holds the quota";
  server_->Mutate(KueueSimulator::kWorkloads, "default", "wl-low",
                  [](json& w) { w = controller::WorkloadRequeued(w, std::chrono::system_clock::now()); });
  ASSERT_TRUE(Eventually([&] { return Admitted("high"); })) << "first in line, before the older \"same\"";
  EXPECT_FALSE(Admitted("same"));
  EXPECT_FALSE(Admitted("low"));
  server_->Mutate(KueueSimulator::kWorkloads, "default", "wl-high", [](json& w) {
    controller::SetWorkloadCondition(&w, "Finished", true, "Succeeded", "done", std::chrono::system_clock::now());
  });
  ASSERT_TRUE(Eventually([&] { return Admitted("same"); })) << "then the queue's order";
  EXPECT_FALSE(Admitted("low"));
}

}  // namespace
}  // namespace meshtrain::testing
