#include "operator/scheduler/cluster.h"

#include <cstdio>
#include <fstream>

#include <gtest/gtest.h>

#include "api/manifest.h"

namespace meshtrain::scheduler {
namespace {

using Json = nlohmann::json;

Json Parse(const std::string& text) { return api::ParseManifestText(text, "t.json").at(0).object; }

TEST(Cluster, FromKubectlNodesAndPods) {
  const Json nodes = Parse(R"({"kind": "NodeList", "items": [
    {"metadata": {"name": "n2", "labels": {"kubernetes.io/hostname": "n2", "topology.k8s.aws/network-node-layer-3": "nn-3a"}},
     "spec": {"taints": [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}]},
     "status": {"allocatable": {"nvidia.com/gpu": "8", "vpc.amazonaws.com/efa": "32", "cpu": "191450m"},
                "conditions": [{"type": "MemoryPressure", "status": "False"}, {"type": "Ready", "status": "True"}]}},
    {"metadata": {"name": "n1"}, "spec": {"unschedulable": true},
     "status": {"allocatable": {"nvidia.com/gpu": 4}, "conditions": [{"type": "Ready", "status": "False"}]}}]})");
  const Json pods = Parse(R"({"kind": "PodList", "items": [
    {"metadata": {"namespace": "a", "name": "p1"}, "spec": {"nodeName": "n2",
     "containers": [{"resources": {"limits": {"nvidia.com/gpu": "2", "vpc.amazonaws.com/efa": "4"}}},
                    {"resources": {"requests": {"nvidia.com/gpu": "1"}}}],
     "initContainers": [{"resources": {"limits": {"nvidia.com/gpu": "1"}}}]}, "status": {"phase": "Running"}},
    {"metadata": {"namespace": "a", "name": "init-heavy"}, "spec": {"nodeName": "n2",
     "containers": [{"resources": {}}], "initContainers": [{"resources": {"limits": {"nvidia.com/gpu": "4"}}}]},
     "status": {"phase": "Pending"}},
    {"metadata": {"namespace": "a", "name": "done"}, "spec": {"nodeName": "n2",
     "containers": [{"resources": {"limits": {"nvidia.com/gpu": "8"}}}]}, "status": {"phase": "Succeeded"}},
    {"metadata": {"namespace": "a", "name": "unscheduled"}, "spec": {
     "containers": [{"resources": {"limits": {"nvidia.com/gpu": "8"}}}]}, "status": {"phase": "Pending"}}]})");
  const ClusterSnapshot s = SnapshotFromKubectl(nodes, pods);
  ASSERT_EQ(s.nodes.size(), 2u);
  EXPECT_EQ(s.nodes[0].name, "n1");  // sorted by name
  EXPECT_FALSE(s.nodes[0].ready);
  EXPECT_FALSE(s.nodes[0].schedulable);
  EXPECT_EQ(s.nodes[0].gpus, 4);
  const ClusterNode& n2 = s.nodes[1];
  EXPECT_TRUE(n2.ready);
  EXPECT_TRUE(n2.schedulable);
  EXPECT_EQ(n2.gpus, 8);
  EXPECT_EQ(n2.efa, 32);
  EXPECT_EQ(n2.gpus_used, 3 + 4);  // 2+1 from p1's containers; init-heavy's init container needs 4
  EXPECT_EQ(n2.efa_used, 4);
  EXPECT_EQ(n2.FreeGpus(), 1);
  EXPECT_EQ(n2.taints, (std::vector<Taint>{{"nvidia.com/gpu", "present", "NoSchedule"}}));
  EXPECT_EQ(n2.labels.at("topology.k8s.aws/network-node-layer-3"), "nn-3a");
}

TEST(Cluster, BadQuantitiesAndShapesAreNamed) {
  const Json bad_gpu = Parse(R"({"items": [{"metadata": {"name": "n1"}, "status": {"allocatable": {"nvidia.com/gpu": "1.5"}}}]})");
  try {
    SnapshotFromKubectl(bad_gpu, nullptr);
    FAIL();
  } catch (const ClusterError& e) {
    EXPECT_NE(std::string(e.what()).find("node n1 status.allocatable.nvidia.com/gpu: expected a whole number, got string \"1.5\""),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(SnapshotFromKubectl(Parse(R"({"kind": "NodeList"})"), nullptr), ClusterError);
  EXPECT_THROW(SnapshotFromKubectl(Parse(R"({"items": [{"metadata": "oops"}]})"), nullptr), ClusterError);
  // A list without an array of items, as a file, is named as that, not as a nameless node.
  const std::string file = testing::TempDir() + "meshtrain_cluster_items.json";
  for (const char* text : {R"({"items": 5})", R"({"kind": "NodeList"})"}) {
    std::ofstream(file, std::ios::trunc) << text;
    try {
      ReadKubectlFiles(file, "");
      ADD_FAILURE() << text;
    } catch (const ClusterError& e) {
      EXPECT_EQ(std::string(e.what()), file + ": document 1 is a list whose \"items\" is not an array") << text;
    }
  }
  std::remove(file.c_str());
}

TEST(Cluster, CompactDescriptionRoundTripsAndIsStrict) {
  const Json description = Parse(R"({"nodes": [
    {"name": "b", "gpus": 8, "gpusUsed": 2, "labels": {"k": "v"}, "taints": [{"key": "t", "effect": "NoExecute"}]},
    {"name": "a", "gpus": 8, "ready": false}]})");
  const ClusterSnapshot s = SnapshotFromDescription(description, "c.yaml");
  EXPECT_EQ(s.nodes[0].name, "a");
  EXPECT_EQ(s.nodes[1].FreeGpus(), 6);
  EXPECT_EQ(SnapshotFromDescription(ToDescription(s), "again"), s);
  try {
    SnapshotFromDescription(Parse(R"({"nodes": [{"name": "a", "gpu": 8}]})"), "c.yaml");
    FAIL();
  } catch (const ClusterError& e) {
    EXPECT_EQ(std::string(e.what()), "c.yaml: nodes[0].gpu: unknown field");
  }
  EXPECT_THROW(SnapshotFromDescription(Parse(R"({"nodes": [{"name": "a"}, {"name": "a"}]})"), "c"), ClusterError);
  EXPECT_THROW(SnapshotFromDescription(Parse(R"({"nodes": [{"name": "a", "gpusUsed": -1}]})"), "c"), ClusterError);
  EXPECT_THROW(ReadClusterFile("/nonexistent/cluster.yaml"), ClusterError);
}

}  // namespace
}  // namespace meshtrain::scheduler
