// Random EKS-like clusters for property tests and `meshtrain bench plan`.
//
// Three network layers (topology.k8s.aws/network-node-layer-1..3) over nodes named
// like EC2 hosts (ip-10-x-y-z), so that name order says nothing about topology.
// Existing load is placed as pods of 8, 4, 2 or 1 GPUs (whole-node pods most often)
// on random nodes until the requested share of GPUs is in use.

#pragma once

#include <cstdint>

#include "operator/scheduler/cluster.h"

namespace meshtrain::scheduler {

struct SyntheticClusterOptions {
  int nodes = 2000;
  int gpus_per_node = 8;
  int efa_per_node = 32;
  int min_layer3_nodes = 16;  // nodes under one layer-3 domain
  int max_layer3_nodes = 32;
  int layer3_per_layer2 = 4;
  int layer2_per_layer1 = 4;
  double gpu_used_fraction = 0.2;
  double not_ready_fraction = 0;
  double cordoned_fraction = 0;
  double tainted_fraction = 0;     // carry nvidia.com/gpu=present:NoSchedule
  double unlabelled_fraction = 0;  // miss a random topology label
  uint64_t seed = 1;
};

ClusterSnapshot MakeSyntheticCluster(const SyntheticClusterOptions& options);

}  // namespace meshtrain::scheduler
