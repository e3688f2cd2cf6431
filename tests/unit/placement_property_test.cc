// Placement properties over hundreds of random clusters and jobs.

#include <random>
#include <set>

#include <gtest/gtest.h>

#include "api/json_codec.h"
#include "api/layout.h"
#include "api/manifest.h"
#include "operator/scheduler/cost_model.h"
#include "operator/scheduler/placement.h"
#include "operator/scheduler/synthetic_cluster.h"

namespace meshtrain::scheduler {
namespace {

struct Scenario {
  ClusterSnapshot cluster;
  api::TrainingJob job;
};

Scenario RandomScenario(uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  SyntheticClusterOptions o;
  o.nodes = pick(40, 300);
  o.min_layer3_nodes = pick(2, 16);
  o.max_layer3_nodes = o.min_layer3_nodes + pick(0, 16);
  o.layer3_per_layer2 = pick(1, 4);
  o.layer2_per_layer1 = pick(1, 4);
  o.gpu_used_fraction = pick(0, 50) / 100.0;
  o.not_ready_fraction = pick(0, 10) / 100.0;
  o.cordoned_fraction = pick(0, 10) / 100.0;
  o.tainted_fraction = pick(0, 20) / 100.0;
  o.unlabelled_fraction = pick(0, 10) / 100.0;
  o.seed = seed;

  api::TrainingJob job = api::LoadTrainingJobs("examples/gpt2-124m-2x8.yaml").at(0).job;
  api::TrainingJobSpec& spec = job.spec;
  spec.nodes = pick(1, 48);
  spec.gpus_per_node = 8;
  spec.parallelism.tensor_parallel_degree = 1 << pick(0, 2);  // divides the 12 heads
  // A random hybrid shard degree that forms a layout (0 = all data-parallel ranks).
  std::vector<int64_t> shards;
  const int64_t dp = spec.nodes * 8 / spec.parallelism.tensor_parallel_degree;
  for (int64_t s = 0; s <= dp; ++s) {
    if (api::ParallelLayout::Check(spec.nodes, 8, spec.parallelism.tensor_parallel_degree, s).empty()) shards.push_back(s);
  }
  spec.parallelism.hybrid_shard_degree = shards[pick(0, int(shards.size()) - 1)];
  spec.training.global_batch_tokens = spec.training.micro_batch_size * 1024 * dp;
  spec.topology.mode = pick(0, 1) ? "Required" : "Preferred";
  spec.template_.tolerations.clear();
  if (pick(0, 1)) spec.template_.tolerations.push_back({"nvidia.com/gpu", "Exists", "", "", std::nullopt});
  spec.template_.node_selector.clear();
  return {MakeSyntheticCluster(o), job};
}

TEST(PlacementProperties, HoldOnRandomClusters) {
  int placed = 0, refused = 0;
  for (uint64_t seed = 1; seed <= 400; ++seed) {
    SCOPED_TRACE(testing::Message() << "seed " << seed);
    const Scenario s = RandomScenario(seed);
    const api::CheckedJob checked = api::CheckTrainingJob(api::ToJson(s.job), "random", 0);
    ASSERT_TRUE(checked.ok()) << checked.errors.front().ToString();
    const PlacementRequest request = PlacementRequest::ForJob(checked.job);
    const Placement p = Place(request, s.cluster);

    // Deterministic, also when the nodes come in another order.
    EXPECT_EQ(Place(request, s.cluster), p);
    ClusterSnapshot shuffled = s.cluster;
    std::shuffle(shuffled.nodes.begin(), shuffled.nodes.end(), std::mt19937_64(seed));
    EXPECT_EQ(Place(request, SnapshotFromDescription(ToDescription(shuffled), "shuffled")), p);

    if (!p.ok()) {  // all or nothing
      ++refused;
      EXPECT_TRUE(p.nodes.empty());
      int64_t eligible = 0;
      for (const ClusterNode& n : s.cluster.nodes) eligible += Ineligibility(request, n).empty();
      if (!request.required) {
        EXPECT_LT(eligible, request.nodes) << p.reason;
      }
      continue;
    }
    ++placed;
    ASSERT_EQ(int64_t(p.nodes.size()), request.nodes);
    // Never over-commits: each node once, each with room.
    EXPECT_EQ(std::set<std::string>(p.nodes.begin(), p.nodes.end()).size(), p.nodes.size());
    for (const std::string& name : p.nodes) {
      auto it = std::find_if(s.cluster.nodes.begin(), s.cluster.nodes.end(), [&](const ClusterNode& n) { return n.name == name; });
      ASSERT_NE(it, s.cluster.nodes.end());
      EXPECT_EQ(Ineligibility(request, *it), "") << name;
    }
    if (request.required) {  // one domain at the required level
      for (const auto& path : p.paths) EXPECT_EQ(std::vector(path.begin(), path.begin() + 3), std::vector(p.paths[0].begin(), p.paths[0].begin() + 3));
    }
    // Never worse than a topology-blind order of the same nodes.
    const LinkModel links(request.levels);
    const double cost = EstimateStepCost(checked.job.spec, p.paths, links).seconds;
    const double blind = EstimateStepCost(checked.job.spec, InNameOrder(p).paths, links).seconds;
    EXPECT_LE(cost, blind * (1 + 1e-12));
  }
  // The generator must exercise both outcomes.
  EXPECT_GT(placed, 100);
  EXPECT_GT(refused, 10);
}

}  // namespace
}  // namespace meshtrain::scheduler
