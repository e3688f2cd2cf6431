#include "worker/launch/local_launcher.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <thread>

namespace meshtrain::launch {
namespace {

using Clock = std::chrono::steady_clock;

// A free TCP port on 127.0.0.1 for rank 0's Store.
int FreePort() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof(addr);
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &length) != 0) {
    if (fd >= 0) ::close(fd);
    throw std::runtime_error(std::string("cannot find a free port: ") + std::strerror(errno));
  }
  ::close(fd);
  return ntohs(addr.sin_port);
}

int StatusOf(int wait_status) {
  if (WIFEXITED(wait_status)) return WEXITSTATUS(wait_status);
  if (WIFSIGNALED(wait_status)) return 128 + WTERMSIG(wait_status);
  return 1;
}

}  // namespace

std::vector<std::string> SelfCommand(int argc, char** argv) {
  std::vector<std::string> command(argv, argv + argc);
  char self[4096];
  ssize_t length = ::readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (length > 0) command[0].assign(self, static_cast<size_t>(length));
  return command;
}

api::RankTable VirtualRankTable(int nodes, int ranks_per_node) {
  api::RankTable table;
  table.levels = {"kubernetes.io/hostname"};
  for (int n = 0; n < nodes; ++n) {
    api::RankTableNode node;
    node.node_rank = n;
    node.name = "virtual-node-" + std::to_string(n);
    node.topology_path = {node.name};
    for (int r = 0; r < ranks_per_node; ++r) node.ranks.push_back(n * ranks_per_node + r);
    table.nodes.push_back(node);
  }
  return table;
}

LaunchResult LaunchLocal(const LocalLaunch& launch, std::ostream& log) {
  if (launch.nodes < 1 || launch.ranks_per_node < 1 || launch.command.empty()) {
    throw std::runtime_error("a launch needs at least one node, one rank per node and a command");
  }
  int world = launch.nodes * launch.ranks_per_node;
  char directory_template[] = "/tmp/meshtrain-launch-XXXXXX";
  if (::mkdtemp(directory_template) == nullptr) {
    throw std::runtime_error(std::string("cannot make a temporary directory: ") + std::strerror(errno));
  }
  std::filesystem::path directory = directory_template;
  std::string table_path = (directory / "rank-table.json").string();
  std::ofstream(table_path) << api::ToJson(VirtualRankTable(launch.nodes, launch.ranks_per_node)).dump(2);
  std::string coordinator = "127.0.0.1:" + std::to_string(FreePort());

  std::vector<char*> argv;
  for (const std::string& arg : launch.command) argv.push_back(const_cast<char*>(arg.c_str()));
  argv.push_back(nullptr);

  std::map<pid_t, int> running;  // pid -> rank
  for (int rank = 0; rank < world; ++rank) {
    std::map<std::string, std::string> env = launch.environment;
    env["MESHTRAIN_JOB_NAME"] = launch.job_name;
    env["MESHTRAIN_COORDINATOR"] = coordinator;
    env["MESHTRAIN_RANK_TABLE"] = table_path;
    env["MESHTRAIN_NODE_RANK"] = std::to_string(rank / launch.ranks_per_node);
    env["MESHTRAIN_NNODES"] = std::to_string(launch.nodes);
    env["MESHTRAIN_NPROC_PER_NODE"] = std::to_string(launch.ranks_per_node);
    env["RANK"] = std::to_string(rank);
    env["WORLD_SIZE"] = std::to_string(world);
    env["LOCAL_RANK"] = std::to_string(rank % launch.ranks_per_node);
    env["MASTER_ADDR"] = "127.0.0.1";
    env["MASTER_PORT"] = coordinator.substr(coordinator.rfind(':') + 1);
    pid_t pid = ::fork();
    if (pid < 0) throw std::runtime_error(std::string("fork failed: ") + std::strerror(errno));
    if (pid == 0) {
      for (const auto& [key, value] : env) ::setenv(key.c_str(), value.c_str(), 1);
      ::execvp(argv[0], argv.data());
      std::fprintf(stderr, "rank %d: cannot run %s: %s\n", rank, argv[0], std::strerror(errno));
      ::_exit(127);
    }
    running[pid] = rank;
  }

  LaunchResult result;
  Clock::time_point started = Clock::now();
  Clock::time_point kill_at = Clock::time_point::max();
  bool stopping = false;
  auto stop_all = [&](int signal) {
    for (const auto& [pid, rank] : running) ::kill(pid, signal);
  };
  while (!running.empty()) {
    int wait_status = 0;
    pid_t pid = ::waitpid(-1, &wait_status, WNOHANG);
    if (pid > 0 && running.count(pid) > 0) {
      int rank = running[pid];
      running.erase(pid);
      int status = StatusOf(wait_status);
      result.exits.push_back(RankExit{rank, status});
      if (status != 0 && result.status == 0) {
        result.status = status;
        log << "rank " << rank << " failed with status " << status
            << (running.empty() || !launch.stop_others_on_failure ? "" : "; stopping the other ranks")
            << "\n";
      }
      continue;
    }
    Clock::time_point now = Clock::now();
    bool timed_out = launch.timeout.count() > 0 && now - started > launch.timeout;
    if (!stopping && ((result.status != 0 && launch.stop_others_on_failure) || timed_out)) {
      if (timed_out) {
        log << "the job ran past its timeout of " << launch.timeout.count() << " ms; stopping it\n";
        if (result.status == 0) result.status = 124;
      }
      stopping = true;
      stop_all(SIGTERM);
      kill_at = now + launch.grace;
    }
    if (stopping && now > kill_at) {
      stop_all(SIGKILL);
      kill_at = Clock::time_point::max();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  std::filesystem::remove_all(directory);
  return result;
}

}  // namespace meshtrain::launch
