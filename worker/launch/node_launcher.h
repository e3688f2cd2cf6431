// `meshtrain-worker launch`: the entry point of a pod (DESIGN.md, "Worker contract").
// It starts one rank process per GPU of this node with the torchrun variables (RANK,
// LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, NODE_RANK) added to the pod's environment,
// passes the kubelet's SIGTERM on to them, and tears all of them down when one fails.
// Its exit status is the first failed rank's, so a rank's permanent-error code (78)
// reaches the operator unchanged.

#pragma once

#include <chrono>
#include <ostream>
#include <string>
#include <vector>

#include "worker/launch/process_group.h"

namespace meshtrain::launch {

// The ranks of this node from MESHTRAIN_NODE_RANK, MESHTRAIN_NNODES and
// MESHTRAIN_NPROC_PER_NODE. Throws std::runtime_error naming a missing or malformed variable.
std::vector<RankProcess> RanksOfThisNode();

struct NodeLaunch {
  std::vector<std::string> command;  // argv of every rank
  // SIGTERM to SIGKILL; below the pod's 120 s termination grace so ranks can checkpoint.
  std::chrono::milliseconds grace{100'000};
};

// Runs this node's ranks; returns the exit status for the pod.
int LaunchNode(const NodeLaunch& launch, std::ostream& log);

}  // namespace meshtrain::launch
