// A RankGroup (worker/launch/process_group.h) with shell scripts for ranks: which rank it
// names first when a collective's failure ends before the failure that caused it.

#include "worker/launch/process_group.h"

#include <signal.h>

#include <chrono>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "api/worker_contract.h"

namespace meshtrain::launch {

void PrintTo(const RankExit& exit, std::ostream* out) {
  *out << "{rank " << exit.rank << ", status " << exit.status << ", \"" << exit.reason << "\"}";
}

namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

std::vector<RankProcess> TwoRanks() { return {{0, {{"RANK", "0"}}, ""}, {1, {{"RANK", "1"}}, ""}}; }

// Rank 0 fails in a collective at once, saying so; rank 1 runs `rank1`.
std::vector<std::string> Command(const std::string& rank1) {
  return {"/bin/sh", "-c",
          "if [ \"$RANK\" = 0 ]; then echo 'all_reduce lost rank 1' > \"$" + std::string(api::worker::env::kFailureFile) +
              "\"; exit 76; fi; " + rank1};
}

// Polls until `count` exits came (or 10 s), each with the seconds since `start`.
std::vector<std::pair<RankExit, double>> PollFor(RankGroup& group, size_t count, Clock::time_point start) {
  std::ostringstream log;
  std::vector<std::pair<RankExit, double>> exits;
  for (const auto end = start + 10s; exits.size() < count && Clock::now() < end; std::this_thread::sleep_for(5ms)) {
    std::vector<RankExit> polled = group.Poll(log);
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    for (RankExit& exit : polled) exits.emplace_back(std::move(exit), seconds);
  }
  return exits;
}

// Rank 1 is killed 200 ms after rank 0's collective failed: it is named first.
TEST(RankGroup, ACollectiveFailureWaitsForTheFailureThatCausedIt) {
  const auto start = Clock::now();
  RankGroup group(TwoRanks(), Command("sleep 0.2; kill -9 $$"), false);
  const auto exits = PollFor(group, 2, start);
  ASSERT_EQ(exits.size(), 2u);
  EXPECT_EQ(exits[0].first, (RankExit{1, 137, ""}));
  EXPECT_EQ(exits[1].first, (RankExit{0, api::worker::kExitCommFailure, "all_reduce lost rank 1"}));
  EXPECT_EQ(exits[0].second, exits[1].second) << "both come from one poll";
  EXPECT_TRUE(group.empty());
}

// With no other failure, the collective's is returned once the window has passed, and
// until then the group counts its rank as running.
TEST(RankGroup, ACollectiveFailureAloneComesAfterTheWindow) {
  const auto start = Clock::now();
  RankGroup group(TwoRanks(), Command("exec sleep 30"), false);
  std::this_thread::sleep_for(100ms);
  std::ostringstream log;
  EXPECT_TRUE(group.Poll(log).empty());
  EXPECT_EQ(group.size(), 2u);
  const auto exits = PollFor(group, 1, start);
  ASSERT_EQ(exits.size(), 1u);
  EXPECT_EQ(exits[0].first, (RankExit{0, api::worker::kExitCommFailure, "all_reduce lost rank 1"}));
  const double window = std::chrono::duration<double>(RankGroup::kCauseWindow).count();
  EXPECT_GE(exits[0].second, window);
  EXPECT_LT(exits[0].second, window + 2);
  EXPECT_EQ(group.size(), 1u);
  group.Terminate(SIGKILL, 0ms);
  EXPECT_EQ(PollFor(group, 1, Clock::now()).at(0).first, (RankExit{1, 137, ""}));
}

// Every other failure is returned at once.
TEST(RankGroup, AnyOtherFailureComesAtOnce) {
  const auto start = Clock::now();
  RankGroup group({{0, {}, ""}}, {"/bin/sh", "-c", "exit 3"}, false);
  const auto exits = PollFor(group, 1, start);
  ASSERT_EQ(exits.size(), 1u);
  EXPECT_EQ(exits[0].first.status, 3);
  EXPECT_LT(exits[0].second, std::chrono::duration<double>(RankGroup::kCauseWindow).count());
}

}  // namespace
}  // namespace meshtrain::launch
