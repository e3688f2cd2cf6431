#include "worker/comm/bootstrap.h"

#include "api/environment.h"

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <stdexcept>

namespace meshtrain::comm {
namespace {

int IntegerVariable(const char* name, int minimum) {
  return static_cast<int>(api::EnvironmentInteger(name, minimum, 1 << 20));
}

}  // namespace

bool WorkerEnvironment::Present() { return std::getenv("MESHTRAIN_COORDINATOR") != nullptr; }

WorkerEnvironment WorkerEnvironment::FromEnvironment() {
  WorkerEnvironment env;
  env.job_name = api::EnvironmentString("MESHTRAIN_JOB_NAME");
  env.coordinator = api::EnvironmentString("MESHTRAIN_COORDINATOR");
  if (env.coordinator.empty()) throw std::runtime_error("the worker environment lacks MESHTRAIN_COORDINATOR");
  env.config = api::EnvironmentString("MESHTRAIN_CONFIG");
  env.rank_table = api::EnvironmentString("MESHTRAIN_RANK_TABLE");
  if (env.rank_table.empty()) throw std::runtime_error("the worker environment lacks MESHTRAIN_RANK_TABLE");
  env.node_rank = IntegerVariable("MESHTRAIN_NODE_RANK", 0);
  env.nnodes = IntegerVariable("MESHTRAIN_NNODES", 1);
  env.nproc_per_node = IntegerVariable("MESHTRAIN_NPROC_PER_NODE", 1);
  env.rank = IntegerVariable("RANK", 0);
  env.world_size = IntegerVariable("WORLD_SIZE", 1);
  env.local_rank = IntegerVariable("LOCAL_RANK", 0);
  if (env.world_size != env.nnodes * env.nproc_per_node || env.rank >= env.world_size ||
      env.node_rank >= env.nnodes || env.local_rank >= env.nproc_per_node ||
      env.rank != env.node_rank * env.nproc_per_node + env.local_rank) {
    throw std::runtime_error(
        "inconsistent worker environment: RANK=" + std::to_string(env.rank) +
        " WORLD_SIZE=" + std::to_string(env.world_size) + " LOCAL_RANK=" +
        std::to_string(env.local_rank) + " MESHTRAIN_NODE_RANK=" + std::to_string(env.node_rank) +
        " MESHTRAIN_NNODES=" + std::to_string(env.nnodes) +
        " MESHTRAIN_NPROC_PER_NODE=" + std::to_string(env.nproc_per_node));
  }
  return env;
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
  if (environment.rank == 0) {
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
    rendezvous.server = std::make_unique<StoreServer>(listen, static_cast<uint16_t>(port));
  }
  rendezvous.store = std::make_shared<StoreClient>(environment.coordinator, timeout);
  return rendezvous;
}

}  // namespace meshtrain::comm
