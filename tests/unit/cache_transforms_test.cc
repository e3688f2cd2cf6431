// What the operator's node and pod caches keep (operator/controller/cache_transforms.h):
// every field that placement, the reconcile, the pod indexes and the controller's
// handlers read, so that each reads the same from the kept object as from the whole one,
// and none of the rest (managedFields, annotations, images, the pods' environment).

#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "api/manifest.h"
#include "operator/controller/builders.h"
#include "operator/controller/cache_transforms.h"
#include "operator/controller/cluster_state.h"
#include "operator/controller/reconciler.h"
#include "operator/kube/objects.h"
#include "operator/scheduler/cluster.h"
#include "operator/scheduler/placement.h"
#include "operator/scheduler/synthetic_cluster.h"
#include "tests/support/kube/kubelet_simulator.h"

namespace meshtrain::controller {
namespace {

using nlohmann::json;

// A Node as a kubelet on EKS reports one.
json WholeNode() {
  return {
      {"apiVersion", "v1"},
      {"kind", "Node"},
      {"metadata",
       {{"name", "ip-10-0-1-7"},
        {"uid", "node-uid-7"},
        {"resourceVersion", "4242"},
        {"creationTimestamp", "2026-11-30T10:00:00Z"},
        {"labels",
         {{"kubernetes.io/hostname", "ip-10-0-1-7"},
          {"node.kubernetes.io/instance-type", "p5.48xlarge"},
          {"topology.k8s.aws/network-node-layer-1", "nn-1"},
          {"topology.k8s.aws/network-node-layer-2", "nn-2"},
          {"topology.k8s.aws/network-node-layer-3", "nn-3"}}},
        {"annotations",
         {{"node.alpha.kubernetes.io/ttl", "0"}, {"volumes.kubernetes.io/controller-managed-attach-detach", "true"}}},
        {"managedFields",
         json::array({{{"manager", "kubelet"},
                       {"operation", "Update"},
                       {"apiVersion", "v1"},
                       {"fieldsType", "FieldsV1"},
                       {"fieldsV1", {{"f:status", {{"f:images", json::object()}, {"f:conditions", json::object()}}}}}}})}}},
      {"spec",
       {{"providerID", "aws:///us-east-1a/i-0123456789abcdef0"},
        {"unschedulable", true},
        {"taints", json::array({{{"key", "nvidia.com/gpu"}, {"value", "present"}, {"effect", "NoSchedule"}}})}}},
      {"status",
       {{"capacity", {{"nvidia.com/gpu", "8"}, {"vpc.amazonaws.com/efa", "32"}, {"cpu", "192"}, {"memory", "2097152Mi"}}},
        {"allocatable",
         {{"nvidia.com/gpu", "8"},
          {"vpc.amazonaws.com/efa", "32"},
          {"cpu", "191450m"},
          {"memory", "2000000Mi"},
          {"hugepages-2Mi", "5120Mi"},
          {"pods", "110"}}},
        {"conditions",
         json::array({{{"type", "MemoryPressure"},
                       {"status", "False"},
                       {"reason", "KubeletHasSufficientMemory"},
                       {"message", "kubelet has sufficient memory available"},
                       {"lastHeartbeatTime", "2026-12-01T10:00:00Z"}},
                      {{"type", "Ready"},
                       {"status", "True"},
                       {"reason", "KubeletReady"},
                       {"message", "kubelet is posting ready status"},
                       {"lastHeartbeatTime", "2026-12-01T10:00:00Z"},
                       {"lastTransitionTime", "2026-11-30T10:01:00Z"}}})},
        {"addresses", json::array({{{"type", "InternalIP"}, {"address", "10.0.1.7"}}})},
        {"images", json::array({{{"names", json::array({"ghcr.io/meshtrain/meshtrain@sha256:0123", "ghcr.io/meshtrain/meshtrain:0.1.0"})},
                                 {"sizeBytes", 9876543210}}})},
        {"nodeInfo", {{"kubeletVersion", "v1.31.2-eks"}, {"containerRuntimeVersion", "containerd://1.7.22"}}}}}};
}

TEST(CacheTransformsTest, NodeKeepsWhatPlacementAndTheHandlersRead) {
  const json node = WholeNode();
  const json kept = NodeForCache(node);
  const json expected = {
      {"metadata",
       {{"name", "ip-10-0-1-7"}, {"uid", "node-uid-7"}, {"resourceVersion", "4242"}, {"labels", node["metadata"]["labels"]}}},
      {"spec", {{"unschedulable", true}, {"taints", node["spec"]["taints"]}}},
      {"status",
       {{"allocatable", {{"nvidia.com/gpu", "8"}, {"vpc.amazonaws.com/efa", "32"}}},
        {"conditions", json::array({{{"type", "Ready"}, {"status", "True"}}})}}}};
  EXPECT_EQ(kept, expected) << kept.dump(2);
  // What its readers make of it.
  EXPECT_EQ(scheduler::NodeFromKubectl(kept), scheduler::NodeFromKubectl(node));
  EXPECT_EQ(kube::KeyOf(kept), kube::KeyOf(node));
  EXPECT_TRUE(kube::ConditionTrue(kept, "Ready"));
  EXPECT_LT(kept.dump().size() * 2, node.dump().size());

  // Readiness, cordon, taints and allocatable follow the node.
  json changed = node;
  changed["status"]["conditions"][1]["status"] = "False";
  changed["spec"].erase("unschedulable");
  changed["spec"].erase("taints");
  changed["status"]["allocatable"].erase("vpc.amazonaws.com/efa");
  const json kept_changed = NodeForCache(changed);
  EXPECT_EQ(scheduler::NodeFromKubectl(kept_changed), scheduler::NodeFromKubectl(changed));
  EXPECT_FALSE(kube::ConditionTrue(kept_changed, "Ready"));
  EXPECT_FALSE(scheduler::NodeFromKubectl(kept_changed).ready);
  EXPECT_TRUE(scheduler::NodeFromKubectl(kept_changed).schedulable);
  EXPECT_EQ(scheduler::NodeFromKubectl(kept_changed).efa, 0);
}

TEST(CacheTransformsTest, NodeOfAnUnexpectedShapeFailsAsTheWholeOneWould) {
  json node = WholeNode();
  node["status"]["conditions"].push_back(42);  // not an object: NodeFromKubectl refuses the node
  EXPECT_THROW(scheduler::NodeFromKubectl(node), scheduler::ClusterError);
  EXPECT_THROW(scheduler::NodeFromKubectl(NodeForCache(node)), scheduler::ClusterError);
  node = WholeNode();
  node["status"]["allocatable"]["nvidia.com/gpu"] = "eight";
  EXPECT_THROW(scheduler::NodeFromKubectl(node), scheduler::ClusterError);
  EXPECT_THROW(scheduler::NodeFromKubectl(NodeForCache(node)), scheduler::ClusterError);
  node = WholeNode();
  node["spec"] = "cordoned";
  EXPECT_EQ(NodeForCache(node)["spec"], "cordoned");
  EXPECT_EQ(NodeForCache(json(7)), json(7));
}

// `node` (a kubelet's registration) with what a real cluster adds and placement never
// reads: managedFields, annotations, images, node info and conditions of other types;
// and an instance type, the job's node selector, unless `other_type`.
json Dressed(json node, bool other_type) {
  node["metadata"]["labels"]["node.kubernetes.io/instance-type"] = other_type ? "p4d.24xlarge" : "p5.48xlarge";
  node["metadata"]["uid"] = "uid-" + node["metadata"]["name"].get<std::string>();
  node["metadata"]["resourceVersion"] = "100";
  node["metadata"]["annotations"] = {{"node.alpha.kubernetes.io/ttl", "0"}};
  node["metadata"]["managedFields"] =
      json::array({{{"manager", "kubelet"}, {"fieldsV1", {{"f:status", json::object()}}}}});
  node["status"]["images"] =
      json::array({{{"names", json::array({"ghcr.io/meshtrain/meshtrain:0.1.0"})}, {"sizeBytes", 9876543210}}});
  node["status"]["nodeInfo"] = {{"kubeletVersion", "v1.31.2-eks"}};
  const json pressure = {{"type", "MemoryPressure"}, {"status", "True"}, {"reason", "KubeletHasMemoryPressure"}};
  node["status"]["conditions"].insert(node["status"]["conditions"].begin(), pressure);
  return node;
}

// Every field of a placement, to compare and print.
std::string Text(const scheduler::Placement& p) {
  std::string text =
      p.ok() ? "placed in " + std::to_string(p.domain_level) + " " + p.domain + ":" : "refused: " + p.reason;
  for (size_t i = 0; i < p.nodes.size(); ++i) {
    text += " " + p.nodes[i] + " (";
    for (const std::string& domain : p.paths.at(i)) text += domain + "/";
    text += ")";
  }
  return text;
}

// The operator places gangs from ClusterState, which the node and pod caches feed. Fed the
// kept objects, it counts the same GPUs in use on every node and makes every placement
// it makes fed the whole ones, refusals and their reasons included, on a cluster with
// nodes not Ready, cordoned, tainted, missing topology labels, without EFA and of
// another instance type.
TEST(CacheTransformsTest, PlacementFromKeptObjectsIsPlacementFromWholeOnes) {
  scheduler::SyntheticClusterOptions options;
  options.nodes = 300;
  options.gpu_used_fraction = 0;  // what is in use comes from the pods below
  options.not_ready_fraction = 0.1;
  options.cordoned_fraction = 0.1;
  options.tainted_fraction = 0.2;
  options.unlabelled_fraction = 0.1;
  scheduler::ClusterSnapshot cluster = scheduler::MakeSyntheticCluster(options);
  for (size_t i = 0; i < cluster.nodes.size(); i += 9) cluster.nodes[i].efa = 0;

  ClusterState whole, kept;
  for (size_t i = 0; i < cluster.nodes.size(); ++i) {
    const json node = Dressed(testing::NodeObject(cluster.nodes[i]), i % 11 == 5);
    const json trimmed = NodeForCache(node);
    whole.NodeChanged(nullptr, &node);
    kept.NodeChanged(nullptr, &trimmed);
  }

  // Pods of 2-node gangs (8 GPUs and 4 EFA interfaces a pod) on the first nodes placement
  // picks, pinned there by node affinity: running ones hold their node's GPUs, finished
  // ones (every third gang) hold none.
  api::TrainingJob job = api::LoadTrainingJobs("examples/gpt2-124m-2x8.yaml").at(0).job;
  job.metadata.uid = "job-uid-1";
  const scheduler::PlacementRequest gang = scheduler::PlacementRequest::ForJob(job);
  ASSERT_FALSE(gang.tolerations.empty());
  for (int g = 0; g < 30; ++g) {
    const scheduler::Placement placement = scheduler::Place(gang, whole.View());
    ASSERT_TRUE(placement.ok()) << placement.reason;
    const api::RankTable table = scheduler::MakeRankTable(placement, gang.levels, gang.gpus_per_node);
    for (int64_t rank = 0; rank < gang.nodes; ++rank) {
      json pod = BuildPod(job, table, g, rank, 1);
      pod["metadata"]["uid"] = "pod-uid-" + std::to_string(g) + "-" + std::to_string(rank);
      pod["metadata"]["resourceVersion"] = "200";
      pod["metadata"]["managedFields"] = json::array({{{"manager", "meshtrain-operator"}}});
      pod["status"] = {{"phase", g % 3 == 2 ? "Succeeded" : "Running"},
                       {"podIP", "10.0.0." + std::to_string(rank + 1)},
                       {"qosClass", "Burstable"},
                       {"conditions", json::array({{{"type", "PodScheduled"}, {"status", "True"}},
                                                   {{"type", "Ready"}, {"status", "True"}}})}};
      const json trimmed = PodForCache(pod);
      whole.PodChanged(nullptr, &pod);
      kept.PodChanged(nullptr, &trimmed);
    }
  }
  int nodes_in_use = 0;
  for (const scheduler::ClusterNode& n : cluster.nodes) {
    EXPECT_EQ(kept.Used(n.name), whole.Used(n.name)) << n.name;
    EXPECT_EQ(kept.Node(n.name), whole.Node(n.name)) << n.name;
    nodes_in_use += whole.Used(n.name).first > 0;
  }
  EXPECT_EQ(nodes_in_use, 2 * 20);  // the finished gangs' nodes are free again

  int placed = 0, refused = 0;
  for (int64_t nodes : {1, 2, 4, 8, 16, 64, 200}) {
    for (int64_t gpus : {1, 8}) {
      for (int64_t efa : {0, 32}) {
        for (bool tolerates : {false, true}) {
          for (bool required : {false, true}) {
            scheduler::PlacementRequest r = gang;
            r.nodes = nodes;
            r.gpus_per_node = gpus;
            r.efa_per_node = efa;
            r.nodes_per_shard_group = nodes >= 4 ? 2 : 1;
            r.required = required;  // in one domain of the job's required level, layer 3
            if (!tolerates) r.tolerations.clear();  // the job's: nvidia.com/gpu, Exists, NoSchedule
            SCOPED_TRACE(::testing::Message() << nodes << " nodes x " << gpus << " GPUs, EFA " << efa
                                              << (tolerates ? ", tolerating the taint" : "")
                                              << (required ? ", one layer-3 domain" : ""));
            const scheduler::Placement from_whole = scheduler::Place(r, whole.View());
            EXPECT_EQ(Text(scheduler::Place(r, kept.View())), Text(from_whole));
            ++(from_whole.ok() ? placed : refused);
          }
        }
      }
    }
  }
  EXPECT_GT(placed, 0);
  EXPECT_GT(refused, 0);
}

// A pod the operator built, as the API server and the kubelet fill it in.
json WholePod(bool bound) {
  api::TrainingJob job = api::LoadTrainingJobs("examples/gpt2-124m-2x8.yaml").at(0).job;
  job.metadata.uid = "job-uid-1";
  job.metadata.namespace_ = "team-a";
  scheduler::Placement placement;
  placement.nodes = {"node-a", "node-b"};
  placement.paths = {{"l1", "l2", "l3", "node-a"}, {"l1", "l2", "l3", "node-b"}};
  json pod = BuildPod(job, scheduler::MakeRankTable(placement, job.spec.topology.levels, 8), 3, 1, 5);
  json& meta = pod["metadata"];
  meta["namespace"] = "team-a";
  meta["uid"] = "pod-uid-1";
  meta["resourceVersion"] = "777";
  meta["creationTimestamp"] = "2026-12-01T10:00:00Z";
  meta["deletionTimestamp"] = "2026-12-01T11:00:00Z";
  meta["managedFields"] = json::array({{{"manager", "meshtrain-operator"}, {"operation", "Update"},
                                        {"fieldsV1", {{"f:spec", {{"f:containers", json::object()}}}}}}});
  if (bound) pod["spec"]["nodeName"] = "node-b";
  pod["status"] = {
      {"phase", "Failed"},
      {"podIP", "10.0.1.9"},
      {"podIPs", json::array({{{"ip", "10.0.1.9"}}})},
      {"hostIP", "10.0.1.7"},
      {"qosClass", "Burstable"},
      {"startTime", "2026-12-01T10:00:05Z"},
      {"conditions", json::array({{{"type", "PodScheduled"}, {"status", "True"}},
                                  {{"type", "Ready"}, {"status", "False"}, {"reason", "PodFailed"}},
                                  {{"type", "ContainersReady"}, {"status", "False"}}})},
      {"containerStatuses",
       json::array({{{"name", "worker"},
                     {"image", "ghcr.io/meshtrain/meshtrain:0.1.0"},
                     {"imageID", "ghcr.io/meshtrain/meshtrain@sha256:0123"},
                     {"containerID", "containerd://abc"},
                     {"ready", false},
                     {"restartCount", 0},
                     {"state",
                      {{"terminated",
                        {{"exitCode", 78},
                         {"reason", "Error"},
                         {"message", std::string(4096, 'x')},
                         {"startedAt", "2026-12-01T10:00:06Z"},
                         {"finishedAt", "2026-12-01T10:09:00Z"},
                         {"containerID", "containerd://abc"}}}}},
                     {"lastState", {{"waiting", {{"reason", "ContainerCreating"}, {"message", "pulling"}}}}}}})}};
  return pod;
}

TEST(CacheTransformsTest, PodKeepsWhatTheReconcileAndTheIndexesRead) {
  for (bool bound : {true, false}) {
    SCOPED_TRACE(bound ? "bound to its node" : "pinned by node affinity, not bound yet");
    const json pod = WholePod(bound);
    const json kept = PodForCache(pod);
    // The indexes and ClusterState (its pods in flight too).
    EXPECT_EQ(PodJobKeys(kept), PodJobKeys(pod));
    EXPECT_EQ(PodJobKeys(kept), std::vector<std::string>{"team-a/gpt2-124m"});
    EXPECT_EQ(PodNodes(kept), PodNodes(pod));
    EXPECT_EQ(kube::PinnedNode(kept), kube::PinnedNode(pod));
    EXPECT_EQ(kube::PinnedNode(kept), "node-b");
    EXPECT_EQ(kube::KeyOf(kept), kube::KeyOf(pod));
    EXPECT_EQ(kube::Uid(kept), "pod-uid-1");
    EXPECT_EQ(kept["metadata"]["resourceVersion"], "777");
    for (const char* resource : {"nvidia.com/gpu", "vpc.amazonaws.com/efa"}) {
      EXPECT_EQ(scheduler::PodRequest(kept["spec"], resource, "kept"), scheduler::PodRequest(pod["spec"], resource, "whole"))
          << resource;
    }
    EXPECT_GT(scheduler::PodRequest(kept["spec"], "nvidia.com/gpu", "kept"), 0);
    // The reconcile and Decide: ownership, deletion, labels, age, phase, readiness, exit
    // code, and the pollers' address.
    for (const char* field : {"labels", "ownerReferences", "creationTimestamp", "deletionTimestamp", "name", "namespace"})
      EXPECT_EQ(kept["metadata"][field], pod["metadata"][field]) << field;
    EXPECT_EQ(kube::PodPhase(kept), "Failed");
    EXPECT_EQ(kube::ConditionTrue(kept, "Ready"), kube::ConditionTrue(pod, "Ready"));
    EXPECT_EQ(kept["status"]["podIP"], "10.0.1.9");
    EXPECT_EQ(kept["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"], 78);
    EXPECT_TRUE(kept["status"]["containerStatuses"][0]["state"].contains("terminated"));

    // The rest is gone.
    EXPECT_FALSE(kept["metadata"].contains("managedFields"));
    EXPECT_FALSE(kept["metadata"].contains("annotations"));
    EXPECT_FALSE(kept.contains("apiVersion"));
    for (const char* field : {"volumes", "tolerations", "securityContext", "restartPolicy"})
      EXPECT_FALSE(kept["spec"].contains(field)) << field;
    ASSERT_EQ(kept["spec"]["containers"].size(), pod["spec"]["containers"].size());
    EXPECT_EQ(kept["spec"]["containers"][0],
              json({{"name", pod["spec"]["containers"][0]["name"]}, {"resources", pod["spec"]["containers"][0]["resources"]}}));
    EXPECT_EQ(kept["status"]["conditions"], json::array({{{"type", "Ready"}, {"status", "False"}}}));
    EXPECT_EQ(kept["status"]["containerStatuses"][0],
              json({{"name", "worker"}, {"state", {{"terminated", {{"exitCode", 78}, {"reason", "Error"}}}}}}));
    EXPECT_LT(kept.dump().size() * 4, pod.dump().size());
  }
}

TEST(CacheTransformsTest, PodOfAnUnexpectedShapeKeepsTheOddField) {
  json pod = WholePod(true);
  pod["spec"]["containers"] = "worker";
  pod["status"]["containerStatuses"][0]["state"] = json::array();
  const json kept = PodForCache(pod);
  EXPECT_EQ(kept["spec"]["containers"], "worker");
  EXPECT_EQ(kept["status"]["containerStatuses"][0]["state"], json::array());
  EXPECT_THROW(scheduler::PodRequest(kept["spec"], "nvidia.com/gpu", "kept"), std::exception);
  EXPECT_EQ(PodForCache(json("pod")), json("pod"));
}

}  // namespace
}  // namespace meshtrain::controller
