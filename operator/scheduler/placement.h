// Topology-aware gang placement and node-rank order. Pure functions of a request
// and a cluster (a ClusterView: a topology and what is in use on it, or a snapshot):
// the same inputs always give the same placement.
//
// Placement is all or nothing. It picks the deepest topology domain that can hold
// the whole gang (best fit among equals: the one left with the fewest free nodes,
// preferring domains whose deepest network domains can hold whole stages and shard
// groups), then selects nodes inside it level by level, in whole pipeline stages and
// then whole shard groups where sizes allow. The order of selection is the node-rank
// order, so consecutive node ranks share the deepest domain, and each stage (R x S x T)
// and each shard group sits under one domain when it can.
//
// On a ClusterView it costs one pass over the nodes the request's selector and
// tolerations admit (Topology::Admitting) with integer work per node and level, plus
// the selection inside the chosen domain; the nodes' order and domains come from the
// topology's index. Only a refusal looks at every node's labels, to say why.

#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "api/rank_table.h"
#include "api/training_job.h"
#include "operator/scheduler/cluster.h"
#include "operator/scheduler/topology.h"

namespace meshtrain::scheduler {

struct PlacementRequest {
  int64_t nodes = 1;
  int64_t gpus_per_node = 1;
  int64_t efa_per_node = 0;
  std::vector<api::Toleration> tolerations;
  std::map<std::string, std::string> node_selector;
  std::vector<std::string> levels;  // node-label keys, outermost first
  bool required = false;            // the gang must share one domain of required_level
  std::string required_level;
  int64_t nodes_per_shard_group = 1;  // placement unit: S*T/G nodes, at least 1
  int64_t nodes_per_stage = 0;        // a pipeline stage's R*S*T/G nodes; 0: one stage, the gang
  std::set<std::string> avoid;        // nodes not to use, such as ones that failed the job recently

  // REQUIRES: `job` is defaulted and valid.
  static PlacementRequest ForJob(const api::TrainingJob& job, std::set<std::string> avoid = {});
};

struct Placement {
  // One entry per node rank: the node and its topology path (one domain name per level;
  // a node without a level's label is alone in its own domain there).
  std::vector<std::string> nodes;
  std::vector<std::vector<std::string>> paths;
  int domain_level = -1;  // the level whose one domain holds the gang; -1: the whole cluster
  std::string domain;     // that domain, as "a/b/c"
  std::string reason;     // why there is no placement; empty when placed

  bool ok() const { return reason.empty(); }
  bool operator==(const Placement&) const = default;
};

// Whether `node` can take one of the gang's pods, with the GPUs and EFA interfaces its
// gpus_used and efa_used say are in use, and if not, why (e.g. "not Ready").
std::string Ineligibility(const PlacementRequest& request, const ClusterNode& node);

// Whether `node` could take one of the gang's pods were all it has free and it not
// avoided: it is Ready and schedulable, matches the node selector and tolerates its taints.
bool Admits(const PlacementRequest& request, const ClusterNode& node);

// The topology path of a node for `levels`.
std::vector<std::string> TopologyPath(const ClusterNode& node, const std::vector<std::string>& levels);

Placement Place(const PlacementRequest& request, const ClusterView& cluster);
Placement Place(const PlacementRequest& request, const ClusterSnapshot& snapshot);

// A node for node rank `lost` of the placed `gang`, whose node is lost: the eligible node
// outside the gang whose topology path shares the most levels with the lost node's, so
// that the node-rank order keeps its meaning; among equals, the first by path and name.
// With topology mode Required, only a node in the gang's domain of required_level will do.
// Returns `gang` with that node and its path at `lost`, or a placement whose reason says
// why none qualifies. `request` is the gang's; its node count is ignored.
Placement PlaceReplacement(const PlacementRequest& request, const ClusterView& cluster, const Placement& gang,
                           size_t lost);
Placement PlaceReplacement(const PlacementRequest& request, const ClusterSnapshot& snapshot, const Placement& gang,
                           size_t lost);

// A topology-blind scheduler: the first eligible nodes in name order.
Placement PlaceBlind(const PlacementRequest& request, const ClusterSnapshot& snapshot);

// The same nodes as `placement`, in name order.
Placement InNameOrder(const Placement& placement);

// Node rank i holds ranks [i*G, (i+1)*G).
api::RankTable MakeRankTable(const Placement& placement, const std::vector<std::string>& levels,
                             int64_t gpus_per_node);

}  // namespace meshtrain::scheduler
