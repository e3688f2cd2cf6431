// The two facts the ClusterState and Decide exchange: the state of a node, and what a pod
// the operator creates will hold on its node.
//
// Thread-safety: plain values.

#pragma once

#include <cstdint>
#include <string>

namespace meshtrain::controller {

// A Node as reconcile needs it.
enum class NodeState { kReady, kNotReady, kGone };

// What a pod the operator creates will hold on its node: taken before the pod is created
// (ClusterState::Reserve), so that no other gang is placed on the same GPUs meanwhile.
struct PodClaim {
  std::string pod;  // namespace/name
  std::string node;
  int64_t gpus = 0, efa = 0;
  bool operator==(const PodClaim&) const = default;
};

}  // namespace meshtrain::controller
