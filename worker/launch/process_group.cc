#include "worker/launch/process_group.h"

#include <fcntl.h>
#include <sched.h>

#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <optional>
#include <stdexcept>
#include <string_view>
#include <thread>

#include "api/worker_contract.h"

namespace meshtrain::launch {
namespace {

using Clock = std::chrono::steady_clock;

constexpr int kStopSignals[] = {SIGTERM, SIGINT, SIGHUP};

std::atomic<int> received_signal{0};

void RememberSignal(int signal) { received_signal.store(signal); }

int StatusOf(int wait_status) {
  if (WIFEXITED(wait_status)) return WEXITSTATUS(wait_status);
  if (WIFSIGNALED(wait_status)) return 128 + WTERMSIG(wait_status);
  return 1;
}

// This process's environment with `variables` set on top, as execve takes it. Made before
// fork: the child of a process with other threads (a launcher's HTTP endpoint) may only
// make async-signal-safe calls, which setenv is not.
std::vector<std::string> EnvironmentWith(const std::map<std::string, std::string>& variables) {
  std::vector<std::string> entries;
  for (char** entry = environ; *entry != nullptr; ++entry) {
    const std::string_view text(*entry);
    if (variables.count(std::string(text.substr(0, text.find('=')))) == 0) entries.emplace_back(text);
  }
  for (const auto& [key, value] : variables) entries.push_back(key + "=" + value);
  return entries;
}

// The first line of what a failed rank wrote to its failure file; empty when it wrote nothing.
std::string ReadFailureReason(const MemoryFile& file) {
  const std::string text = file.Read(api::worker::kFailureReasonBytes + 1);
  return api::worker::FailureReasonLine(text.substr(0, text.find('\n')));
}

// While it lives, the stop signals are caught for TakeStopSignal(); then the actions that
// were there before it come back.
class CaughtStopSignals {
 public:
  CaughtStopSignals() {
    for (size_t i = 0; i < std::size(kStopSignals); ++i) ::sigaction(kStopSignals[i], nullptr, &previous_[i]);
    CatchStopSignals();
  }
  ~CaughtStopSignals() {
    for (size_t i = 0; i < std::size(kStopSignals); ++i) ::sigaction(kStopSignals[i], &previous_[i], nullptr);
  }
  CaughtStopSignals(const CaughtStopSignals&) = delete;
  CaughtStopSignals& operator=(const CaughtStopSignals&) = delete;

