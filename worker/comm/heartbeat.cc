#include "worker/comm/heartbeat.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <sstream>

#include "api/environment.h"
#include "api/worker_contract.h"

namespace meshtrain::comm {
namespace {

using Clock = std::chrono::steady_clock;

constexpr milliseconds kReconnect(1000);

constexpr const char* kPhaseNames[] = {"starting", "training", "finishing"};

std::string HeartbeatKey(int rank) { return "heartbeat/" + std::to_string(rank); }

std::string Seconds(milliseconds duration) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f s", double(duration.count()) / 1000);
  return text;
}

// "rank 2" or "ranks 1, 3"; of a world of `world` ranks in `stages` pipeline stages,
// with their stages: "rank 2 (stage 1 of 2)", "ranks 1, 2 (stages 0, 1 of 4)".
std::string RankList(const std::vector<int>& ranks, int world = 1, int stages = 1) {
  std::string list = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) list += (i ? ", " : "") + std::to_string(ranks[i]);
  if (stages <= 1 || world % stages != 0) return list;
  std::vector<int> of;
  for (int rank : ranks) {
    const int stage = rank / (world / stages);
    if (std::find(of.begin(), of.end(), stage) == of.end()) of.push_back(stage);
  }
  list += of.size() == 1 ? " (stage " : " (stages ";
  for (size_t i = 0; i < of.size(); ++i) list += (i ? ", " : "") + std::to_string(of[i]);
  return list + " of " + std::to_string(stages) + ")";
}

// The default on_stuck: the training thread is blocked (that is the hang), so nothing
// unwinds; the message goes out unbuffered, and to the launcher, and the process ends here.
void EndThisProcess(int rank, const std::string& message) {
  std::fprintf(stderr, "rank %d: error: %s; ending this attempt\n", rank, message.c_str());
  std::fflush(stderr);
  api::WriteFailureReason(message);
  ::_exit(api::worker::kExitHang);
}

// The ranks whose heartbeat has not changed for `threshold`, named as stopped, with no
// progress for `reported` (default: the shortest of their silences).
std::optional<StuckRanks> SilentRanks(const std::vector<RankObservation>& ranks, milliseconds threshold,
                                      std::optional<milliseconds> reported, int stages) {
  StuckRanks silent;
  milliseconds shortest = milliseconds::max();
  bool never_seen = true;
  for (const RankObservation& r : ranks) {
    if (r.unchanged < threshold) continue;
    silent.ranks.push_back(r.rank);
    shortest = std::min(shortest, r.unchanged);
    never_seen = never_seen && !r.last;
  }
  if (silent.ranks.empty()) return std::nullopt;
  const bool one = silent.ranks.size() == 1;
  silent.message = RankList(silent.ranks, int(ranks.size()), stages) + " made no progress for " + Seconds(reported.value_or(shortest)) + " (" +
                   (one ? "its heartbeat " : "their heartbeats ") + (never_seen ? "never started" : "stopped") +
                   ": stopped or hung)";
  return silent;
}

}  // namespace

std::string EncodeHeartbeat(const Heartbeat& heartbeat) {
  return std::to_string(heartbeat.tick) + " " + kPhaseNames[int(heartbeat.phase)] + " " +
         std::to_string(heartbeat.steps);
}

std::optional<Heartbeat> DecodeHeartbeat(std::string_view text) {
  std::istringstream in{std::string(text)};
  Heartbeat heartbeat;
  std::string phase;
  if (!(in >> heartbeat.tick >> phase >> heartbeat.steps) || !(in >> std::ws).eof()) return std::nullopt;
  const auto* named = std::find(std::begin(kPhaseNames), std::end(kPhaseNames), phase);
  if (named == std::end(kPhaseNames)) return std::nullopt;
  heartbeat.phase = Phase(named - std::begin(kPhaseNames));
  return heartbeat;
}

milliseconds HeartbeatInterval(milliseconds timeout) { return std::max(milliseconds(100), timeout / 10); }

