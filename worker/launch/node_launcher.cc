#include "worker/launch/node_launcher.h"

#include "api/environment.h"

#include <stdexcept>

namespace meshtrain::launch {
namespace {

int IntegerVariable(const char* name, int minimum) {
  return static_cast<int>(api::EnvironmentInteger(name, minimum, 1 << 20));
}

}  // namespace

std::vector<RankProcess> RanksOfThisNode() {
  const int node_rank = IntegerVariable("MESHTRAIN_NODE_RANK", 0);
  const int nodes = IntegerVariable("MESHTRAIN_NNODES", 1);
  const int per_node = IntegerVariable("MESHTRAIN_NPROC_PER_NODE", 1);
  if (node_rank >= nodes) {
    throw std::runtime_error("MESHTRAIN_NODE_RANK=" + std::to_string(node_rank) + " is not below MESHTRAIN_NNODES=" +
                             std::to_string(nodes));
  }
  std::vector<RankProcess> ranks;
  for (int local = 0; local < per_node; ++local) {
    RankProcess process;
    process.rank = node_rank * per_node + local;
    process.environment = {{"RANK", std::to_string(process.rank)},
                           {"LOCAL_RANK", std::to_string(local)},
                           {"WORLD_SIZE", std::to_string(nodes * per_node)},
                           {"LOCAL_WORLD_SIZE", std::to_string(per_node)},
                           {"NODE_RANK", std::to_string(node_rank)}};
    ranks.push_back(std::move(process));
  }
  return ranks;
}

int LaunchNode(const NodeLaunch& launch, std::ostream& log) {
  ProcessGroupOptions options;
  options.command = launch.command;
  options.grace = launch.grace;
  options.forward_signals = true;
  const std::vector<RankProcess> ranks = RanksOfThisNode();
  log << "launching ranks " << ranks.front().rank << ".." << ranks.back().rank << " of this node" << std::endl;
  const LaunchResult result = RunProcessGroup(ranks, options, log);
  return result.status;
}

}  // namespace meshtrain::launch
