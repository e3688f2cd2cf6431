// Starts the ranks of a job on this machine as M virtual nodes of K ranks each, with
// the worker contract's environment and a rank table saying which ranks share a node,
// so intra-node traffic takes shm and inter-node traffic takes tcp here (docs/design.md,
// "How a job runs"; used by tests, benchmarks and `meshtrain launch`).
//
// The ranks run as one process group (process_group.h): one failure ends the whole job.

#pragma once

#include <chrono>
#include <map>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "api/rank_table.h"
#include "worker/launch/process_group.h"

namespace meshtrain::launch {

struct LocalLaunch {
  int nodes = 1;
  int ranks_per_node = 1;
  std::vector<std::string> command;  // argv of every rank
  std::map<std::string, std::string> environment;  // added to each rank's
  std::string job_name = "local";
  // Which ranks share a node; default VirtualRankTable(nodes, ranks_per_node).
  std::optional<api::RankTable> rank_table;
  std::chrono::milliseconds grace{5000};  // SIGTERM to SIGKILL
  std::chrono::milliseconds timeout{0};   // whole job; 0: none
  // Whether one rank's failure stops the others (tests of failure detection turn it off).
  bool stop_others_on_failure = true;
  // A network testbed (scripts/netbed.sh): when set, node i's ranks run in network
  // namespace NAME-i, reached at 198.18.0.(i+1), so traffic between nodes crosses the
  // testbed's shaped links; rank 0's Store listens there too.
  std::string netbed;
  // Which testbed node each node rank runs on (a placement's order); empty: node i on i.
  std::vector<int> netbed_hosts;
  int NetbedHost(int node) const { return netbed_hosts.empty() ? node : netbed_hosts[size_t(node)]; }
};

// The address of node `node` of a testbed (scripts/netbed.sh).
std::string NetbedAddress(int node);

// A TCP port on 127.0.0.1 that was free a moment ago (for rank 0's Store, or a test's
// server). Throws std::runtime_error if none can be found.
int FreeLoopbackPort();

// argv with argv[0] replaced by this executable's path, so a program can launch itself as ranks.
std::vector<std::string> SelfCommand(int argc, char** argv);

// The rank table of M virtual nodes ("virtual-node-0"...), K consecutive ranks each.
api::RankTable VirtualRankTable(int nodes, int ranks_per_node);

// Runs the job and returns when every rank has ended. Progress and failures are
// reported on `log`. SIGTERM, SIGINT and SIGHUP sent to this process meanwhile are passed
// on to the ranks; once they have ended, this process raises the signal itself, which ends
// it unless it has a handler of its own (then LaunchResult::stop_signal says so). Throws
// std::runtime_error if it cannot start.
LaunchResult LaunchLocal(const LocalLaunch& launch, std::ostream& log);

}  // namespace meshtrain::launch
