// Joining a job from inside a rank process: read the worker contract's environment
// (docs/design.md, "How a job runs"), serve the Store on rank 0, connect to it, and read
// the rank table.

#pragma once

#include <memory>
#include <string>

#include "api/rank_table.h"
#include "worker/comm/store.h"

namespace meshtrain::comm {

struct WorkerEnvironment {
  std::string job_name;
  std::string coordinator;  // host:port of rank 0's Store
  std::string config;       // path of the job spec (may be empty outside a job)
  std::string rank_table;   // path of the rank table
  std::string store_key_file;  // the job's Store key; empty: the Store authenticates no one
  int node_rank = 0, nnodes = 1, nproc_per_node = 1;
  int rank = 0, world_size = 1, local_rank = 0;

  // True when this process was started by a launcher (MESHTRAIN_COORDINATOR is set).
  static bool Present();
  // Reads the variables; throws std::runtime_error naming a missing or malformed one.
  static WorkerEnvironment FromEnvironment();
};

struct Rendezvous {
  std::unique_ptr<StoreServer> server;  // on rank 0 only
  std::shared_ptr<StoreClient> store;
  std::string key;  // the Store's, for further connections (a Watchdog's, the checkpoint writers'); empty: none
  api::RankTable table;
};

// Rank 0 starts the Store on the coordinator's port (listening on all interfaces, or
// on the loopback address the coordinator names); every rank connects within `timeout` and reads the
// rank table, whose node and rank counts must match the environment. Throws
// std::runtime_error naming the file or the variable at fault.
Rendezvous JoinRendezvous(const WorkerEnvironment& environment, milliseconds timeout);

}  // namespace meshtrain::comm