 private:
  struct sigaction previous_[std::size(kStopSignals)]{};
};

}  // namespace

void CatchStopSignals() {
  received_signal.store(0);
  struct sigaction action{};
  action.sa_handler = RememberSignal;
  sigemptyset(&action.sa_mask);
  for (int signal : kStopSignals) {
    struct sigaction current{};
    ::sigaction(signal, nullptr, &current);
    if (current.sa_handler != SIG_IGN) ::sigaction(signal, &action, nullptr);  // nohup's SIGHUP stays ignored
  }
}

int TakeStopSignal() { return received_signal.exchange(0); }

RankGroup::RankGroup(const std::vector<RankProcess>& ranks, const std::vector<std::string>& command,
                     bool caught_stop_signals) {
  if (command.empty()) throw std::runtime_error("a process group needs a command");
  std::vector<char*> argv;
  for (const std::string& arg : command) argv.push_back(const_cast<char*>(arg.c_str()));
  argv.push_back(nullptr);

  // The caught signals stay blocked across each fork: one that reached a child before it
  // dropped the launcher's handler would be swallowed by that handler, and the rank would
  // outlive its SIGTERM. The child unblocks them after resetting, so it dies of a pending one.
  const pid_t parent = ::getpid();
  sigset_t stop_signals, unblocked;
  sigemptyset(&stop_signals);
  for (int signal : kStopSignals) sigaddset(&stop_signals, signal);
  for (const RankProcess& rank : ranks) {
    std::map<std::string, std::string> variables = rank.environment;
    // The rank's failure file is in memory, held by this process and the rank only.
    // Without one the rank runs all the same, and a failure is reported by its status alone.
    int failure_fd = -1;
    try {
      MemoryFile file("meshtrain-rank-" + std::to_string(rank.rank) + "-failure", MemoryFile::Sharing::kOwn);
      failure_fd = file.fd();
      variables[api::worker::env::kFailureFile] = file.path();
      failure_files_.insert_or_assign(rank.rank, std::move(file));
    } catch (const std::runtime_error&) {
    }
    const std::vector<std::string> environment = EnvironmentWith(variables);
    std::vector<char*> envp;
    for (const std::string& entry : environment) envp.push_back(const_cast<char*>(entry.c_str()));
    envp.push_back(nullptr);
    const std::string network_namespace =
        rank.network_namespace.empty() ? "" : "/run/netns/" + rank.network_namespace;

    if (caught_stop_signals) ::pthread_sigmask(SIG_BLOCK, &stop_signals, &unblocked);
    const pid_t pid = ::fork();
    if (pid < 0) {
      const int error = errno;
      if (caught_stop_signals) ::pthread_sigmask(SIG_SETMASK, &unblocked, nullptr);
      KillAndReap();  // the destructor does not run: the members (the failure files) close themselves
      throw std::runtime_error(std::string("fork failed: ") + std::strerror(error));
    }
    if (pid == 0) {
      // A rank dies with the process that started it, even of SIGKILL: nothing else would
      // stop it. (If that process died before this call, the signal would never come.)
      if (::prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || ::getppid() != parent) ::_exit(127);
      if (failure_fd >= 0) ::fcntl(failure_fd, F_SETFD, 0);  // the rank's own, kept across exec
      if (caught_stop_signals) {
        for (int signal : kStopSignals) {
          struct sigaction current{};
          ::sigaction(signal, nullptr, &current);
          if (current.sa_handler == RememberSignal) ::signal(signal, SIG_DFL);
        }
        ::pthread_sigmask(SIG_SETMASK, &unblocked, nullptr);
      }
      if (!network_namespace.empty()) {
        const int fd = ::open(network_namespace.c_str(), O_RDONLY | O_CLOEXEC);
        if (fd < 0 || ::setns(fd, CLONE_NEWNET) != 0) {
          std::fprintf(stderr, "rank %d: cannot enter network namespace %s: %s\n", rank.rank,
                       network_namespace.c_str(), std::strerror(errno));
          ::_exit(127);
        }
        ::close(fd);
      }
      ::execvpe(argv[0], argv.data(), envp.data());
      std::fprintf(stderr, "rank %d: cannot run %s: %s\n", rank.rank, argv[0], std::strerror(errno));
      ::_exit(127);
    }
    if (caught_stop_signals) ::pthread_sigmask(SIG_SETMASK, &unblocked, nullptr);
    running_[pid] = rank.rank;
  }
}

RankGroup::~RankGroup() { KillAndReap(); }

void RankGroup::KillAndReap() {
  for (const auto& [pid, rank] : running_) {
    ::kill(pid, SIGKILL);
    ::waitpid(pid, nullptr, 0);
  }
  running_.clear();
}

std::vector<RankExit> RankGroup::Poll(std::ostream& log) {
  std::vector<RankExit> exits;
  int wait_status = 0;
  for (pid_t pid; (pid = ::waitpid(-1, &wait_status, WNOHANG)) > 0;) {
    // Any other child is an orphan this process adopted (a pod's PID 1); reaping it is all.
    if (const auto it = running_.find(pid); it != running_.end()) {
      RankExit exit{it->second, StatusOf(wait_status), ""};
      const auto file = failure_files_.find(exit.rank);
      if (exit.status != 0 && file != failure_files_.end()) exit.reason = ReadFailureReason(file->second);
      exits.push_back(std::move(exit));
      running_.erase(it);
    }
  }
  // A collective's failures wait for their cause (see kCauseWindow), and come after it.
  const Clock::time_point now = Clock::now();
  const auto victims = std::stable_partition(
      exits.begin(), exits.end(), [](const RankExit& e) { return e.status != api::worker::kExitCommFailure; });
  if (held_.empty()) held_since_ = now;
  held_.insert(held_.end(), std::make_move_iterator(victims), std::make_move_iterator(exits.end()));
  exits.erase(victims, exits.end());
  if (!held_.empty() && (!exits.empty() || running_.empty() || now - held_since_ >= kCauseWindow)) {
    exits.insert(exits.end(), std::make_move_iterator(held_.begin()), std::make_move_iterator(held_.end()));
    held_.clear();
  }
  if (!running_.empty() && now > kill_at_) {
    log << "ranks still running " << grace_.count() << " ms after SIGTERM; killing them\n";
    for (const auto& [pid, rank] : running_) ::kill(pid, SIGKILL);
    kill_at_ = Clock::time_point::max();
  }
  return exits;
}

void RankGroup::Terminate(int signal, std::chrono::milliseconds grace) {
  // A stopped rank (SIGSTOP, or a hang found by the heartbeat) would hold any signal but
  // SIGKILL until the grace ran out, so it is woken to take it.
  for (const auto& [pid, rank] : running_) {
    ::kill(pid, signal);
    if (signal != SIGKILL) ::kill(pid, SIGCONT);
  }
  if (const Clock::time_point deadline = Clock::now() + grace; deadline < kill_at_) {
    kill_at_ = deadline;
    grace_ = grace;
  }
}

LaunchResult RunProcessGroup(const std::vector<RankProcess>& ranks, const ProcessGroupOptions& options,
                             std::ostream& log) {
  std::optional<CaughtStopSignals> caught;
  if (options.forward_signals) caught.emplace();
  RankGroup group(ranks, options.command, options.forward_signals);

  LaunchResult result;
  const Clock::time_point started = Clock::now();
  bool stopping = false;
  int forwarded = 0;
  while (!group.empty()) {
    const std::vector<RankExit> exits = group.Poll(log);
    for (size_t i = 0; i < exits.size(); ++i) {
      const RankExit& exit = exits[i];
      result.exits.push_back(exit);
      if (exit.status != 0 && result.status == 0 && forwarded == 0) {
        result.status = exit.status;
        const bool others_run = group.size() + (exits.size() - i - 1) > 0;
        log << "rank " << exit.rank << (exit.status == api::worker::kExitStopped ? " stopped" : " failed")
            << " with status " << exit.status
            << (others_run && options.stop_others_on_failure ? "; stopping the other ranks" : "") << "\n";
      }
    }
    const Clock::time_point now = Clock::now();
    if (const int signal = options.forward_signals ? TakeStopSignal() : 0; signal != 0) {
      log << "received signal " << signal << "; passing it to " << group.size() << " rank(s)\n";
      forwarded = signal;
      group.Terminate(signal, options.grace);
      stopping = true;
    }
    const bool timed_out = options.timeout.count() > 0 && now - started > options.timeout;
    if (!stopping && ((result.status != 0 && options.stop_others_on_failure) || timed_out)) {
      if (timed_out) {
        log << "the job ran past its timeout of " << options.timeout.count() << " ms; stopping it\n";
        if (result.status == 0) result.status = 124;
      }
      stopping = true;
      group.Terminate(SIGTERM, options.grace);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  // A signal that came after the last rank ended still stops the run.
  if (const int late = options.forward_signals ? TakeStopSignal() : 0; late != 0 && forwarded == 0) forwarded = late;
  result.stop_signal = forwarded;
  if (forwarded != 0 && result.status == 0) result.status = 128 + forwarded;
  return result;
}

}  // namespace meshtrain::launch