std::optional<StuckRanks> FindStuckRanks(const std::vector<RankObservation>& ranks, milliseconds stalled,
                                         milliseconds timeout, int stages) {
  // A heartbeat that stopped changing is a process that stopped running: certain, and the
  // cause of every other rank's wait, so it is named first, whatever the phase.
  if (std::optional<StuckRanks> silent = SilentRanks(ranks, timeout, std::nullopt, stages)) return silent;
  // Steps are progress only while every rank trains: start-up and the end have none.
  const bool all_training = !ranks.empty() && std::all_of(ranks.begin(), ranks.end(), [](const RankObservation& r) {
    return r.last && r.last->phase == Phase::kTraining;
  });
  if (!all_training || stalled < timeout) return std::nullopt;
  // A rank stopped mid-step stalls the others from their last step, before its own
  // heartbeat is as old as the timeout; one that missed a few beats is the cause.
  if (std::optional<StuckRanks> silent = SilentRanks(ranks, 3 * HeartbeatInterval(timeout), stalled, stages)) {
    return silent;
  }
  const auto [lowest, highest] = std::minmax_element(
      ranks.begin(), ranks.end(), [](const RankObservation& a, const RankObservation& b) {
        return a.last->steps < b.last->steps;
      });
  const int64_t behind = lowest->last->steps;
  StuckRanks stuck;
  if (behind == highest->last->steps) {
    for (const RankObservation& r : ranks) stuck.ranks.push_back(r.rank);
    stuck.message = "all " + std::to_string(ranks.size()) + " ranks made no progress for " + Seconds(stalled) +
                    " (all at step " + std::to_string(behind) + ": stuck together, in a collective or a kernel)";
    return stuck;
  }
  int64_t next = highest->last->steps;  // the least any other rank has done
  for (const RankObservation& r : ranks) {
    if (r.last->steps == behind) stuck.ranks.push_back(r.rank);
    else next = std::min(next, r.last->steps);
  }
  const bool one = stuck.ranks.size() == 1;
  stuck.message = RankList(stuck.ranks, int(ranks.size()), stages) + " made no progress for " + Seconds(stalled) + " (" +
                  (one ? "it is" : "they are") + " at step " + std::to_string(behind) + "; the other ranks, at step " +
                  std::to_string(next) + " or later, wait for " + (one ? "it" : "them") + ")";
  return stuck;
}

Watchdog::Watchdog(WatchdogOptions options)
    : options_(std::move(options)), interval_(HeartbeatInterval(options_.timeout)) {
  if (options_.timeout.count() == 0) return;
  if (!options_.on_stuck) {
    options_.on_stuck = [rank = options_.rank](const std::string& message) { EndThisProcess(rank, message); };
  }
  thread_ = std::thread([this] { Run(); });
}

Watchdog::~Watchdog() { Stop(); }

void Watchdog::Progress(Phase phase, int64_t steps) {
  std::lock_guard lock(mutex_);
  heartbeat_.phase = phase;
  heartbeat_.steps = steps;
}

void Watchdog::Stop() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
}

bool Watchdog::Stopping() {
  std::lock_guard lock(mutex_);
  return stopping_;
}

bool Watchdog::Sleep() {
  std::unique_lock lock(mutex_);
  return !wake_.wait_for(lock, interval_, [this] { return stopping_; });
}

void Watchdog::Run() {
  const Clock::time_point started = Clock::now();
  seen_.assign(size_t(options_.world), Seen{std::nullopt, started});
  progressed_ = started;
  Clock::time_point answered = started;  // the Store's last answer
  std::unique_ptr<StoreClient> store;
  int64_t tick = 0;
  do {
    Heartbeat heartbeat;
    {
      std::lock_guard lock(mutex_);
      heartbeat = heartbeat_;
    }
    heartbeat.tick = ++tick;
    std::optional<StuckRanks> stuck;
    try {
      // Every call is bounded by the time left before the Store counts as stuck.
      const auto left = [&] {
        return std::max(interval_, std::chrono::ceil<milliseconds>(answered + options_.timeout - Clock::now()));
      };
      // A coordinator that is up accepts at once; retrying longer would only delay Stop.
      if (!store) store = std::make_unique<StoreClient>(options_.coordinator, std::min(left(), kReconnect), options_.key);
      store->Set(HeartbeatKey(options_.rank), EncodeHeartbeat(heartbeat), left());
      answered = Clock::now();
      if (options_.rank == 0) stuck = Watch(*store, answered);
    } catch (const StoreError&) {
      store.reset();  // a lost connection is not in step any more: the next beat reconnects
      const Clock::time_point now = Clock::now();
      if (options_.rank != 0 && now - answered >= options_.timeout) {
        stuck = StuckRanks{{0}, "rank 0 made no progress for " +
                                    Seconds(std::chrono::duration_cast<milliseconds>(now - answered)) +
                                    " (the Store it serves does not answer: stopped or hung)"};
      }
    }
    if (stuck) {
      // Stopping: the rank finished meanwhile, and rank 0, which leaves last, may be gone.
      if (!Stopping()) options_.on_stuck(stuck->message);
      return;
    }
  } while (Sleep());
}

std::optional<StuckRanks> Watchdog::Watch(StoreClient& store, Clock::time_point now) {
  std::vector<RankObservation> ranks;
  for (int rank = 0; rank < options_.world; ++rank) {
    Seen& seen = seen_[size_t(rank)];
    const std::string key = HeartbeatKey(rank);
    if (store.Check(key)) {
      const std::optional<Heartbeat> heartbeat = DecodeHeartbeat(store.Get(key, milliseconds(0)));
      if (heartbeat && heartbeat != seen.last) {
        if (!seen.last || heartbeat->phase != seen.last->phase || heartbeat->steps != seen.last->steps) {
          progressed_ = now;
        }
        seen = {heartbeat, now};
      }
    }
    ranks.push_back({rank, seen.last, std::chrono::duration_cast<milliseconds>(now - seen.changed)});
  }
  return FindStuckRanks(ranks, std::chrono::duration_cast<milliseconds>(now - progressed_), options_.timeout,
                        options_.stages);
}

}  // namespace meshtrain::comm
