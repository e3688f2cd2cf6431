// Runs one process per rank and supervises them as one job: when a rank fails (a
// non-zero exit or a signal) the others get SIGTERM (and SIGCONT, so a stopped one takes
// it) and, after a grace period, SIGKILL, as on a cluster where one dead rank ends the
// gang. Used by LaunchLocal (virtual nodes on this machine) and by `meshtrain-worker
// launch` (the ranks of one pod).
//
// Thread-safety: RunProcessGroup reaps children with waitpid(-1); run one at a time
// per process, and do not start other children while it runs.

#pragma once

#include <chrono>
#include <map>
#include <ostream>
#include <string>
#include <vector>

namespace meshtrain::launch {

struct RankProcess {
  int rank = 0;
  std::map<std::string, std::string> environment;  // set on top of this process's
  // A named network namespace (/run/netns/NAME, as `ip netns add` makes) the rank runs
  // in; empty: this process's own.
  std::string network_namespace;
};

struct ProcessGroupOptions {
  std::vector<std::string> command;  // argv of every rank
  std::chrono::milliseconds grace{5000};  // SIGTERM to SIGKILL
  std::chrono::milliseconds timeout{0};   // whole job; 0: none
  // Whether one rank's failure stops the others (tests of failure detection turn it off).
  bool stop_others_on_failure = true;
  // Whether SIGTERM/SIGINT/SIGHUP sent to this process are passed on to the ranks
  // (a pod launcher: the kubelet stops the pod by signalling it).
  bool forward_signals = false;
};

struct RankExit {
  int rank = 0;
  int status = 0;  // exit code, or 128 + signal
};

struct LaunchResult {
  // 0; the first failed rank's status; 124 past the timeout; or 128 + the signal this
  // process received (forward_signals) when every rank then ended cleanly.
  int status = 0;
  std::vector<RankExit> exits;  // in the order the ranks ended
};

// Starts every rank and returns when all have ended. Failures are reported on `log`.
// Throws std::runtime_error if it cannot start (no command, fork failed).
LaunchResult RunProcessGroup(const std::vector<RankProcess>& ranks, const ProcessGroupOptions& options,
                             std::ostream& log);

}  // namespace meshtrain::launch
