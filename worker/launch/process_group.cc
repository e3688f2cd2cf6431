#include "worker/launch/process_group.h"

#include <fcntl.h>
#include <sched.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <thread>

namespace meshtrain::launch {
namespace {

using Clock = std::chrono::steady_clock;

std::atomic<int> received_signal{0};

void RememberSignal(int signal) { received_signal.store(signal); }

int StatusOf(int wait_status) {
  if (WIFEXITED(wait_status)) return WEXITSTATUS(wait_status);
  if (WIFSIGNALED(wait_status)) return 128 + WTERMSIG(wait_status);
  return 1;
}

}  // namespace

LaunchResult RunProcessGroup(const std::vector<RankProcess>& ranks, const ProcessGroupOptions& options,
                             std::ostream& log) {
  if (options.command.empty()) throw std::runtime_error("a process group needs a command");
  std::vector<char*> argv;
  for (const std::string& arg : options.command) argv.push_back(const_cast<char*>(arg.c_str()));
  argv.push_back(nullptr);

  if (options.forward_signals) {
    received_signal.store(0);
    struct sigaction action{};
    action.sa_handler = RememberSignal;
    sigemptyset(&action.sa_mask);
    for (int signal : {SIGTERM, SIGINT, SIGHUP}) ::sigaction(signal, &action, nullptr);
  }

  std::map<pid_t, int> running;  // pid -> rank
  // A stopped rank (SIGSTOP, or a hang found by the heartbeat) would hold any signal but
  // SIGKILL until the grace ran out, so it is woken to take it.
  auto signal_all = [&](int signal) {
    for (const auto& [pid, rank] : running) {
      ::kill(pid, signal);
      if (signal != SIGKILL) ::kill(pid, SIGCONT);
    }
  };
  // The forwarded signals stay blocked across each fork: one that reached a child before it
  // dropped the launcher's handler would be swallowed by that handler, and the rank would
  // outlive its SIGTERM. The child unblocks them after resetting, so it dies of a pending one.
  sigset_t forwarded_signals, unblocked;
  sigemptyset(&forwarded_signals);
  for (int signal : {SIGTERM, SIGINT, SIGHUP}) sigaddset(&forwarded_signals, signal);
  for (const RankProcess& rank : ranks) {
    if (options.forward_signals) ::pthread_sigmask(SIG_BLOCK, &forwarded_signals, &unblocked);
    const pid_t pid = ::fork();
    if (pid < 0) {
      const int error = errno;
      if (options.forward_signals) ::pthread_sigmask(SIG_SETMASK, &unblocked, nullptr);
      signal_all(SIGKILL);
      throw std::runtime_error(std::string("fork failed: ") + std::strerror(error));
    }
    if (pid == 0) {
      if (options.forward_signals) {
        for (int signal : {SIGTERM, SIGINT, SIGHUP}) ::signal(signal, SIG_DFL);
        ::pthread_sigmask(SIG_SETMASK, &unblocked, nullptr);
      }
      for (const auto& [key, value] : rank.environment) ::setenv(key.c_str(), value.c_str(), 1);
      if (!rank.network_namespace.empty()) {
        const std::string path = "/run/netns/" + rank.network_namespace;
        const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
        if (fd < 0 || ::setns(fd, CLONE_NEWNET) != 0) {
          std::fprintf(stderr, "rank %d: cannot enter network namespace %s: %s\n", rank.rank, path.c_str(),
                       std::strerror(errno));
          ::_exit(127);
        }
        ::close(fd);
      }
      ::execvp(argv[0], argv.data());
      std::fprintf(stderr, "rank %d: cannot run %s: %s\n", rank.rank, argv[0], std::strerror(errno));
      ::_exit(127);
    }
    if (options.forward_signals) ::pthread_sigmask(SIG_SETMASK, &unblocked, nullptr);
    running[pid] = rank.rank;
  }

  LaunchResult result;
  const Clock::time_point started = Clock::now();
  Clock::time_point kill_at = Clock::time_point::max();
  bool stopping = false;
  int forwarded = 0;
  while (!running.empty()) {
    int wait_status = 0;
    const pid_t pid = ::waitpid(-1, &wait_status, WNOHANG);
    if (pid > 0 && running.count(pid) > 0) {
      const int rank = running[pid];
      running.erase(pid);
      const int status = StatusOf(wait_status);
      result.exits.push_back(RankExit{rank, status});
      if (status != 0 && result.status == 0 && forwarded == 0) {
        result.status = status;
        log << "rank " << rank << " failed with status " << status
            << (running.empty() || !options.stop_others_on_failure ? "" : "; stopping the other ranks") << "\n";
      }
      continue;
    }
    const Clock::time_point now = Clock::now();
    if (const int signal = received_signal.exchange(0); signal != 0 && options.forward_signals) {
      log << "received signal " << signal << "; passing it to " << running.size() << " rank(s)\n";
      forwarded = signal;
      signal_all(signal);
      if (!stopping) kill_at = now + options.grace;
      stopping = true;
    }
    const bool timed_out = options.timeout.count() > 0 && now - started > options.timeout;
    if (!stopping && ((result.status != 0 && options.stop_others_on_failure) || timed_out)) {
      if (timed_out) {
        log << "the job ran past its timeout of " << options.timeout.count() << " ms; stopping it\n";
        if (result.status == 0) result.status = 124;
      }
      stopping = true;
      signal_all(SIGTERM);
      kill_at = now + options.grace;
    }
    if (stopping && now > kill_at) {
      log << "ranks still running " << options.grace.count() << " ms after SIGTERM; killing them\n";
      signal_all(SIGKILL);
      kill_at = Clock::time_point::max();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  if (forwarded != 0 && result.status == 0) result.status = 128 + forwarded;
  return result;
}

}  // namespace meshtrain::launch
