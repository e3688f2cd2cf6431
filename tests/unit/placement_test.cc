// Placement rules on hand-made clusters.

#include "operator/scheduler/placement.h"

#include <gtest/gtest.h>

#include "api/manifest.h"
#include "api/rank_table.h"

namespace meshtrain::scheduler::placement_test {
namespace {

const std::vector<std::string> kLevels = {"topology.k8s.aws/network-node-layer-1", "topology.k8s.aws/network-node-layer-2",
                                          "topology.k8s.aws/network-node-layer-3", "kubernetes.io/hostname"};

// A node under layer-1/2/3 domains `l1/l2/l3` with `free` of 8 GPUs free.
ClusterNode Node(const std::string& name, const std::string& l1, const std::string& l2, const std::string& l3,
                 int free = 8) {
  ClusterNode n;
  n.name = name;
  n.labels = {{kLevels[0], l1}, {kLevels[1], l2}, {kLevels[2], l3}, {kLevels[3], name}};
  n.gpus = 8;
  n.gpus_used = 8 - free;
  n.efa = 32;
  return n;
}

ClusterSnapshot Cluster(std::vector<ClusterNode> nodes) {
  return SnapshotFromDescription(ToDescription({std::move(nodes)}), "test cluster");
}

PlacementRequest Request(int64_t nodes, int64_t unit = 1, bool required = false) {
  PlacementRequest r;
  r.nodes = nodes;
  r.gpus_per_node = 8;
  r.levels = kLevels;
  r.required = required;
  r.required_level = kLevels[2];
  r.nodes_per_shard_group = unit;
  return r;
}

// Two layer-3 domains under one layer-2: "a" with `a` free nodes, "b" with `b`.
ClusterSnapshot TwoRacks(int a, int b) {
  std::vector<ClusterNode> nodes;
  for (int i = 0; i < a; ++i) nodes.push_back(Node("a" + std::to_string(i), "s1", "p1", "rack-a"));
  for (int i = 0; i < b; ++i) nodes.push_back(Node("b" + std::to_string(i), "s1", "p1", "rack-b"));
  return Cluster(std::move(nodes));
}

TEST(Placement, ExactFitIsChosenOverALargerDomain) {
  const Placement p = Place(Request(4), TwoRacks(6, 4));
  ASSERT_TRUE(p.ok()) << p.reason;
  EXPECT_EQ(p.nodes, (std::vector<std::string>{"b0", "b1", "b2", "b3"}));
  EXPECT_EQ(p.domain_level, 2);
  EXPECT_EQ(p.domain, "s1/p1/rack-b");
}

TEST(Placement, OneShortMissWithRequiredTopologySaysWhy) {
  const Placement p = Place(Request(5, 1, /*required=*/true), TwoRacks(4, 4));
  EXPECT_FALSE(p.ok());
  EXPECT_TRUE(p.nodes.empty());
  EXPECT_EQ(p.reason,
            "needs 5 nodes with 8 free GPUs in one topology.k8s.aws/network-node-layer-3 domain; the largest such "
            "domain has 4");
}

TEST(Placement, PreferredTopologyFallsBackOneLevel) {
  const Placement p = Place(Request(5), TwoRacks(4, 4));
  ASSERT_TRUE(p.ok()) << p.reason;
  EXPECT_EQ(p.nodes.size(), 5u);
  EXPECT_EQ(p.domain_level, 1);
  EXPECT_EQ(p.domain, "s1/p1");
}

TEST(Placement, RequiredTopologyAcceptsAnExactFit) {
  const Placement p = Place(Request(4, 1, true), TwoRacks(4, 3));
  ASSERT_TRUE(p.ok()) << p.reason;
  EXPECT_EQ(p.domain, "s1/p1/rack-a");
}

TEST(Placement, FallsBackToTheWholeClusterWhenNoDomainHoldsTheGang) {
  const ClusterSnapshot cluster = Cluster({Node("x", "s1", "p1", "r1"), Node("y", "s2", "p2", "r2")});
  const Placement p = Place(Request(2), cluster);
  ASSERT_TRUE(p.ok()) << p.reason;
  EXPECT_EQ(p.domain_level, -1);
  EXPECT_EQ(p.nodes.size(), 2u);
}

TEST(Placement, TooFewEligibleNodesListsTheReasons) {
  std::vector<ClusterNode> nodes = {Node("a", "s", "p", "r"), Node("b", "s", "p", "r"), Node("c", "s", "p", "r", 7),
                                    Node("d", "s", "p", "r"), Node("e", "s", "p", "r")};
  nodes[3].ready = false;
  nodes[4].schedulable = false;
  const Placement p = Place(Request(3), Cluster(nodes));
  EXPECT_FALSE(p.ok());
  EXPECT_EQ(p.reason,
            "needs 3 nodes with 8 free GPUs; only 2 of 5 nodes are eligible (1 cordoned, 1 not Ready, 1 with too few "
            "free GPUs)");
}

TEST(Placement, PartialGpuUseCountsAgainstTheNode) {
  const ClusterSnapshot cluster = Cluster({Node("a", "s", "p", "r", 4), Node("b", "s", "p", "r", 3)});
  PlacementRequest r = Request(1);
  EXPECT_FALSE(Place(r, cluster).ok());  // 8 GPUs per pod: neither has room
  r.gpus_per_node = 4;
  EXPECT_EQ(Place(r, cluster).nodes, std::vector<std::string>{"a"});
  r.nodes = 2;
  EXPECT_FALSE(Place(r, cluster).ok());
  r.gpus_per_node = 3;
  EXPECT_TRUE(Place(r, cluster).ok());
}

TEST(Placement, TaintsNeedTolerations) {
  std::vector<ClusterNode> nodes = {Node("a", "s", "p", "r"), Node("b", "s", "p", "r")};
  nodes[0].taints.push_back({"nvidia.com/gpu", "present", "NoSchedule"});
  nodes[1].taints.push_back({"maintenance", "", "PreferNoSchedule"});  // never blocks
  PlacementRequest r = Request(2);
  EXPECT_NE(Place(r, Cluster(nodes)).reason.find("1 with the untolerated taint nvidia.com/gpu=present:NoSchedule"),
            std::string::npos)
      << Place(r, Cluster(nodes)).reason;
  r.tolerations.push_back({"nvidia.com/gpu", "Exists", "", "NoSchedule", std::nullopt});
  EXPECT_TRUE(Place(r, Cluster(nodes)).ok());
  r.tolerations = {{"nvidia.com/gpu", "Equal", "absent", "", std::nullopt}};  // wrong value
  EXPECT_FALSE(Place(r, Cluster(nodes)).ok());
  r.tolerations = {{"", "Exists", "", "", std::nullopt}};  // tolerates everything
  EXPECT_TRUE(Place(r, Cluster(nodes)).ok());
}

TEST(Placement, NodeSelectorAndAvoidedNodes) {
  std::vector<ClusterNode> nodes = {Node("a", "s", "p", "r"), Node("b", "s", "p", "r"), Node("c", "s", "p", "r")};
  nodes[0].labels["node.kubernetes.io/instance-type"] = "p5.48xlarge";
  nodes[1].labels["node.kubernetes.io/instance-type"] = "p5.48xlarge";
  PlacementRequest r = Request(2);
  r.node_selector = {{"node.kubernetes.io/instance-type", "p5.48xlarge"}};
  EXPECT_EQ(Place(r, Cluster(nodes)).nodes, (std::vector<std::string>{"a", "b"}));
  r.avoid = {"a"};
  EXPECT_EQ(Place(r, Cluster(nodes)).reason,
            "needs 2 nodes with 8 free GPUs; only 1 of 3 nodes are eligible (1 avoided after failures, 1 not matching "
            "the node selector)");
}

TEST(Placement, MissingLabelPutsANodeInItsOwnDomain) {
  std::vector<ClusterNode> nodes = {Node("a", "s", "p", "r"), Node("b", "s", "p", "r"), Node("c", "s", "p", "r")};
  nodes[0].labels.erase(kLevels[2]);
  EXPECT_EQ(TopologyPath(nodes[0], kLevels), (std::vector<std::string>{"s", "p", "unlabelled:a", "a"}));
  const Placement p = Place(Request(2), Cluster(nodes));
  EXPECT_EQ(p.nodes, (std::vector<std::string>{"b", "c"}));  // the labelled pair shares a rack
  EXPECT_EQ(p.domain, "s/p/r");
}

// 4 nodes in shard groups of 2 (e.g. TP 8 x shard 2 on 8-GPU nodes), in racks of 3 and 3.
// Taking 3 + 1 would split a shard group across racks; 2 + 2 keeps both inside one.
TEST(Placement, ShardGroupsAlignToFragmentedDomains) {
  const Placement p = Place(Request(4, 2), TwoRacks(3, 3));
  ASSERT_TRUE(p.ok()) << p.reason;
  ASSERT_EQ(p.nodes.size(), 4u);
  for (int group = 0; group < 2; ++group) EXPECT_EQ(p.paths[2 * group][2], p.paths[2 * group + 1][2]) << group;
  EXPECT_NE(p.paths[0][2], p.paths[2][2]);
}

// 4 nodes in 2 pipeline stages of 2 nodes, each node its own shard group (TP 8 on 8-GPU
// nodes), in racks of 3 and 3. Whole shard groups alone would take 3 + 1 and split the
// second stage across racks; whole stages take 2 + 2, so only activations cross them.
TEST(Placement, PipelineStagesStayInsideARack) {
  PlacementRequest r = Request(4, 1);
  const Placement flat = Place(r, TwoRacks(3, 3));
  ASSERT_TRUE(flat.ok()) << flat.reason;
  EXPECT_NE(flat.paths[2][2], flat.paths[3][2]);  // what happens without stages
  r.nodes_per_stage = 2;
  const Placement p = Place(r, TwoRacks(3, 3));
  ASSERT_TRUE(p.ok()) << p.reason;
  ASSERT_EQ(p.nodes.size(), 4u);
  for (int stage = 0; stage < 2; ++stage) EXPECT_EQ(p.paths[2 * stage][2], p.paths[2 * stage + 1][2]) << stage;
  // Four stages of 2 in racks of 3, 3 and 4: the rack of 4 holds two whole stages.
  std::vector<ClusterNode> nodes;
  for (int i = 0; i < 3; ++i) nodes.push_back(Node("a" + std::to_string(i), "s1", "p1", "rack-a"));
  for (int i = 0; i < 3; ++i) nodes.push_back(Node("b" + std::to_string(i), "s1", "p1", "rack-b"));
  for (int i = 0; i < 4; ++i) nodes.push_back(Node("c" + std::to_string(i), "s1", "p1", "rack-c"));
  r.nodes = 8;
  const Placement four = Place(r, Cluster(nodes));
  ASSERT_TRUE(four.ok()) << four.reason;
  for (int stage = 0; stage < 4; ++stage) EXPECT_EQ(four.paths[2 * stage][2], four.paths[2 * stage + 1][2]) << stage;
}

TEST(Placement, RequestFromAPipelinedJobKeepsItsStagesWhole) {
  nlohmann::json manifest = api::ReadManifestFile("examples/gpt2-2p7b-32x8.yaml")[0].object;
  manifest["spec"]["parallelism"]["pipelineParallelDegree"] = 2;
  manifest["spec"]["parallelism"]["hybridShardDegree"] = 8;
  const api::CheckedJob checked = api::CheckTrainingJob(manifest, "x.yaml", 0);
  ASSERT_TRUE(checked.ok()) << checked.errors.front().ToString();
  const PlacementRequest r = PlacementRequest::ForJob(checked.job);
  EXPECT_EQ(r.nodes_per_stage, 16);
  EXPECT_EQ(r.nodes_per_shard_group, 8);
}

TEST(Placement, PrefersADomainThatHoldsWholeShardGroups) {
  // Layer-2 "p1": racks of 3, 3 and 3 (the tighter fit for 8, but no rack holds a group of 4).
  // Layer-2 "p2": racks of 4, 4 and 2 (two whole groups of 4).
  std::vector<ClusterNode> nodes;
  auto rack = [&](const std::string& spine, const std::string& name, int n) {
    for (int i = 0; i < n; ++i) nodes.push_back(Node(name + std::to_string(i), "s", spine, name));
  };
  rack("p1", "a", 3), rack("p1", "b", 3), rack("p1", "c", 3);
  rack("p2", "d", 4), rack("p2", "e", 4), rack("p2", "f", 2);
  const Placement p = Place(Request(8, 4), Cluster(nodes));
  ASSERT_TRUE(p.ok()) << p.reason;
  EXPECT_EQ(p.domain, "s/p2");
  for (int i = 0; i < 8; ++i) EXPECT_EQ(p.paths[i][2], i < 4 ? p.paths[0][2] : p.paths[4][2]) << i;
  EXPECT_NE(p.paths[0][2], "f");
  // Without shard groups to keep whole, the tighter fit wins.
  EXPECT_EQ(Place(Request(8, 1), Cluster(nodes)).domain, "s/p1");
}

TEST(Placement, ConsecutiveNodeRanksShareTheDeepestDomain) {
  std::vector<ClusterNode> nodes;
  // Names interleave the racks, so name order would alternate between them.
  for (int i = 0; i < 4; ++i) {
    nodes.push_back(Node("n" + std::to_string(2 * i), "s", "p", "even"));
    nodes.push_back(Node("n" + std::to_string(2 * i + 1), "s", "p", "odd"));
  }
  const Placement p = Place(Request(8, 4), Cluster(nodes));
  ASSERT_TRUE(p.ok());
  for (int i = 0; i < 8; ++i) EXPECT_EQ(p.paths[i][2], p.paths[i / 4 * 4][2]) << i;
  const Placement blind = PlaceBlind(Request(8, 4), Cluster(nodes));
  EXPECT_EQ(blind.nodes.front(), "n0");
  EXPECT_EQ(blind.nodes[1], "n1");
  EXPECT_EQ(InNameOrder(p).nodes, blind.nodes);
}

// A lost node's replacement: the free node nearest it, outside the gang.
TEST(Placement, AReplacementIsTheFreeNodeNearestTheLostOne) {
  std::vector<ClusterNode> nodes = {Node("a0", "s1", "p1", "rack-a"), Node("a1", "s1", "p1", "rack-a"),
                                    Node("a2", "s1", "p1", "rack-a"), Node("b0", "s1", "p1", "rack-b"),
                                    Node("b1", "s1", "p1", "rack-b"), Node("c0", "s1", "p2", "rack-c")};
  const Placement gang = Place(Request(4, 2), Cluster(nodes));
  ASSERT_TRUE(gang.ok()) << gang.reason;
  ASSERT_EQ(gang.nodes, (std::vector<std::string>{"a0", "a1", "b0", "b1"}));
  nodes[4].ready = false;  // b1 is lost; a2 (same layer 2) beats c0 (another layer 2)
  const Placement replaced = PlaceReplacement(Request(4, 2), Cluster(nodes), gang, 3);
  ASSERT_TRUE(replaced.ok()) << replaced.reason;
  EXPECT_EQ(replaced.nodes, (std::vector<std::string>{"a0", "a1", "b0", "a2"}));
  EXPECT_EQ(replaced.paths[3], (std::vector<std::string>{"s1", "p1", "rack-a", "a2"}));
  EXPECT_EQ(replaced.paths[0], gang.paths[0]);

  nodes[2].gpus_used = 1;  // a2 is busy: only c0 is left, in another layer-2 domain
  const Placement farther = PlaceReplacement(Request(4, 2), Cluster(nodes), gang, 3);
  ASSERT_TRUE(farther.ok()) << farther.reason;
  EXPECT_EQ(farther.nodes[3], "c0");

  PlacementRequest required = Request(4, 2, /*required=*/true);
  required.required_level = kLevels[1];  // the gang must stay in layer-2 domain p1
  const Placement refused = PlaceReplacement(required, Cluster(nodes), gang, 3);
  EXPECT_FALSE(refused.ok());
  EXPECT_EQ(refused.reason,
            "no node can replace b1: none of the 1 eligible nodes outside the gang is in its " + kLevels[1] +
                " domain p1");

  nodes[5].ready = false;
  const Placement none = PlaceReplacement(Request(4, 2), Cluster(nodes), gang, 3);
  EXPECT_EQ(none.reason, "no node can replace b1: every eligible node holds the gang already");
}

// What is in use as the operator counts it, by node index: counters that change between
// two placements on one topology.
class CountedUsage : public NodeUsage {
 public:
  explicit CountedUsage(size_t nodes) : gpus(nodes), efa(nodes) {}
  int64_t GpusUsed(size_t node) const override { return gpus[node]; }
  int64_t EfaUsed(size_t node) const override { return efa[node]; }
  std::vector<int64_t> gpus, efa;
};

TEST(Topology, IndexesEachDomainByItsWholePathInPathOrder) {
  // rack-a under p1 and rack-a under p2 are two domains; x4 lacks its layer-3 label.
  std::vector<ClusterNode> nodes = {Node("x0", "s1", "p2", "rack-a"), Node("x1", "s1", "p1", "rack-a"),
                                    Node("x2", "s1", "p1", "rack-b"), Node("x3", "s1", "p1", "rack-a"),
                                    Node("x4", "s1", "p1", "")};
  nodes[4].labels.erase(kLevels[2]);
  const Topology topology(nodes);
  const std::shared_ptr<const TopologyIndex> index = topology.Index(kLevels);
  std::vector<std::string> order;
  for (const uint32_t i : index->order) order.push_back(topology.nodes()[i].name);
  EXPECT_EQ(order, (std::vector<std::string>{"x1", "x3", "x2", "x4", "x0"}));
  ASSERT_EQ(index->levels(), 4u);
  EXPECT_EQ(index->key[2], (std::vector<std::string>{"s1/p1/rack-a", "s1/p1/rack-b", "s1/p1/unlabelled:x4",
                                                     "s1/p2/rack-a"}));
  EXPECT_EQ(index->domain[2], (std::vector<uint32_t>{0, 0, 1, 2, 3}));
  EXPECT_EQ(index->parent[2], (std::vector<uint32_t>{0, 0, 0, 1}));
  EXPECT_EQ(index->key[1], (std::vector<std::string>{"s1/p1", "s1/p2"}));
  EXPECT_EQ(topology.Index(kLevels), index) << "an index is computed once per list of levels";
  EXPECT_EQ(topology.Find("x3"), std::optional<size_t>(3));
  EXPECT_EQ(topology.Find("x9"), std::nullopt);
}

TEST(Topology, APlacementReadsWhatIsInUseAsItIsNow) {
  auto topology = std::make_shared<const Topology>(TwoRacks(6, 4).nodes);
  auto usage = std::make_shared<CountedUsage>(topology->size());
  const ClusterView view{topology, usage};
  EXPECT_EQ(Place(Request(4), view).domain, "s1/p1/rack-b");
  usage->gpus[*topology->Find("b1")] = 1;  // rack-b holds only 3 now
  const Placement moved = Place(Request(4), view);
  EXPECT_EQ(moved.domain, "s1/p1/rack-a");
  EXPECT_EQ(moved.nodes, (std::vector<std::string>{"a0", "a1", "a2", "a3"}));
  // The same, with b1's GPUs counted free again (a gang asking whether it could grow).
  const ClusterView released{topology,
                             std::make_shared<ReleasedUsage>(usage, std::map<size_t, ReleasedUsage::Released>{
                                                                        {*topology->Find("b1"), {1, 0}}})};
  EXPECT_EQ(Place(Request(4), released).domain, "s1/p1/rack-b");
  usage->efa[*topology->Find("b2")] = 30;
  PlacementRequest efa = Request(4);
  efa.efa_per_node = 4;
  EXPECT_EQ(Place(efa, released).domain, "s1/p1/rack-a");
  // A refusal counts every node's reason with the usage as it is.
  EXPECT_EQ(Place(Request(10), view).reason,
            "needs 10 nodes with 8 free GPUs; only 9 of 10 nodes are eligible (1 with too few free GPUs)");
}

TEST(Topology, TheNodesAdmittedFollowEachRequestsSelectorAndTolerations) {
  std::vector<ClusterNode> nodes = {Node("a0", "s1", "p1", "rack-a"), Node("a1", "s1", "p1", "rack-a"),
                                    Node("a2", "s1", "p1", "rack-a")};
  nodes[0].taints.push_back({"nvidia.com/gpu", "present", "NoSchedule"});
  nodes[1].labels["pool"] = "big";
  nodes[2].gpus_used = 8;  // in use, but that is not the topology's to say
  const Topology topology(nodes);
  PlacementRequest plain = Request(1);
  EXPECT_EQ(*topology.Admitting(plain), (std::vector<uint32_t>{1, 2}));
  PlacementRequest tolerating = plain;
  tolerating.tolerations.push_back({"nvidia.com/gpu", "Exists", "", "", std::nullopt});
  EXPECT_EQ(*topology.Admitting(tolerating), (std::vector<uint32_t>{0, 1, 2}));
  PlacementRequest selecting = plain;
  selecting.node_selector["pool"] = "big";
  EXPECT_EQ(*topology.Admitting(selecting), (std::vector<uint32_t>{1}));
  EXPECT_EQ(topology.Admitting(plain), topology.Admitting(plain));
}

TEST(Placement, RankTableHoldsConsecutiveRanks) {
  const Placement p = Place(Request(2), TwoRacks(2, 0));
  const api::RankTable table = MakeRankTable(p, kLevels, 8);
  ASSERT_EQ(table.nodes.size(), 2u);
  EXPECT_EQ(table.nodes[1].ranks, (std::vector<int64_t>{8, 9, 10, 11, 12, 13, 14, 15}));
  EXPECT_EQ(table.nodes[1].topology_path, p.paths[1]);
  api::FieldErrors errors;
  EXPECT_EQ(api::DecodeRankTable(api::ToJson(table), &errors), table);
  EXPECT_TRUE(errors.empty());
  nlohmann::json broken = api::ToJson(table);
  broken["nodes"][1]["ranks"][0] = 0;
  api::DecodeRankTable(broken, &errors);
  ASSERT_EQ(errors.size(), 1u);
  EXPECT_EQ(errors[0].path, "nodes[1].ranks");
}

TEST(Placement, RequestFromJobUsesItsLayout) {
  const auto jobs = api::LoadTrainingJobs("examples/gpt2-2p7b-32x8.yaml");
  ASSERT_TRUE(jobs[0].ok());
  const PlacementRequest r = PlacementRequest::ForJob(jobs[0].job, {"bad-node"});
  EXPECT_EQ(r.nodes, 32);
  EXPECT_EQ(r.nodes_per_shard_group, 16);
  EXPECT_TRUE(r.required);
  EXPECT_EQ(r.required_level, "topology.k8s.aws/network-node-layer-2");
  EXPECT_EQ(r.efa_per_node, 32);
  EXPECT_TRUE(r.avoid.contains("bad-node"));
  EXPECT_EQ(r.tolerations.size(), 1u);
}

TEST(Placement, TensorParallelLargerThanANodeIsRefusedByValidation) {
  nlohmann::json manifest = api::ReadManifestFile("examples/gpt2-2p7b-32x8.yaml")[0].object;
  manifest["spec"]["parallelism"]["tensorParallelDegree"] = 16;
  const api::CheckedJob checked = api::CheckTrainingJob(manifest, "x.yaml", 0);
  ASSERT_FALSE(checked.ok());
  EXPECT_EQ(checked.errors[0].ToString(), "spec.parallelism.tensorParallelDegree: must divide spec.gpusPerNode (8), got 16");
}

}  // namespace
}  // namespace meshtrain::scheduler::placement_test
