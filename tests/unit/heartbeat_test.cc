// Hang detection: which ranks FindStuckRanks names (no sockets), then watchdogs on a real
// Store on 127.0.0.1 whose heartbeats stop, stall or lose rank 0.

#include "worker/comm/heartbeat.h"

#include <future>

#include <gtest/gtest.h>

namespace meshtrain::comm::heartbeat_test {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

constexpr milliseconds kTimeout = 5000ms;

RankObservation Training(int rank, int64_t steps, milliseconds unchanged = 100ms) {
  return {rank, Heartbeat{42, Phase::kTraining, steps}, unchanged};
}

TEST(Heartbeat, TextRoundTripsAndRejectsWhatIsNotAHeartbeat) {
  const Heartbeat beat{17, Phase::kTraining, 250};
  EXPECT_EQ(EncodeHeartbeat(beat), "17 training 250");
  EXPECT_EQ(DecodeHeartbeat(EncodeHeartbeat(beat)), beat);
  EXPECT_EQ(DecodeHeartbeat("3 finishing 9"), (Heartbeat{3, Phase::kFinishing, 9}));
  for (const char* bad : {"", "17 training", "17 sleeping 3", "17 training 3 extra", "x training 3"}) {
    EXPECT_EQ(DecodeHeartbeat(bad), std::nullopt) << bad;
  }
}

TEST(Heartbeat, IntervalIsATenthOfTheTimeoutAndAtLeast100Ms) {
  EXPECT_EQ(HeartbeatInterval(300s), 30s);
  EXPECT_EQ(HeartbeatInterval(3s), 300ms);
  EXPECT_EQ(HeartbeatInterval(500ms), 100ms);
}

TEST(FindStuckRanks, NothingIsStuckWhileHeartbeatsChangeAndStepsMove) {
  const std::vector<RankObservation> ranks = {Training(0, 7), Training(1, 7), Training(2, 6)};
  EXPECT_EQ(FindStuckRanks(ranks, 4900ms, kTimeout), std::nullopt);
  EXPECT_EQ(FindStuckRanks({}, 1h, kTimeout), std::nullopt);
}

TEST(FindStuckRanks, ARankWhoseHeartbeatStoppedIsNamedFirst) {
  // Rank 1 is also furthest behind, and rank 3 is still starting: the stopped heartbeat decides.
  const std::vector<RankObservation> ranks = {Training(0, 7), Training(1, 3), Training(2, 6, 5300ms),
                                              {3, Heartbeat{5, Phase::kStarting, 0}, 200ms}};
  const std::optional<StuckRanks> stuck = FindStuckRanks(ranks, 9s, kTimeout);
  ASSERT_TRUE(stuck);
  EXPECT_EQ(stuck->ranks, std::vector<int>{2});
  EXPECT_EQ(stuck->message, "rank 2 made no progress for 5.3 s (its heartbeat stopped: stopped or hung)");
}

// In a pipeline of 2 stages of 2 ranks, a stopped rank's stage is named with it, and
// the ranks furthest behind with theirs.
TEST(FindStuckRanks, InAPipelineTheStageIsNamed) {
  const std::vector<RankObservation> stopped = {Training(0, 7), Training(1, 7), Training(2, 7, 5300ms), Training(3, 7)};
  std::optional<StuckRanks> stuck = FindStuckRanks(stopped, 9s, kTimeout, 2);
  ASSERT_TRUE(stuck);
  EXPECT_EQ(stuck->message, "rank 2 (stage 1 of 2) made no progress for 5.3 s (its heartbeat stopped: stopped or hung)");
  const std::vector<RankObservation> behind = {Training(0, 7), Training(1, 6), Training(2, 7), Training(3, 6)};
  stuck = FindStuckRanks(behind, 6s, kTimeout, 4);
  ASSERT_TRUE(stuck);
  EXPECT_EQ(stuck->ranks, (std::vector<int>{1, 3}));
  EXPECT_NE(stuck->message.find("ranks 1, 3 (stages 1, 3 of 4) made no progress"), std::string::npos) << stuck->message;
}

TEST(FindStuckRanks, HeartbeatsThatNeverStartedOrStoppedInAnyPhaseAreNamedTogether) {
  const std::vector<RankObservation> never = {Training(0, 0), {1, std::nullopt, 6s}};
  ASSERT_TRUE(FindStuckRanks(never, 0ms, kTimeout));
  EXPECT_EQ(FindStuckRanks(never, 0ms, kTimeout)->message,
            "rank 1 made no progress for 6.0 s (its heartbeat never started: stopped or hung)");
  const std::vector<RankObservation> two = {{0, Heartbeat{1, Phase::kStarting, 0}, 0ms},
                                            {1, Heartbeat{1, Phase::kStarting, 0}, 7s},
                                            {2, Heartbeat{1, Phase::kFinishing, 9}, 5s}};
  const std::optional<StuckRanks> stuck = FindStuckRanks(two, 0ms, kTimeout);
  ASSERT_TRUE(stuck);
  EXPECT_EQ(stuck->ranks, (std::vector<int>{1, 2}));
  EXPECT_EQ(stuck->message, "ranks 1, 2 made no progress for 5.0 s (their heartbeats stopped: stopped or hung)");
}

TEST(FindStuckRanks, WithoutProgressARankThatMissedBeatsIsNamedBeforeItsSilenceReachesTheTimeout) {
  // Rank 2 stopped mid-step, 0.4 s after the gang's last step: the others wait at that step.
  const std::vector<RankObservation> ranks = {Training(0, 9), Training(1, 9), Training(2, 9, 4600ms)};
  const std::optional<StuckRanks> stuck = FindStuckRanks(ranks, 5000ms, kTimeout);
  ASSERT_TRUE(stuck);
  EXPECT_EQ(stuck->ranks, std::vector<int>{2});
  EXPECT_EQ(stuck->message, "rank 2 made no progress for 5.0 s (its heartbeat stopped: stopped or hung)");
  EXPECT_EQ(FindStuckRanks(ranks, 4900ms, kTimeout), std::nullopt);
}

TEST(FindStuckRanks, WithoutProgressTheRanksFurthestBehindAreNamed) {
  const std::vector<RankObservation> one = {Training(0, 12), Training(1, 11), Training(2, 12), Training(3, 13)};
  const std::optional<StuckRanks> stuck = FindStuckRanks(one, 5500ms, kTimeout);
  ASSERT_TRUE(stuck);
  EXPECT_EQ(stuck->ranks, std::vector<int>{1});
  EXPECT_EQ(stuck->message,
            "rank 1 made no progress for 5.5 s (it is at step 11; the other ranks, at step 12 or later, wait for it)");
  const std::vector<RankObservation> two = {Training(0, 12), Training(1, 11), Training(2, 11)};
  ASSERT_TRUE(FindStuckRanks(two, 5s, kTimeout));
  EXPECT_EQ(FindStuckRanks(two, 5s, kTimeout)->ranks, (std::vector<int>{1, 2}));
  EXPECT_EQ(FindStuckRanks(two, 5s, kTimeout)->message,
            "ranks 1, 2 made no progress for 5.0 s (they are at step 11; the other ranks, at step 12 or later, "
            "wait for them)");
}

TEST(FindStuckRanks, RanksLevelWithoutProgressAreAllStuck) {
  const std::vector<RankObservation> ranks = {Training(0, 8), Training(1, 8)};
  const std::optional<StuckRanks> stuck = FindStuckRanks(ranks, 6s, kTimeout);
  ASSERT_TRUE(stuck);
  EXPECT_EQ(stuck->ranks, (std::vector<int>{0, 1}));
  EXPECT_EQ(stuck->message,
            "all 2 ranks made no progress for 6.0 s (all at step 8: stuck together, in a collective or a kernel)");
}

TEST(FindStuckRanks, StartUpAndTheEndCountNoProgress) {
  // Loading a checkpoint or writing the last one takes as long as it takes, while heartbeats beat.
  for (Phase other : {Phase::kStarting, Phase::kFinishing}) {
    const std::vector<RankObservation> ranks = {Training(0, 8), {1, Heartbeat{3, other, 0}, 100ms}};
    EXPECT_EQ(FindStuckRanks(ranks, 1h, kTimeout), std::nullopt);
  }
}

// ---------------------------------------------------------------------------
// Watchdogs on a real Store.

std::string Address(const StoreServer& server) { return "127.0.0.1:" + std::to_string(server.port()); }

constexpr milliseconds kShortTimeout = 1000ms;  // heartbeats every 100 ms

struct Report {
  std::promise<std::string> message;
  std::future<std::string> told = message.get_future();
  // Whether a message came within `patience`, and when.
  bool Within(milliseconds patience) { return told.wait_for(patience) == std::future_status::ready; }
};

WatchdogOptions Options(const StoreServer& server, int rank, int world, Report* report) {
  return {.coordinator = Address(server),
          .key = "",
          .rank = rank,
          .world = world,
          .timeout = kShortTimeout,
          .on_stuck = [report](const std::string& message) { report->message.set_value(message); }};
}

TEST(Watchdog, RankZeroNamesARankWhoseHeartbeatStopsWithinTheTimeout) {
  StoreServer server("127.0.0.1", 0);
  Report zero, one;
  Watchdog rank0(Options(server, 0, 2, &zero)), rank1(Options(server, 1, 2, &one));
  for (int64_t step = 1; step <= 3; ++step) {
    rank0.Progress(Phase::kTraining, step);
    rank1.Progress(Phase::kTraining, step);
    std::this_thread::sleep_for(150ms);
  }
  rank1.Stop();  // as a stopped process: no more heartbeats, and rank 0 waits at step 3
  const Clock::time_point stopped = Clock::now();
  ASSERT_TRUE(zero.Within(5s));
  const auto detected = Clock::now() - stopped;
  const std::string message = zero.told.get();
  EXPECT_EQ(message.rfind("rank 1 made no progress for 1.", 0), 0u) << message;
  EXPECT_NE(message.find(" s (its heartbeat stopped: stopped or hung)"), std::string::npos) << message;
  // From the last step, seen up to an interval late, to a verdict at the next read.
  EXPECT_GE(detected, kShortTimeout - 2 * HeartbeatInterval(kShortTimeout));
  EXPECT_LE(detected, kShortTimeout + 2 * HeartbeatInterval(kShortTimeout) + 300ms);
}

TEST(Watchdog, RankZeroNamesTheRankBehindWhenStepsStopWhileHeartbeatsGoOn) {
  StoreServer server("127.0.0.1", 0);
  Report zero, one, two;
  Watchdog rank0(Options(server, 0, 3, &zero)), rank1(Options(server, 1, 3, &one)), rank2(Options(server, 2, 3, &two));
  rank0.Progress(Phase::kTraining, 5);
  rank1.Progress(Phase::kTraining, 5);
  rank2.Progress(Phase::kTraining, 4);  // deadlocked in step 5, its watchdog still beating
  ASSERT_TRUE(zero.Within(5s));
  const std::string message = zero.told.get();
  EXPECT_EQ(message.rfind("rank 2 made no progress for ", 0), 0u) << message;
  EXPECT_NE(message.find("(it is at step 4; the other ranks, at step 5 or later, wait for it)"), std::string::npos)
      << message;
  EXPECT_FALSE(one.Within(0ms));
  EXPECT_FALSE(two.Within(0ms));
}

TEST(Watchdog, OtherRanksNameRankZeroWhenItsStoreStopsAnswering) {
  auto server = std::make_unique<StoreServer>("127.0.0.1", 0);
  Report one;
  Watchdog rank1(Options(*server, 1, 2, &one));
  std::this_thread::sleep_for(300ms);
  server.reset();
  ASSERT_TRUE(one.Within(5s));
  const std::string message = one.told.get();
  EXPECT_EQ(message.rfind("rank 0 made no progress for ", 0), 0u) << message;
  EXPECT_NE(message.find("(the Store it serves does not answer: stopped or hung)"), std::string::npos) << message;
}

TEST(Watchdog, AHealthyGangStopsPromptlyWithoutAVerdict) {
  StoreServer server("127.0.0.1", 0);
  Report zero, one;
  {
    Watchdog rank0(Options(server, 0, 2, &zero)), rank1(Options(server, 1, 2, &one));
    // Start-up longer than the timeout, then steps, then an end longer than the timeout.
    std::this_thread::sleep_for(kShortTimeout + 300ms);
    for (int64_t step = 1; step <= 6; ++step) {
      rank0.Progress(Phase::kTraining, step);
      rank1.Progress(Phase::kTraining, step);
      std::this_thread::sleep_for(250ms);
    }
    rank0.Progress(Phase::kFinishing, 6);
    rank1.Progress(Phase::kFinishing, 6);
    std::this_thread::sleep_for(kShortTimeout + 300ms);
    const Clock::time_point stopping = Clock::now();
    rank1.Stop();
    rank0.Stop();
    EXPECT_LT(Clock::now() - stopping, 500ms);
  }
  EXPECT_FALSE(zero.Within(0ms));
  EXPECT_FALSE(one.Within(0ms));
}

TEST(Watchdog, ATimeoutOfZeroWritesNoHeartbeat) {
  StoreServer server("127.0.0.1", 0);
  WatchdogOptions options = Options(server, 0, 1, nullptr);
  options.timeout = 0ms;
  {
    Watchdog off(options);
    std::this_thread::sleep_for(300ms);
  }
  StoreClient client(Address(server), 5s);
  EXPECT_FALSE(client.Check("heartbeat/0"));
}

}  // namespace
}  // namespace meshtrain::comm::heartbeat_test
