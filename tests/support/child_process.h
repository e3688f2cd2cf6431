// A child process for integration tests: `argv` run with extra environment, its stdout and
// stderr in a log file. Unless it was waited for, the destructor kills it with SIGKILL,
// and its children first (a launcher's ranks).
//
// Thread-safety: one thread uses an object.

#pragma once

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <thread>
#include <vector>

namespace meshtrain::testing {

struct ChildExit {
  int status = -1;  // exit code, 128 + signal, or -1 if it had to be killed at the deadline
  std::string output;
};

class ChildProcess {
 public:
  ChildProcess(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env,
               const std::filesystem::path& log)
      : log_(log) {
    pid_ = ::fork();
    if (pid_ == 0) {
      const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      ::dup2(fd, 1);
      ::dup2(fd, 2);
      for (const auto& [k, v] : env) ::setenv(k.c_str(), v.c_str(), 1);
      std::vector<char*> args;
      for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
      args.push_back(nullptr);
      ::execv(args[0], args.data());
      ::_exit(127);
    }
  }
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;
  ~ChildProcess() {
    if (pid_ <= 0 || done_) return;
    for (pid_t child : Children()) ::kill(child, SIGKILL);
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
  }

  pid_t pid() const { return pid_; }

  // Waits up to `deadline` for it to exit; past it, kills it (status -1).
  ChildExit Wait(std::chrono::milliseconds deadline) {
    ChildExit exit;
    const auto until = std::chrono::steady_clock::now() + deadline;
    int status = 0;
    while (::waitpid(pid_, &status, WNOHANG) == 0) {
      if (std::chrono::steady_clock::now() > until) {
        for (pid_t child : Children()) ::kill(child, SIGKILL);
        ::kill(pid_, SIGKILL);
        ::waitpid(pid_, &status, 0);
        done_ = true;
        exit.output = Output();
        return exit;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    done_ = true;
    exit.status = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    exit.output = Output();
    return exit;
  }

  // What it has written so far.
  std::string Output() const {
    std::ifstream in(log_);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }

  // The pids of its children now.
  std::vector<pid_t> Children() const {
    std::ifstream in("/proc/" + std::to_string(pid_) + "/task/" + std::to_string(pid_) + "/children");
    std::vector<pid_t> pids;
    for (pid_t p; in >> p;) pids.push_back(p);
    return pids;
  }

 private:
  std::filesystem::path log_;
  pid_t pid_ = -1;
  bool done_ = false;
};

}  // namespace meshtrain::testing
