// The control endpoint of a pod's launcher (node_launcher.h): the operator restarts the
// ranks of a gang in place through it, stopping every pod's ranks and starting them again
// at the next attempt, rather than recreating the pods. This is the protocol's state and
// its HTTP side; the launcher's loop carries the instructions out.
//
//   GET /attempt                            200 {"attempt": A, "state": S}, and for S
//                                           "failed" "exitCode" and "rank" of the first
//                                           failed rank, and "reason" if it wrote one
//   POST /attempt/stop?attempt=N&token=T    N > A: stop the ranks, wait until they are
//                                           reaped, then A = N, S = "ready"; N <= A: no
//                                           change. 200 with the state after it.
//   POST /attempt/start?attempt=N&token=T   N == A and "ready": start the ranks of attempt
//                                           N, S = "running"; N == A and "running": no
//                                           change; 200 with the state. Otherwise 409.
//   POST /attempt/suspend?attempt=N&token=T any N (the operator's stored attempt, for the
//                                           log): "running": kStopSignal (SIGUSR1) to the ranks, which
//                                           checkpoint and stop together (kExitStopped),
//                                           S = "stopping", answered at once; once every
//                                           rank is reaped (those still running after the
//                                           launcher's grace are killed), S = "suspended".
//                                           Any other S: "suspended" at once, with no rank.
//                                           "stopping" or "suspended": no change. 200.
//
// Every instruction that carries the token and a well-formed attempt, even one that
// changes nothing, renews the launcher's hold: the operator repeats a stop to launchers
// that wait while a pod that replaces a lost one is still being created.
//
// S is "running", "failed" (a rank of A failed, the others are stopped or stopping, and
// the launcher holds for an instruction), "ready" (stopped for A, waiting for a start),
// "succeeded" (every rank of A exited 0), "stopping" or "suspended" (a suspend: the ranks
// are stopping, or have all ended; "ranks" then lists each rank that ran, in rank order,
// with its "exitCode" and the "reason" it wrote: kExitStopped and where it stopped, or how
// else it ended; 137 is a rank killed past the grace). Every answer is JSON; an error's has "error"
// saying what is wrong. A missing or wrong token is 403, and a missing or malformed
// attempt 400; either changes nothing. Once the launcher is exiting, instructions get 503.
//
// Thread-safety: thread-safe. The endpoint's thread calls the routes' answers; one thread
// of the launcher takes the instructions (Pending, Complete) and reports its ranks (Set).

#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "worker/launch/process_group.h"
#include "worker/metrics/http_request.h"

namespace meshtrain::launch {

enum class AttemptState { kRunning, kFailed, kReady, kSucceeded, kStopping, kSuspended };

// "running", "failed", "ready", "succeeded", "stopping", "suspended": as the protocol spells them.
const char* AttemptStateName(AttemptState state);

struct AttemptStatus {
  int attempt = 0;
  AttemptState state = AttemptState::kRunning;
  RankExit failure;  // kFailed: the first failed rank and its status
  std::vector<RankExit> stops;  // kSuspended: how each rank that ran ended, in rank order
};

// What the operator asked the launcher's loop to do.
struct AttemptInstruction {
  enum Kind { kStop, kStart, kSuspend } kind = kStop;
  int attempt = 0;
};

// The attempt number of a query parameter: decimal digits only, 0 to INT_MAX.
std::optional<int> ParseAttempt(std::string_view text);

class LauncherControl {
 public:
  // REQUIRES: `token` is not empty.
  LauncherControl(std::string token, AttemptStatus initial);
  LauncherControl(const LauncherControl&) = delete;
  LauncherControl& operator=(const LauncherControl&) = delete;

  // The endpoint's routes, referring to this object (which must outlive the endpoint). An
  // instruction that changes something is answered once the loop has Completed it, or
  // Close() was called; until then the endpoint serves no one else.
  std::vector<metrics::HttpRoute> Routes();

  AttemptStatus status() const;
  // What the loop saw of its ranks: a failure, success.
  void Set(const AttemptStatus& status);
  // The instruction waiting for the loop; at most one waits at a time.
  std::optional<AttemptInstruction> Pending() const;
  // Ends the pending instruction; the status is now `status`. A non-empty `refusal` says
  // why it was not carried out (the answer is 409).
  void Complete(const AttemptStatus& status, const std::string& refusal = "");
  // When the last instruction that carried the token arrived (the construction, before any).
  std::chrono::steady_clock::time_point last_instruction() const;
  // The launcher is exiting: a waiting instruction, and every later one, is answered 503
  // with `why`. Call it before the endpoint is destroyed, or a waiting answer holds it.
  // REQUIRES: `why` is not empty.
  void Close(const std::string& why);

 private:
  metrics::HttpResponse Instruct(const metrics::HttpRequestHead& request, AttemptInstruction::Kind kind);

  const std::string token_;
  mutable std::mutex mutex_;
  std::condition_variable completed_;
  AttemptStatus status_;                        // guarded by mutex_
  std::optional<AttemptInstruction> pending_;   // guarded by mutex_
  uint64_t completions_ = 0;                    // guarded by mutex_
  std::string refusal_;                         // of the last completion; guarded by mutex_
  std::string closed_;                          // why; empty: open; guarded by mutex_
  std::chrono::steady_clock::time_point last_instruction_ = std::chrono::steady_clock::now();  // guarded by mutex_
};

}  // namespace meshtrain::launch
