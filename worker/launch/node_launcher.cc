#include "worker/launch/node_launcher.h"

#include <signal.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <fstream>
#include <iterator>
#include <optional>
#include <stdexcept>
#include <thread>

#include "api/environment.h"
#include "worker/launch/launcher_control.h"
#include "worker/metrics/http_endpoint.h"

namespace meshtrain::launch {

namespace env = api::worker::env;

namespace {

using Clock = std::chrono::steady_clock;

constexpr size_t kMinimumTokenLength = 16;

// The token in `path` (kLauncherTokenFile), less a final line break. Throws
// std::runtime_error naming the variable and the file when it cannot be read or is too short.
std::string ReadToken(const std::string& path) {
  const std::string where = std::string(env::kLauncherTokenFile) + "=" + path;
  std::ifstream file(path, std::ios::binary);
  if (!file) throw std::runtime_error(where + ": cannot open it: " + std::strerror(errno));
  std::string token{std::istreambuf_iterator<char>(file), std::istreambuf_iterator<char>()};
  if (file.bad()) throw std::runtime_error(where + ": cannot read it: " + std::strerror(errno));
  if (token.ends_with('\n')) token.pop_back();
  if (token.ends_with('\r')) token.pop_back();
  if (token.size() < kMinimumTokenLength) {
    throw std::runtime_error(where + ": the token is " + std::to_string(token.size()) +
                             " characters long; it must have at least " + std::to_string(kMinimumTokenLength));
  }
  return token;
}

std::vector<RankProcess> WithAttempt(std::vector<RankProcess> ranks, int attempt) {
  for (RankProcess& rank : ranks) rank.environment[env::kAttempt] = std::to_string(attempt);
  return ranks;
}

// The launcher with the operator's control endpoint (launcher_control.h): it supervises
// the ranks of one attempt at a time on this thread, and carries out the instructions
// the endpoint's thread takes.
int LaunchControlled(const NodeLaunch& launch, const std::vector<RankProcess>& ranks, std::ostream& log) {
  const std::string these_ranks =
      "ranks " + std::to_string(ranks.front().rank) + ".." + std::to_string(ranks.back().rank);
  const double hold_seconds = std::chrono::duration<double>(launch.hold).count();
  CatchStopSignals();
  LauncherControl control(launch.token, AttemptStatus{launch.attempt,
                                                      launch.held ? AttemptState::kReady : AttemptState::kRunning, {}, {}});
  metrics::HttpEndpoint endpoint(launch.control_host, launch.control_port, control.Routes(),
                                 {.name = "the launcher's control endpoint"});
  // However the launcher ends, an instruction waiting for it is answered first, so that
  // the endpoint's thread is free to stop.
  struct CloseOnExit {
    LauncherControl& control;
    ~CloseOnExit() { control.Close("the launcher is exiting"); }
  } close_on_exit{control};
  log << "serving the launcher's control endpoint on " << launch.control_host << ":" << endpoint.port() << "\n";

  AttemptStatus status = control.status();
  std::optional<RankGroup> group;
  Clock::time_point hold_until = Clock::time_point::max();
  if (launch.held) {
    hold_until = Clock::now() + launch.hold;
    log << "attempt " << status.attempt << ": ready; waiting for the operator's start (up to " << hold_seconds
        << " s)\n";
  } else {
    group.emplace(WithAttempt(ranks, status.attempt), launch.command, true);
    log << "attempt " << status.attempt << ": starting " << these_ranks << std::endl;
  }
  int failed_status = 0;  // what the end of a hold exits with: the last failure's, until the next start
  bool permanent = false;
  int forwarded = 0;
  std::optional<int> stopping_for;  // the attempt an instruction stops the ranks for
  for (;; std::this_thread::sleep_for(std::chrono::milliseconds(5))) {
    const Clock::time_point now = Clock::now();
    for (const RankExit& exit : group ? group->Poll(log) : std::vector<RankExit>{}) {
      if (status.state == AttemptState::kStopping) {  // a suspend: each rank's end is reported
        status.stops.push_back(exit);
        continue;
      }
      // After the first failure, a stop or a forwarded signal, ranks end because they were told to.
      if (exit.status == 0 || status.state != AttemptState::kRunning || stopping_for || forwarded != 0) continue;
      status = AttemptStatus{status.attempt, AttemptState::kFailed, exit, {}};
      control.Set(status);
      failed_status = exit.status;
      group->Terminate(SIGTERM, launch.restart_grace);
      // "rank 1 failed with exit code 75 (what it wrote of its failure, if anything)"
      log << "rank " << exit.rank << " failed with exit code " << exit.status;
      if (exit.status == api::worker::kExitPermanent) {
        permanent = true;
        log << " (a permanent failure, which no restart fixes" << (exit.reason.empty() ? "" : ": " + exit.reason)
            << "); stopping the other ranks and exiting with it\n";
      } else {
        hold_until = now + launch.hold;
        log << (exit.reason.empty() ? "" : " (" + exit.reason + ")")
            << "; stopping the other ranks and holding for the operator's next attempt (up to " << hold_seconds
            << " s)\n";
      }
    }
    const bool ranks_ended = !group || group->empty();
    if (permanent) {
      if (ranks_ended) return api::worker::kExitPermanent;
      continue;
    }

    if (const int signal = TakeStopSignal(); signal != 0) {
      log << "received signal " << signal << "; passing it to " << (group ? group->size() : 0) << " rank(s)\n";
      forwarded = signal;
      if (group) group->Terminate(signal, launch.grace);
      control.Close("the launcher received signal " + std::to_string(signal) + " and is exiting");
    }
    if (forwarded != 0) {
      if (ranks_ended) return status.state == AttemptState::kFailed ? status.failure.status : 128 + forwarded;
      continue;
    }

    if (status.state == AttemptState::kStopping && ranks_ended) {
      std::sort(status.stops.begin(), status.stops.end(),
                [](const RankExit& a, const RankExit& b) { return a.rank < b.rank; });
      std::string late;
      for (const RankExit& exit : status.stops)
        if (exit.status != api::worker::kExitStopped && exit.status != 0) late += " " + std::to_string(exit.rank);
      status.state = AttemptState::kSuspended;
      control.Set(status);
      hold_until = now + launch.hold;
      log << "attempt " << status.attempt << ": suspended; "
          << (late.empty() ? "every rank stopped" : "ranks that did not stop after a checkpoint:" + late)
          << "; waiting for the pod's end (up to " << hold_seconds << " s)\n";
    }

    if (status.state == AttemptState::kRunning && !stopping_for && ranks_ended) {
      status.state = AttemptState::kSucceeded;
      control.Set(status);
      log << "attempt " << status.attempt << ": every rank exited 0\n";
      return 0;
    }

    // The endpoint takes a stop only for a later attempt, and a start only for this
    // attempt while it is ready, which nothing but these instructions changes.
    if (const std::optional<AttemptInstruction> instruction = control.Pending()) {
      if (instruction->kind == AttemptInstruction::kStop) {
        if (!stopping_for && !ranks_ended) {
          log << "attempt " << instruction->attempt << ": stopping " << these_ranks << " of attempt " << status.attempt
              << "\n";
          group->Terminate(SIGTERM, launch.restart_grace);
        }
        stopping_for = instruction->attempt;
        if (ranks_ended) {
          group.reset();
          stopping_for.reset();
          status = AttemptStatus{instruction->attempt, AttemptState::kReady, {}, {}};
          hold_until = now + launch.hold;
          control.Complete(status);
          log << "attempt " << status.attempt << ": ready; waiting for the operator's start (up to " << hold_seconds
              << " s)\n";
        }
      } else if (instruction->kind == AttemptInstruction::kSuspend) {
        // The ranks agree on a step to stop after, checkpoint it and exit; those still
        // running after the grace are killed, and reported so.
        if (status.state == AttemptState::kRunning && !stopping_for && !ranks_ended) {
          log << "attempt " << status.attempt << ": suspending: asking " << these_ranks
              << " to checkpoint and stop (up to " << std::chrono::duration<double>(launch.grace).count() << " s)\n";
          group->Terminate(api::worker::kStopSignal, launch.grace);
          status = AttemptStatus{status.attempt, AttemptState::kStopping, {}, {}};
        } else {
          log << "attempt " << status.attempt << ": suspended; no rank runs\n";
          status = AttemptStatus{status.attempt, AttemptState::kSuspended, {}, {}};
          hold_until = now + launch.hold;
        }
        control.Complete(status);
      } else {
        log << "attempt " << status.attempt << ": starting " << these_ranks << std::endl;
        group.emplace(WithAttempt(ranks, status.attempt), launch.command, true);
        status.state = AttemptState::kRunning;
        failed_status = 0;
        hold_until = Clock::time_point::max();
        control.Complete(status);
      }
    }

    // The hold runs from the operator's last instruction: it renews a stop while it waits.
    if (hold_until != Clock::time_point::max()) hold_until = std::max(hold_until, control.last_instruction() + launch.hold);
    if (ranks_ended && !stopping_for && now > hold_until) {
      // Without a failure, the ranks were stopped by the operator, with SIGTERM.
      const int exit_status = failed_status != 0 ? failed_status : 128 + SIGTERM;
      log << "no instruction from the operator within " << hold_seconds << " s; exiting with status " << exit_status
          << "\n";
      return exit_status;
    }
  }
}

}  // namespace

std::vector<RankProcess> RanksOfThisNode() {
  const int node_rank = api::EnvironmentRank(env::kNodeRank, 0);
  const int nodes = api::EnvironmentRank(env::kNodes, 1);
  const int per_node = api::EnvironmentRank(env::kRanksPerNode, 1);
  if (node_rank >= nodes) {
    throw std::runtime_error(std::string(env::kNodeRank) + "=" + std::to_string(node_rank) + " is not below " +
                             env::kNodes + "=" + std::to_string(nodes));
  }
  std::vector<RankProcess> ranks;
  for (int local = 0; local < per_node; ++local) {
    RankProcess process;
    process.rank = node_rank * per_node + local;
    process.environment = {{env::kRank, std::to_string(process.rank)},
                           {env::kLocalRank, std::to_string(local)},
                           {env::kWorldSize, std::to_string(nodes * per_node)},
                           {env::kLocalWorldSize, std::to_string(per_node)},
                           {env::kTorchNodeRank, std::to_string(node_rank)}};
    ranks.push_back(std::move(process));
  }
  return ranks;
}

NodeLaunch NodeLaunchFromEnvironment(std::vector<std::string> command) {
  NodeLaunch launch;
  launch.command = std::move(command);
  launch.attempt = int(api::EnvironmentInteger(env::kAttempt, 0, INT_MAX, 0));
  launch.held = api::EnvironmentInteger(env::kLauncherHeld, 0, 1, 0) == 1;
  const std::string token_file = api::EnvironmentString(env::kLauncherTokenFile);
  if (!token_file.empty()) launch.token = ReadToken(token_file);
  if (launch.held && launch.token.empty()) {
    throw std::runtime_error(std::string(env::kLauncherHeld) + "=1 needs " + env::kLauncherTokenFile +
                             ": without a control endpoint, nothing would ever start the ranks");
  }
  launch.hold = std::chrono::seconds(api::EnvironmentInteger(env::kLauncherHoldSeconds, 0, 3600, 60));
  launch.control_host = api::EnvironmentString(env::kPodIp, "0.0.0.0");
  launch.control_port = int(api::EnvironmentInteger(env::kLauncherPort, 1, 65535, api::worker::kLauncherPort));
  return launch;
}

int LaunchNode(const NodeLaunch& launch, std::ostream& log) {
  const std::vector<RankProcess> ranks = RanksOfThisNode();
  log << "launching ranks " << ranks.front().rank << ".." << ranks.back().rank << " of this node" << std::endl;
  if (!launch.token.empty()) return LaunchControlled(launch, ranks, log);
  ProcessGroupOptions options;
  options.command = launch.command;
  options.grace = launch.grace;
  options.forward_signals = true;
  return RunProcessGroup(WithAttempt(ranks, launch.attempt), options, log).status;
}

}  // namespace meshtrain::launch
