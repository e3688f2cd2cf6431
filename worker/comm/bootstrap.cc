#include "worker/comm/bootstrap.h"

#include "api/environment.h"
#include "api/worker_contract.h"

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <stdexcept>

namespace meshtrain::comm {

namespace env = api::worker::env;
bool WorkerEnvironment::Present() { return std::getenv(env::kCoordinator) != nullptr; }

WorkerEnvironment WorkerEnvironment::FromEnvironment() {
  WorkerEnvironment out;
  out.job_name = api::EnvironmentString(env::kJobName);
  out.coordinator = api::EnvironmentString(env::kCoordinator);
  if (out.coordinator.empty()) throw std::runtime_error(std::string("the worker environment lacks ") + env::kCoordinator);
  out.config = api::EnvironmentString(env::kConfig);
  out.store_key_file = api::EnvironmentString(env::kStoreKeyFile);
  out.rank_table = api::EnvironmentString(env::kRankTable);
  if (out.rank_table.empty()) throw std::runtime_error(std::string("the worker environment lacks ") + env::kRankTable);
  out.node_rank = api::EnvironmentRank(env::kNodeRank, 0);
  out.nnodes = api::EnvironmentRank(env::kNodes, 1);
  out.nproc_per_node = api::EnvironmentRank(env::kRanksPerNode, 1);
  out.rank = api::EnvironmentRank(env::kRank, 0);
  out.world_size = api::EnvironmentRank(env::kWorldSize, 1);
  out.local_rank = api::EnvironmentRank(env::kLocalRank, 0);
  if (out.world_size != out.nnodes * out.nproc_per_node || out.rank >= out.world_size ||
      out.node_rank >= out.nnodes || out.local_rank >= out.nproc_per_node ||
      out.rank != out.node_rank * out.nproc_per_node + out.local_rank) {
    throw std::runtime_error(
        "inconsistent worker environment: RANK=" + std::to_string(out.rank) +
        " WORLD_SIZE=" + std::to_string(out.world_size) + " LOCAL_RANK=" +
        std::to_string(out.local_rank) + " MESHTRAIN_NODE_RANK=" + std::to_string(out.node_rank) +
        " MESHTRAIN_NNODES=" + std::to_string(out.nnodes) +
        " MESHTRAIN_NPROC_PER_NODE=" + std::to_string(out.nproc_per_node));
  }
  return out;
}

Rendezvous JoinRendezvous(const WorkerEnvironment& environment, milliseconds timeout) {
  Rendezvous rendezvous;
  std::ifstream file(environment.rank_table);
  if (!file) throw std::runtime_error("cannot read the rank table " + environment.rank_table);
  std::stringstream text;
  text << file.rdbuf();
  nlohmann::json json = nlohmann::json::parse(text.str(), nullptr, /*allow_exceptions=*/false);
  if (json.is_discarded()) {
    throw std::runtime_error("the rank table " + environment.rank_table + " is not valid JSON");
  }
  api::FieldErrors errors;
  rendezvous.table = api::DecodeRankTable(json, &errors);
  if (!errors.empty()) {
    throw std::runtime_error("the rank table " + environment.rank_table + ": " +
                             errors[0].ToString());
  }
  size_t ranks = 0;
  for (const api::RankTableNode& node : rendezvous.table.nodes) ranks += node.ranks.size();
  if (static_cast<int>(rendezvous.table.nodes.size()) != environment.nnodes ||
      static_cast<int>(ranks) != environment.world_size) {
    throw std::runtime_error("the rank table " + environment.rank_table + " has " +
                             std::to_string(rendezvous.table.nodes.size()) + " nodes and " +
                             std::to_string(ranks) + " ranks; the environment says " +
                             std::to_string(environment.nnodes) + " and " +
                             std::to_string(environment.world_size));
  }
  rendezvous.key = environment.store_key_file.empty() ? "" : ReadStoreKey(environment.store_key_file);
  const std::string& key = rendezvous.key;
  if (environment.rank == 0) {
    if (key.empty()) {
      std::fprintf(stderr, "warning: the rendezvous Store admits any client that reaches %s: no %s\n",
                   environment.coordinator.c_str(), env::kStoreKeyFile);
    }
    size_t colon = environment.coordinator.rfind(':');
    if (colon == std::string::npos) {
      throw std::runtime_error("MESHTRAIN_COORDINATOR=\"" + environment.coordinator +
                               "\" is not host:port");
    }
    std::string host = environment.coordinator.substr(0, colon);
    // A loopback coordinator (one machine, or a simulated pod address) is served on that
    // address only; any other name on every interface.
    std::string listen = "0.0.0.0";
    if (host == "localhost") listen = "127.0.0.1";
    else if (host.rfind("127.", 0) == 0) listen = host;
    int port = std::atoi(environment.coordinator.c_str() + colon + 1);
    rendezvous.server = std::make_unique<StoreServer>(listen, static_cast<uint16_t>(port), key);
  }
  rendezvous.store = std::make_shared<StoreClient>(environment.coordinator, timeout, key);
  return rendezvous;
}

}  // namespace meshtrain::comm
