#include "worker/launch/node_launcher.h"

#include "api/environment.h"
#include "api/worker_contract.h"

#include <stdexcept>

namespace meshtrain::launch {

namespace env = api::worker::env;

std::vector<RankProcess> RanksOfThisNode() {
  const int node_rank = api::EnvironmentRank(env::kNodeRank, 0);
  const int nodes = api::EnvironmentRank(env::kNodes, 1);
  const int per_node = api::EnvironmentRank(env::kRanksPerNode, 1);
  if (node_rank >= nodes) {
    throw std::runtime_error(std::string(env::kNodeRank) + "=" + std::to_string(node_rank) + " is not below " +
                             env::kNodes + "=" + std::to_string(nodes));
  }
  std::vector<RankProcess> ranks;
  for (int local = 0; local < per_node; ++local) {
    RankProcess process;
    process.rank = node_rank * per_node + local;
    process.environment = {{env::kRank, std::to_string(process.rank)},
                           {env::kLocalRank, std::to_string(local)},
                           {env::kWorldSize, std::to_string(nodes * per_node)},
                           {env::kLocalWorldSize, std::to_string(per_node)},
                           {env::kTorchNodeRank, std::to_string(node_rank)}};
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
