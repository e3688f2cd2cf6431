#include "worker/launch/local_launcher.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <stdexcept>

#include "api/environment.h"
#include "api/worker_contract.h"
#include "worker/comm/store.h"
#include "worker/launch/memory_file.h"

namespace meshtrain::launch {

namespace env = api::worker::env;

int FreeLoopbackPort() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof(addr);
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &length) != 0) {
    if (fd >= 0) ::close(fd);
    throw std::runtime_error(std::string("cannot find a free port: ") + std::strerror(errno));
  }
  ::close(fd);
  return ntohs(addr.sin_port);
}

std::vector<std::string> SelfCommand(int argc, char** argv) {
  std::vector<std::string> command(argv, argv + argc);
  if (const std::filesystem::path self = api::ThisProgram(); !self.empty()) command[0] = self.string();
  return command;
}

api::RankTable VirtualRankTable(int nodes, int ranks_per_node) {
  api::RankTable table;
  table.levels = {"kubernetes.io/hostname"};
  for (int n = 0; n < nodes; ++n) {
    api::RankTableNode node;
    node.node_rank = n;
    node.name = "virtual-node-" + std::to_string(n);
    node.topology_path = {node.name};
    for (int r = 0; r < ranks_per_node; ++r) node.ranks.push_back(n * ranks_per_node + r);
    table.nodes.push_back(node);
  }
  return table;
}

std::string NetbedAddress(int node) { return "198.18.0." + std::to_string(node + 1); }

LaunchResult LaunchLocal(const LocalLaunch& launch, std::ostream& log) {
  if (launch.nodes < 1 || launch.ranks_per_node < 1 || launch.command.empty()) {
    throw std::runtime_error("a launch needs at least one node, one rank per node and a command");
  }
  const int world = launch.nodes * launch.ranks_per_node;
  if (!launch.netbed.empty()) {
    for (int n = 0; n < launch.nodes; ++n) {
      const std::string ns = launch.netbed + "-" + std::to_string(launch.NetbedHost(n));
      if (!std::filesystem::exists("/run/netns/" + ns))
        throw std::runtime_error("testbed " + launch.netbed + " has no node " + std::to_string(launch.NetbedHost(n)) +
                                 " (no network namespace " +
                                 ns + "; run scripts/netbed.sh up " + launch.netbed + " " +
                                 std::to_string(launch.nodes) + " RATE)");
    }
  }
  // The rank table, and a key of its own for each launch (the ranks' Store admits no one
  // else), live in memory and go with this process and its ranks.
  MemoryFile table("meshtrain-rank-table", MemoryFile::Sharing::kInherited);
  table.Write(
      api::ToJson(launch.rank_table.value_or(VirtualRankTable(launch.nodes, launch.ranks_per_node))).dump(2));
  MemoryFile key("meshtrain-store-key", MemoryFile::Sharing::kInherited);
  key.Write(comm::NewStoreKey());
  const std::string coordinator = (launch.netbed.empty() ? "127.0.0.1" : NetbedAddress(launch.NetbedHost(0))) + ":" +
                                  std::to_string(FreeLoopbackPort());

  std::vector<RankProcess> ranks;
  for (int rank = 0; rank < world; ++rank) {
    RankProcess process{rank, launch.environment, ""};
    auto& variables = process.environment;
    variables[env::kJobName] = launch.job_name;
    variables[env::kCoordinator] = coordinator;
    variables[env::kRankTable] = table.path();
    variables[env::kStoreKeyFile] = key.path();
    variables[env::kNodeRank] = std::to_string(rank / launch.ranks_per_node);
    variables[env::kNodes] = std::to_string(launch.nodes);
    variables[env::kRanksPerNode] = std::to_string(launch.ranks_per_node);
    variables[env::kRank] = std::to_string(rank);
    variables[env::kWorldSize] = std::to_string(world);
    variables[env::kLocalRank] = std::to_string(rank % launch.ranks_per_node);
    variables[env::kMasterAddr] = coordinator.substr(0, coordinator.rfind(':'));
    if (!launch.netbed.empty()) {
      process.network_namespace = launch.netbed + "-" + std::to_string(launch.NetbedHost(rank / launch.ranks_per_node));
      variables["FI_TCP_IFACE"] = "eth0";  // the testbed link, not loopback
    }
    variables[env::kMasterPort] = coordinator.substr(coordinator.rfind(':') + 1);
    ranks.push_back(std::move(process));
  }
  ProcessGroupOptions options;
  options.command = launch.command;
  options.grace = launch.grace;
  options.timeout = launch.timeout;
  options.stop_others_on_failure = launch.stop_others_on_failure;
  options.forward_signals = true;  // the ranks end with this process
  LaunchResult result = RunProcessGroup(ranks, options, log);
  if (result.stop_signal != 0) {
    // Stopped from outside: once its ranks are gone, this process takes the
    // signal as it would have without the launch (a loop of launches ends with it).
    log << "stopped by signal " << result.stop_signal << "; the ranks were stopped with it" << std::endl;
    ::raise(result.stop_signal);
  }
  return result;
}

}  // namespace meshtrain::launch
