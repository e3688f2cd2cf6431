#include "operator/scheduler/synthetic_cluster.h"

#include <algorithm>
#include <random>
#include <set>

namespace meshtrain::scheduler {

ClusterSnapshot MakeSyntheticCluster(const SyntheticClusterOptions& o) {
  std::mt19937_64 rng(o.seed);
  auto uniform = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  auto chance = [&](double p) { return std::uniform_real_distribution<double>(0, 1)(rng) < p; };

  ClusterSnapshot snapshot;
  std::set<std::string> names;
  int layer3 = 0;
  while (int(snapshot.nodes.size()) < o.nodes) {
    const int in_domain = std::min(uniform(o.min_layer3_nodes, o.max_layer3_nodes), o.nodes - int(snapshot.nodes.size()));
    const int layer2 = layer3 / o.layer3_per_layer2;
    const int layer1 = layer2 / o.layer2_per_layer1;
    for (int i = 0; i < in_domain; ++i) {
      ClusterNode node;
      do {
        node.name = "ip-10-" + std::to_string(uniform(0, 255)) + "-" + std::to_string(uniform(0, 255)) + "-" +
                    std::to_string(uniform(1, 254));
      } while (!names.insert(node.name).second);
      node.labels = {{"topology.k8s.aws/network-node-layer-1", "nn-l1-" + std::to_string(layer1)},
                     {"topology.k8s.aws/network-node-layer-2", "nn-l2-" + std::to_string(layer2)},
                     {"topology.k8s.aws/network-node-layer-3", "nn-l3-" + std::to_string(layer3)},
                     {"kubernetes.io/hostname", node.name}};
      if (chance(o.unlabelled_fraction)) {
        node.labels.erase("topology.k8s.aws/network-node-layer-" + std::to_string(uniform(1, 3)));
      }
      node.gpus = o.gpus_per_node;
      node.efa = o.efa_per_node;
      node.ready = !chance(o.not_ready_fraction);
      node.schedulable = !chance(o.cordoned_fraction);
      if (chance(o.tainted_fraction)) node.taints.push_back({"nvidia.com/gpu", "present", "NoSchedule"});
      snapshot.nodes.push_back(std::move(node));
    }
    ++layer3;
  }

  // Existing load: pods of whole nodes most often, placed at random where they fit.
  const int64_t target = int64_t(o.gpu_used_fraction * double(o.nodes) * o.gpus_per_node);
  const int pod_sizes[] = {8, 8, 8, 4, 2, 1};
  int64_t used = 0;
  for (int attempts = 0; used < target && attempts < 100 * o.nodes; ++attempts) {
    const int64_t size = std::min<int64_t>(pod_sizes[uniform(0, 5)], target - used);
    ClusterNode& node = snapshot.nodes[uniform(0, o.nodes - 1)];
    if (node.FreeGpus() < size) continue;
    node.gpus_used += size;
    used += size;
  }
  std::sort(snapshot.nodes.begin(), snapshot.nodes.end(),
            [](const ClusterNode& a, const ClusterNode& b) { return a.name < b.name; });
  return snapshot;
}

}  // namespace meshtrain::scheduler
