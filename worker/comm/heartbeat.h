// Hang detection (issue #29, "Hangs"): every rank of a gang publishes a heartbeat in the
// rendezvous Store and rank 0 watches them all, so a rank that stops making progress
// without dying (a stopped process, a stuck kernel, a deadlocked thread) fails the gang
// within spec.runPolicy.hangTimeoutSeconds, named, instead of leaving its peers blocked
// in collectives.
//
// Each rank runs a Watchdog: a thread with its own StoreClient (a shared one would queue
// behind the training thread's long waits) that writes `heartbeat/<rank>` every
// HeartbeatInterval(timeout) as "<tick> <phase> <steps>". The tick advances with every
// write, so a heartbeat that stops changing means the process no longer runs (stopped,
// dead, or frozen whole); `steps` is the training loop's progress, set through Progress.
//
// Rank 0's watchdog reads every heartbeat each interval and fails the gang, naming the
// stuck rank(s) on stderr and ending its process with api::worker::kExitHang, when
// (FindStuckRanks):
//  - a rank's heartbeat has not changed for the timeout, in any phase; or
//  - every rank is training and no rank's progress moved for the timeout: the ranks
//    whose heartbeat missed three beats are named (a rank stopped mid-step stalls the
//    others from their last step, before its silence reaches the timeout); else the
//    ranks furthest behind (the others wait for them in collectives); else all of them.
// Start-up (loading, connecting) and the end (the last checkpoint, the sample, the final
// barrier) are phases without steps, so long legitimate ones do not fire. Every other
// rank's watchdog ends its rank the same way, naming rank 0, when the Store (served by
// rank 0) does not answer for the timeout.
//
// Nothing here blocks training: Progress only stores under a mutex. The watchdog stops
// at Stop or destruction, after at most one Store call in flight (bounded by the timeout).
//
// Thread-safety: Watchdog's methods may be called from any thread. The rest are pure functions.

#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "worker/comm/store.h"

namespace meshtrain::comm {

enum class Phase { kStarting, kTraining, kFinishing };

struct Heartbeat {
  int64_t tick = 0;
  Phase phase = Phase::kStarting;
  int64_t steps = 0;  // optimizer steps done (the resumed step counts), while training
  bool operator==(const Heartbeat&) const = default;
};

std::string EncodeHeartbeat(const Heartbeat& heartbeat);
// nullopt for text that is not a heartbeat.
std::optional<Heartbeat> DecodeHeartbeat(std::string_view text);

// How often a heartbeat is written and read: a tenth of the timeout, at least 100 ms.
milliseconds HeartbeatInterval(milliseconds timeout);

// What rank 0 knows of one rank's heartbeat.
struct RankObservation {
  int rank = 0;
  std::optional<Heartbeat> last;  // nullopt: never seen
  milliseconds unchanged{0};      // since it last changed, or since watching began
};

struct StuckRanks {
  std::vector<int> ranks;
  // "rank 2 made no progress for 3.1 s (its heartbeat stopped: stopped or hung)"
  std::string message;
};

// The stuck ranks, or nullopt while the gang is healthy. `stalled` is the time since any
// rank's phase or steps last changed. With pipeline `stages` (the world's ranks split
// into that many consecutive stages, api/layout.h), the message names their stages too:
// "rank 2 (stage 1 of 2) made no progress ...".
std::optional<StuckRanks> FindStuckRanks(const std::vector<RankObservation>& ranks, milliseconds stalled,
                                         milliseconds timeout, int stages = 1);

struct WatchdogOptions {
  std::string coordinator;  // host:port of rank 0's Store
  std::string key;          // the Store's key; empty: none
  int rank = 0, world = 1;
  int stages = 1;           // pipeline stages, which messages name
  milliseconds timeout{0};  // 0: no watchdog
  // Called once, from the watchdog thread, with what is stuck ("rank 2 made no progress
  // ..."); the watchdog then ends. Default: print "rank R: error: MESSAGE; ending this
  // attempt" on stderr and _exit(kExitHang), since the training thread is blocked.
  std::function<void(const std::string& message)> on_stuck;
};

class Watchdog {
 public:
  // Starts the thread (none when options.timeout is 0) in the starting phase.
  explicit Watchdog(WatchdogOptions options);
  ~Watchdog();
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  // What the next heartbeat carries.
  void Progress(Phase phase, int64_t steps);
  // Ends the thread and joins it; idempotent.
  void Stop();

 private:
  void Run();
  // Waits one interval; false once stopped.
  bool Sleep();
  bool Stopping();
  // The stuck ranks by the heartbeats in the Store, as rank 0 sees them now.
  std::optional<StuckRanks> Watch(StoreClient& store, std::chrono::steady_clock::time_point now);

  WatchdogOptions options_;
  milliseconds interval_;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stopping_ = false;
  Heartbeat heartbeat_;  // under mutex_; the tick is the watchdog thread's

  // Rank 0's view, kept by the watchdog thread only.
  struct Seen {
    std::optional<Heartbeat> last;
    std::chrono::steady_clock::time_point changed;
  };
  std::vector<Seen> seen_;
  std::chrono::steady_clock::time_point progressed_;
  std::thread thread_;
};

}  // namespace meshtrain::comm
