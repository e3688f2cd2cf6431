// The cluster as placement reads it, split in two: an immutable Topology of the nodes
// (names, labels, allocatable GPUs and EFA interfaces, taints, readiness), shared between
// threads and rebuilt only when a node changes, and a NodeUsage that says what is in use
// on each of its nodes now (live counters, or a snapshot's). A placement reads both and
// copies neither.
//
// A Topology answers what every placement of a job would otherwise recompute: for a list
// of topology levels, the nodes in topology-path order with each node's domain at each
// level as a small integer (TopologyIndex); and for a request's levels, node selector and
// tolerations, the nodes that can ever take its pods, whatever is in use (Admitting). Both
// are computed on first use and kept.
//
// Thread-safety: a Topology is immutable but for those memos, which are guarded, so one
// may be read from any number of threads. NodeUsage implementations say their own.

#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "operator/scheduler/cluster.h"

namespace meshtrain::scheduler {

struct PlacementRequest;

// The nodes in topology-path order for one list of levels (outermost first), and each
// node's domain at each level.
struct TopologyIndex {
  // Node indices (into Topology::nodes()) sorted by topology path, then name.
  std::vector<uint32_t> order;
  // domain[l][p]: the domain id at level l of the node at position p of `order`. Ids of one
  // level count from 0 in path order; a domain is its whole path prefix, so two domains of
  // one name under different parents have different ids.
  std::vector<std::vector<uint32_t>> domain;
  // key[l][id]: the domain's path prefix as "a/b/c".
  std::vector<std::vector<std::string>> key;
  // parent[l][id]: the id at level l-1 of the domain that holds it (parent[0] is empty).
  std::vector<std::vector<uint32_t>> parent;

  size_t levels() const { return domain.size(); }
};

class Topology {
 public:
  // `nodes` with unique names; gpus_used and efa_used are kept but a NodeUsage says what
  // is in use. Sorted by name here.
  explicit Topology(std::vector<ClusterNode> nodes);
  Topology(const Topology&) = delete;
  Topology& operator=(const Topology&) = delete;

  const std::vector<ClusterNode>& nodes() const { return nodes_; }
  size_t size() const { return nodes_.size(); }
  // The index of the node named `name`, if there is one.
  std::optional<size_t> Find(std::string_view name) const;

  std::shared_ptr<const TopologyIndex> Index(const std::vector<std::string>& levels) const;
  // Positions in Index(request.levels)->order of the nodes that are Ready, schedulable,
  // match the request's node selector and tolerate its taints: those a pod of the request
  // could take were they free. Ascending.
  std::shared_ptr<const std::vector<uint32_t>> Admitting(const PlacementRequest& request) const;

 private:
  std::vector<ClusterNode> nodes_;  // sorted by name
  mutable std::mutex mu_;
  // At most kMaxMemos of each; when full, they start over (what was handed out stays valid).
  mutable std::map<std::vector<std::string>, std::shared_ptr<const TopologyIndex>> indexes_;
  mutable std::map<std::string, std::shared_ptr<const std::vector<uint32_t>>> admitting_;
};

// What is in use on each node of one Topology, by node index.
class NodeUsage {
 public:
  virtual ~NodeUsage() = default;
  virtual int64_t GpusUsed(size_t node) const = 0;
  virtual int64_t EfaUsed(size_t node) const = 0;
};

// The gpus_used and efa_used that the topology's nodes carry (a ClusterSnapshot's).
class RecordedUsage : public NodeUsage {
 public:
  explicit RecordedUsage(std::shared_ptr<const Topology> topology) : topology_(std::move(topology)) {}
  int64_t GpusUsed(size_t node) const override { return topology_->nodes()[node].gpus_used; }
  int64_t EfaUsed(size_t node) const override { return topology_->nodes()[node].efa_used; }

 private:
  std::shared_ptr<const Topology> topology_;
};

// `base`, less what some nodes would have free again (a gang's own pods, when it asks
// whether it could grow in place).
class ReleasedUsage : public NodeUsage {
 public:
  struct Released {
    int64_t gpus = 0, efa = 0;
  };
  ReleasedUsage(std::shared_ptr<const NodeUsage> base, std::map<size_t, Released> released)
      : base_(std::move(base)), released_(std::move(released)) {}
  int64_t GpusUsed(size_t node) const override;
  int64_t EfaUsed(size_t node) const override;

 private:
  std::shared_ptr<const NodeUsage> base_;
  std::map<size_t, Released> released_;
};

// A topology and what is in use on it: what placement reads.
struct ClusterView {
  std::shared_ptr<const Topology> topology;
  std::shared_ptr<const NodeUsage> usage;

  // A view of a snapshot: its nodes, and the use they record.
  static ClusterView Of(const ClusterSnapshot& snapshot);
  // The node named `name` (null when the topology has none).
  const ClusterNode* Node(std::string_view name) const;
};

}  // namespace meshtrain::scheduler
