// Runs one process per rank and supervises them as one job: when a rank fails (a
// non-zero exit or a signal) the others get SIGTERM (and SIGCONT, so a stopped one takes
// it) and, after a grace period, SIGKILL, as on a cluster where one dead rank ends the
// gang. Used by LaunchLocal (virtual nodes on this machine) and by `meshtrain-worker
// launch` (the ranks of one pod).
//
// RankGroup is the part that owns the processes of one set of ranks (start, reap, stop);
// RunProcessGroup supervises one RankGroup to its end, and the pod launcher
// (node_launcher.h) runs one RankGroup per attempt.
//
// The ranks are killed (SIGKILL) if this process dies, however it dies; the kernel ties
// that to the thread that started them, so make a RankGroup on a thread that outlives it.
//
// Thread-safety: a RankGroup reaps children with waitpid(-1); have one at a time per
// process, use it from one thread, and start no other children while it lives.

#pragma once

#include <sys/types.h>

#include <chrono>
#include <map>
#include <ostream>
#include <string>
#include <vector>

#include "worker/launch/memory_file.h"

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
  // Whether SIGTERM/SIGINT/SIGHUP sent to this process while the ranks run are passed on
  // to them (a pod launcher: the kubelet stops the pod by signalling it; `meshtrain run`:
  // its ranks must not outlive it). The actions before are restored at the end.
  bool forward_signals = false;
};

struct RankExit {
  int rank = 0;
  int status = 0;  // exit code, or 128 + signal
  // What a failed rank wrote of its failure (api::worker::env::kFailureFile, one line);
  // empty when it wrote nothing (it was killed, or is not a meshtrain rank).
  std::string reason;
  bool operator==(const RankExit&) const = default;
};

struct LaunchResult {
  // 0; the first failed rank's status; 124 past the timeout; or 128 + the signal this
  // process received (forward_signals) when every rank then ended cleanly.
  int status = 0;
  // The signal this process received and passed on to the ranks (forward_signals); 0:
  // none. A run that was stopped is not restarted.
  int stop_signal = 0;
  std::vector<RankExit> exits;  // in the order the ranks ended
};

// From now on SIGTERM, SIGINT and SIGHUP sent to this process are kept for
// TakeStopSignal() instead of ending it (a pod launcher passes them on to its ranks).
// A signal this process ignores (nohup's SIGHUP) stays ignored.
void CatchStopSignals();
// The last of those signals received since the previous call; 0: none.
int TakeStopSignal();

// The processes of a set of ranks, from their start until each is reaped.
class RankGroup {
 public:
  // Starts one process per rank running `command`, each with its environment on top of
  // this process's, and MESHTRAIN_FAILURE_FILE naming a file of its own in memory
  // (memory_file.h), read when the rank fails. `caught_stop_signals`: this process
  // called CatchStopSignals(), and the ranks must die of those signals rather than inherit
  // the catching. Throws std::runtime_error if it cannot (no command, fork failed), after
  // killing and reaping the ranks it did start.
  RankGroup(const std::vector<RankProcess>& ranks, const std::vector<std::string>& command, bool caught_stop_signals);
  // Kills (SIGKILL) and reaps the ranks still running.
  ~RankGroup();
  RankGroup(const RankGroup&) = delete;
  RankGroup& operator=(const RankGroup&) = delete;

  // Reaps the ranks that ended, without waiting, and SIGKILLs the ones still running
  // past a Terminate()'s grace (saying so on `log`). Returns the ranks reaped, in order,
  // a failed one with the reason it wrote.
  //
  // A rank whose collective failed (api::worker::kExitCommFailure) is most often the
  // victim of a peer's failure, and can end before the peer is reaped (a killed rank's
  // exit takes longer than the neighbour's that saw its link drop). So such an exit is
  // held back for up to kCauseWindow while other ranks run, and returned with the first
  // other exit, after it; the rank named first is then the cause.
  std::vector<RankExit> Poll(std::ostream& log);
  static constexpr std::chrono::milliseconds kCauseWindow{500};
  // Sends `signal` (and SIGCONT, so a stopped rank takes it) to every running rank; those
  // still running `grace` later are SIGKILLed by Poll(). A later call keeps an earlier
  // deadline.
  void Terminate(int signal, std::chrono::milliseconds grace);

  // Whether every rank was reaped and returned by Poll(); size(): those that were not.
  bool empty() const { return running_.empty() && held_.empty(); }
  size_t size() const { return running_.size() + held_.size(); }

 private:
  void KillAndReap();

  std::map<pid_t, int> running_;  // pid -> rank
  std::map<int, MemoryFile> failure_files_;  // by rank, where one could be made
  std::vector<RankExit> held_;  // collective failures reaped, not yet returned
  std::chrono::steady_clock::time_point held_since_;  // when the first of held_ was reaped
  std::chrono::steady_clock::time_point kill_at_ = std::chrono::steady_clock::time_point::max();
  std::chrono::milliseconds grace_{0};  // of the deadline, for the log
};

// Starts every rank and returns when all have ended. Failures are reported on `log`.
// Throws std::runtime_error if it cannot start (no command, fork failed).
LaunchResult RunProcessGroup(const std::vector<RankProcess>& ranks, const ProcessGroupOptions& options,
                             std::ostream& log);

}  // namespace meshtrain::launch
