// Starts the ranks of a job on this machine as M virtual nodes of K ranks each, with
// the worker contract's environment and a rank table saying which ranks share a node,
// so intra-node traffic takes shm and inter-node traffic takes tcp here (DESIGN.md,
// "Worker contract"; used by tests, benchmarks and `meshtrain launch`).
//
// If a rank fails (non-zero exit or a signal), the others get SIGTERM and, after a
// grace period, SIGKILL: one failure ends the whole job, as on a cluster.

#pragma once

#include <chrono>
#include <map>
#include <ostream>
#include <string>
#include <vector>

#include "api/rank_table.h"

namespace meshtrain::launch {

struct LocalLaunch {
  int nodes = 1;
  int ranks_per_node = 1;
  std::vector<std::string> command;  // argv of every rank
  std::map<std::string, std::string> environment;  // added to each rank's
  std::string job_name = "local";
  std::chrono::milliseconds grace{5000};  // SIGTERM to SIGKILL
  std::chrono::milliseconds timeout{0};   // whole job; 0: none
  // Whether one rank's failure stops the others (tests of failure detection turn it off).
  bool stop_others_on_failure = true;
};

struct RankExit {
  int rank = 0;
  int status = 0;  // exit code, or 128 + signal
};

struct LaunchResult {
  int status = 0;  // 0, or the first failed rank's status
  std::vector<RankExit> exits;  // in the order the ranks ended
};

// argv with argv[0] replaced by this executable's path, so a program can launch itself as ranks.
std::vector<std::string> SelfCommand(int argc, char** argv);

// The rank table of M virtual nodes ("virtual-node-0"...), K consecutive ranks each.
api::RankTable VirtualRankTable(int nodes, int ranks_per_node);

// Runs the job and returns when every rank has ended. Progress and failures are
// reported on `log`. Throws std::runtime_error if it cannot start.
LaunchResult LaunchLocal(const LocalLaunch& launch, std::ostream& log);

}  // namespace meshtrain::launch
