// An alpha-beta model of one training step's communication for a placement.
//
// Each group of the layout (DESIGN.md: TP, shard and replica groups) runs its
// collectives as rings over the slowest link its members span: NVLink inside a node,
// else the network link of the deepest topology domain all its nodes share. A ring
// of n ranks moving M bytes costs, per step of the ring, alpha + (M/n)/beta:
//   all-gather, reduce-scatter: (n-1) steps;  all-reduce: 2(n-1) steps.
// Groups of one kind run at the same time, so a kind costs its slowest group.
//
// Per step, with P parameters, A accumulation steps and bf16 parameters:
//   shard:   A x (2 all-gathers of 2P/T bytes [forward, backward] + 1 reduce-scatter of 4P/T bytes)
//   replica: 1 all-reduce of 4P/(T*S) bytes (the fp32 shard gradients)
//   tp:      A x 4 x layers all-reduces of microBatch x seqLen x hidden x 2 bytes (2 forward, 2 backward)

#pragma once

#include <map>
#include <string>
#include <vector>

#include "api/training_job.h"

namespace meshtrain::scheduler {

struct Link {
  std::string name;           // "nvlink", "within topology.k8s.aws/network-node-layer-3", "cluster"
  double bytes_per_second;    // per GPU
  double latency_seconds;
};

class LinkModel {
 public:
  // Defaults for EKS-like p5 clusters: NVLink 360 GB/s, 3 us; then, by the deepest shared
  // domain from the deepest network level outwards, 40, 25, 12.5 and 6.25 GB/s per GPU
  // at 15, 25, 40 and 60 us.
  explicit LinkModel(std::vector<std::string> levels);

  // The link called `which`: "nvlink", a level key (nodes sharing that level's domain
  // and no deeper one), or "cluster" (nodes sharing no domain); nullptr if none.
  const Link* Find(const std::string& which) const;

  // Replaces the figures of the link called `which`. Returns false if there is none.
  bool Override(const std::string& which, double bytes_per_second, double latency_seconds);

  const Link& IntraNode() const { return intra_node_; }
  // The link between different nodes whose paths share their first `shared_levels` entries.
  const Link& BetweenNodes(size_t shared_levels) const;
  const std::vector<std::string>& levels() const { return levels_; }

 private:
  std::vector<std::string> levels_;
  Link intra_node_;
  std::vector<Link> by_shared_;  // index: shared levels, 0 (cluster) .. levels
};

struct AxisCost {
  std::string axis;                       // "tp", "shard", "replica"
  double seconds = 0;                     // per step, the slowest group
  std::map<std::string, int> groups_by_link;  // how many groups use each link
};

struct StepCost {
  double seconds = 0;
  std::vector<AxisCost> axes;
};

// REQUIRES: `spec` is defaulted and valid; node_paths has one path per node rank.
StepCost EstimateStepCost(const api::TrainingJobSpec& spec, const std::vector<std::vector<std::string>>& node_paths,
                          const LinkModel& links);

}  // namespace meshtrain::scheduler
