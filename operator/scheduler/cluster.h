// A snapshot of the cluster's GPU nodes, as placement sees it.
//
// Built from `kubectl get nodes -o json` plus `kubectl get pods -A -o json`, or
// from a compact YAML description (for tests and planning):
//
//   nodes:
//   - name: ip-10-0-1-17
//     labels: {topology.k8s.aws/network-node-layer-1: nn-1a, ...}
//     gpus: 8          # allocatable nvidia.com/gpu
//     gpusUsed: 2      # requested by non-terminated pods
//     efa: 32          # allocatable vpc.amazonaws.com/efa
//     taints: [{key: nvidia.com/gpu, effect: NoSchedule}]
//     ready: true
//     schedulable: true   # false when cordoned
//
// Snapshots are plain values; nodes are kept sorted by name.

#pragma once

#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace meshtrain::scheduler {

struct Taint {
  std::string key;
  std::string value;
  std::string effect;  // NoSchedule | PreferNoSchedule | NoExecute
  bool operator==(const Taint&) const = default;
};

struct ClusterNode {
  std::string name;
  std::map<std::string, std::string> labels;
  int64_t gpus = 0;
  int64_t gpus_used = 0;
  int64_t efa = 0;
  int64_t efa_used = 0;
  std::vector<Taint> taints;
  bool ready = true;
  bool schedulable = true;

  int64_t FreeGpus() const { return gpus - gpus_used; }
  int64_t FreeEfa() const { return efa - efa_used; }
  bool operator==(const ClusterNode&) const = default;
};

struct ClusterSnapshot {
  std::vector<ClusterNode> nodes;  // sorted by name, names unique
  bool operator==(const ClusterSnapshot&) const = default;
};

// A snapshot that cannot be built; what() names the file, node or field.
class ClusterError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A countable resource ("8" or 8) from a resources map such as status.allocatable; 0 if
// absent. Throws ClusterError naming `where` for anything else.
int64_t ResourceQuantity(const nlohmann::json& resources, const char* name, const std::string& where);

// What a pod spec asks of a resource: its containers' sum (requests, else limits), or an
// init container's if larger. Throws ClusterError naming `where`.
int64_t PodRequest(const nlohmann::json& pod_spec, const char* resource, const std::string& where);

// One Node object as placement sees it (gpus_used and efa_used 0). Throws ClusterError
// for a field of the wrong type or an allocatable count that is not a whole number.
ClusterNode NodeFromKubectl(const nlohmann::json& node);

// From kubectl's NodeList and PodList JSON. Pods that are Succeeded or Failed hold
// no GPUs; a pod's request is the larger of its containers' sum and any init container's.
ClusterSnapshot SnapshotFromKubectl(const nlohmann::json& node_list, const nlohmann::json& pod_list);

// From the compact description above (YAML or JSON text).
ClusterSnapshot SnapshotFromDescription(const nlohmann::json& description, const std::string& source);

// Reads a compact description file. Throws ClusterError.
ClusterSnapshot ReadClusterFile(const std::string& path);

// Reads kubectl's nodes and (optional, may be "") pods JSON files. Throws ClusterError.
ClusterSnapshot ReadKubectlFiles(const std::string& nodes_path, const std::string& pods_path);

// The compact description of a snapshot; SnapshotFromDescription inverts it.
nlohmann::json ToDescription(const ClusterSnapshot& snapshot);

}  // namespace meshtrain::scheduler
