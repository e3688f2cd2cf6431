// The pod launcher (`meshtrain-worker launch`) restarting its ranks in place as the
// operator instructs it over its control endpoint (worker/launch/launcher_control.h),
// and ending when it must: a configuration error, a hold without instructions, no token.
// The ranks are small shell scripts (`launch -- sh -c ...`); MESHTRAIN_WORKER is the
// binary under test.

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "tests/support/child_process.h"
#include "worker/launch/local_launcher.h"

namespace meshtrain {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

constexpr const char* kToken = "launcher-test-token-0123456789";

// `meshtrain-worker launch -- sh -c SCRIPT` with extra environment, its output in a file.
testing::ChildProcess Launch(const std::string& script, const std::map<std::string, std::string>& env,
                             const fs::path& log) {
  return testing::ChildProcess({MESHTRAIN_WORKER, "launch", "--", "/bin/sh", "-c", script}, env, log);
}

struct Answer {
  int code = 0;  // 0: no answer
  nlohmann::json body;
};

// One request to the control endpoint on 127.0.0.1:port; retries the connection for
// `connecting`, as the launcher may not be listening yet.
Answer Request(int port, const std::string& method, const std::string& target,
               std::chrono::milliseconds connecting = 10s) {
  int fd = -1;
  for (const auto until = Clock::now() + connecting; Clock::now() < until; std::this_thread::sleep_for(20ms)) {
    fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_port = htons(uint16_t(port));
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) == 0) break;
    ::close(fd);
    fd = -1;
  }
  Answer answer;
  if (fd < 0) return answer;
  const std::string request = method + " " + target + " HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n";
  ::send(fd, request.data(), request.size(), MSG_NOSIGNAL);
  std::string response;
  char buffer[4096];
  for (pollfd p{fd, POLLIN, 0}; ::poll(&p, 1, 15000) > 0;) {
    const ssize_t n = ::recv(fd, buffer, sizeof buffer, 0);
    if (n <= 0) break;
    response.append(buffer, size_t(n));
  }
  ::close(fd);
  if (response.size() < 12) return answer;
  answer.code = std::stoi(response.substr(9, 3));
  answer.body = nlohmann::json::parse(response.substr(response.find("\r\n\r\n") + 4), nullptr, false);
  return answer;
}

std::string Instruction(const std::string& what, int attempt, const std::string& token = kToken) {
  return "/attempt/" + what + "?attempt=" + std::to_string(attempt) + "&token=" + token;
}

// GET /attempt until its state is `state`; the last answer.
Answer AwaitState(int port, const std::string& state, std::chrono::milliseconds deadline = 20s) {
  Answer answer;
  for (const auto until = Clock::now() + deadline; Clock::now() < until; std::this_thread::sleep_for(20ms)) {
    answer = Request(port, "GET", "/attempt");
    if (answer.code == 200 && answer.body.value("state", "") == state) break;
  }
  return answer;
}

bool Contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

class LauncherTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("meshtrain-launcher-test-" + std::to_string(::getpid()));
    fs::create_directories(dir_);
    port_ = launch::FreeLoopbackPort();
  }
  void TearDown() override { fs::remove_all(dir_); }

  // A pod of one node with two ranks, its control endpoint on 127.0.0.1:port_, and its
  // token (none if empty) in a file, as the operator mounts it.
  std::map<std::string, std::string> Pod(const std::string& token = kToken) const {
    std::map<std::string, std::string> env = {
        {"MESHTRAIN_NODE_RANK", "0"},      {"MESHTRAIN_NNODES", "1"},
        {"MESHTRAIN_NPROC_PER_NODE", "2"}, {"MESHTRAIN_POD_IP", "127.0.0.1"},
        {"MESHTRAIN_LAUNCHER_PORT", std::to_string(port_)}};
    if (token.empty()) return env;
    std::ofstream(dir_ / "token") << token;
    env["MESHTRAIN_LAUNCHER_TOKEN_FILE"] = (dir_ / "token").string();
    return env;
  }

  fs::path dir_;
  int port_ = 0;
};

TEST_F(LauncherTest, RestartsItsRanksInPlaceWhenTheOperatorSaysSo) {
  // Each rank notes its start. Attempt 0: rank 1 fails with 3 (once rank 0 has noted its
  // start), saying why in its failure file, while rank 0 trains on; attempt 1: both succeed.
  const std::string seen_path = (dir_ / "seen").string();
  const std::string script = "echo \"$RANK $MESHTRAIN_ATTEMPT\" >> " + seen_path +
                             "; if [ \"$MESHTRAIN_ATTEMPT\" = 0 ]; then if [ \"$RANK\" = 1 ]; then until grep -q '^0 0$' " +
                             seen_path + "; do sleep 0.01; done; echo 'lost rank 0' > \"$MESHTRAIN_FAILURE_FILE\"; "
                             "exit 3; fi; exec sleep 60; fi";
  testing::ChildProcess launcher = Launch(script, Pod(), dir_ / "launch.log");

  const Answer failed = AwaitState(port_, "failed");
  EXPECT_EQ(failed.body, (nlohmann::json{{"attempt", 0}, {"state", "failed"}, {"exitCode", 3}, {"rank", 1},
                                         {"reason", "lost rank 0"}}))
      << launcher.Output();
  EXPECT_EQ(Request(port_, "POST", Instruction("stop", 1, "not-the-token-0123456789")).code, 403);
  EXPECT_EQ(Request(port_, "POST", Instruction("start", 0)).code, 409) << "attempt 0 failed; it is not ready";
  EXPECT_EQ(Request(port_, "GET", "/attempt").body, failed.body) << "refused requests changed something";

  const Answer stop = Request(port_, "POST", Instruction("stop", 1));
  EXPECT_EQ(stop.code, 200) << stop.body;
  EXPECT_EQ(stop.body, (nlohmann::json{{"attempt", 1}, {"state", "ready"}})) << launcher.Output();
  EXPECT_TRUE(launcher.Children().empty()) << "ready with ranks of attempt 0 still running";
  EXPECT_EQ(Request(port_, "POST", Instruction("stop", 1)).body, stop.body) << "a repeated stop changes nothing";

  const Answer start = Request(port_, "POST", Instruction("start", 1));
  EXPECT_EQ(start.code, 200) << start.body;
  EXPECT_EQ(start.body, (nlohmann::json{{"attempt", 1}, {"state", "running"}}));
  EXPECT_EQ(launcher.Wait(20s).status, 0) << launcher.Output();

  const std::string output = launcher.Output();
  for (const char* line : {"rank 1 failed with exit code 3 (lost rank 0); stopping the other ranks and holding for "
                           "the operator's next attempt (up to 60 s)",
                           "attempt 1: ready",
                           "attempt 1: starting ranks 0..1", "attempt 1: every rank exited 0"}) {
    EXPECT_TRUE(Contains(output, line)) << line << "\n" << output;
  }
  std::ifstream seen_file(seen_path);
  std::multiset<std::string> seen;
  for (std::string line; std::getline(seen_file, line);) seen.insert(line);
  EXPECT_EQ(seen, (std::multiset<std::string>{"0 0", "1 0", "0 1", "1 1"})) << "RANK MESHTRAIN_ATTEMPT of each start";
}

// A pod that replaces a lost one starts held: ready at its attempt, its ranks started
// only by the operator's start, with the rest of the gang.
TEST_F(LauncherTest, AHeldLauncherStartsItsRanksOnlyAtTheOperatorsStart) {
  auto pod = Pod();
  pod["MESHTRAIN_ATTEMPT"] = "2";
  pod["MESHTRAIN_LAUNCHER_HELD"] = "1";
  const std::string seen_path = (dir_ / "seen").string();
  testing::ChildProcess launcher = Launch("echo \"$RANK $MESHTRAIN_ATTEMPT\" >> " + seen_path, pod, dir_ / "held.log");
  const Answer ready = AwaitState(port_, "ready");
  EXPECT_EQ(ready.body, (nlohmann::json{{"attempt", 2}, {"state", "ready"}})) << launcher.Output();
  std::this_thread::sleep_for(200ms);
  EXPECT_TRUE(launcher.Children().empty()) << "a held launcher started its ranks";
  EXPECT_FALSE(fs::exists(seen_path));
  EXPECT_EQ(Request(port_, "POST", Instruction("start", 1)).code, 409) << "attempt 1 is not the held one";

  const Answer start = Request(port_, "POST", Instruction("start", 2));
  EXPECT_EQ(start.body, (nlohmann::json{{"attempt", 2}, {"state", "running"}})) << launcher.Output();
  EXPECT_EQ(launcher.Wait(20s).status, 0) << launcher.Output();
  std::ifstream seen_file(seen_path);
  std::multiset<std::string> seen;
  for (std::string line; std::getline(seen_file, line);) seen.insert(line);
  EXPECT_EQ(seen, (std::multiset<std::string>{"0 2", "1 2"})) << launcher.Output();
  EXPECT_TRUE(Contains(launcher.Output(), "attempt 2: ready; waiting for the operator's start (up to 60 s)"))
      << launcher.Output();
}

// While the operator waits for a replacement pod, it repeats its stop to the launchers that
// wait; each instruction renews the hold, and only silence ends it.
TEST_F(LauncherTest, EachInstructionRenewsTheHold) {
  auto pod = Pod();
  pod["MESHTRAIN_ATTEMPT"] = "1";
  pod["MESHTRAIN_LAUNCHER_HELD"] = "1";
  pod["MESHTRAIN_LAUNCHER_HOLD_SECONDS"] = "1";
  testing::ChildProcess launcher = Launch("exit 0", pod, dir_ / "renewed.log");
  ASSERT_EQ(AwaitState(port_, "ready").body.value("attempt", -1), 1) << launcher.Output();
  const auto renewed_until = Clock::now() + 2500ms;
  while (Clock::now() < renewed_until) {
    EXPECT_EQ(Request(port_, "POST", Instruction("stop", 1)).code, 200) << launcher.Output();
    std::this_thread::sleep_for(300ms);
  }
  EXPECT_EQ(Request(port_, "GET", "/attempt").body, (nlohmann::json{{"attempt", 1}, {"state", "ready"}}))
      << "renewed 2.5 s past a 1 s hold, the launcher gave up: " << launcher.Output();
  const auto silent = Clock::now();
  EXPECT_EQ(launcher.Wait(10s).status, 128 + SIGTERM) << launcher.Output();
  EXPECT_GE(Clock::now() - silent, 600ms);
  EXPECT_TRUE(Contains(launcher.Output(), "no instruction from the operator within 1 s")) << launcher.Output();
}

TEST_F(LauncherTest, AHeldLauncherWithoutATokenIsAConfigurationError) {
  auto pod = Pod("");
  pod["MESHTRAIN_LAUNCHER_HELD"] = "1";
  testing::ChildProcess launcher = Launch("exit 0", pod, dir_ / "held-no-token.log");
  EXPECT_EQ(launcher.Wait(20s).status, 78) << launcher.Output();
  EXPECT_TRUE(Contains(launcher.Output(), "MESHTRAIN_LAUNCHER_HELD=1 needs MESHTRAIN_LAUNCHER_TOKEN_FILE"))
      << launcher.Output();
}

TEST_F(LauncherTest, AStopKillsRanksThatIgnoreSigtermAfterItsGrace) {
  auto pod = Pod();
  pod["MESHTRAIN_ATTEMPT"] = "4";
  pod["MESHTRAIN_LAUNCHER_HOLD_SECONDS"] = "1";
  testing::ChildProcess launcher = Launch("trap '' TERM; exec sleep 120", pod, dir_ / "stubborn.log");
  EXPECT_EQ(AwaitState(port_, "running").body, (nlohmann::json{{"attempt", 4}, {"state", "running"}}));
  // Both ranks ignore SIGTERM once their shell has become `sleep`.
  const auto sleeping = [](pid_t pid) {
    std::string name;
    std::ifstream("/proc/" + std::to_string(pid) + "/comm") >> name;
    return name == "sleep";
  };
  std::vector<pid_t> ranks;
  for (const auto until = Clock::now() + 10s; Clock::now() < until; std::this_thread::sleep_for(10ms)) {
    ranks = launcher.Children();
    if (ranks.size() == 2 && sleeping(ranks[0]) && sleeping(ranks[1])) break;
  }
  ASSERT_EQ(ranks.size(), 2u);

  const auto asked = Clock::now();
  const Answer stop = Request(port_, "POST", Instruction("stop", 5));
  const auto took = Clock::now() - asked;
  EXPECT_EQ(stop.body, (nlohmann::json{{"attempt", 5}, {"state", "ready"}})) << launcher.Output();
  EXPECT_GE(took, 90ms) << "the ranks ignore SIGTERM; only the SIGKILL after 0.1 s ends them";
  EXPECT_LT(took, 8s);
  for (pid_t rank : ranks) EXPECT_NE(::kill(rank, 0), 0) << "rank process " << rank << " outlived the stop";

  // Ready, and no start within the hold: the launcher gives up as a stopped pod.
  EXPECT_EQ(launcher.Wait(10s).status, 128 + SIGTERM) << launcher.Output();
  EXPECT_TRUE(Contains(launcher.Output(), "attempt 5: stopping ranks 0..1 of attempt 4")) << launcher.Output();
  EXPECT_TRUE(Contains(launcher.Output(), "ranks still running 100 ms after SIGTERM; killing them"))
      << launcher.Output();
  EXPECT_TRUE(Contains(launcher.Output(), "no instruction from the operator within 1 s; exiting with status 143"))
      << launcher.Output();
}

TEST_F(LauncherTest, AConfigurationErrorEndsTheLauncherWithoutHolding) {
  testing::ChildProcess launcher = Launch("[ \"$RANK\" = 1 ] && exit 78; exec sleep 60", Pod(), dir_ / "config.log");
  const auto started = Clock::now();
  EXPECT_EQ(launcher.Wait(20s).status, 78) << launcher.Output();
  EXPECT_LT(Clock::now() - started, 10s);
  EXPECT_TRUE(Contains(launcher.Output(), "rank 1 failed with exit code 78 (a permanent failure, which no restart fixes")) << launcher.Output();
  EXPECT_FALSE(Contains(launcher.Output(), "holding")) << launcher.Output();
}

TEST_F(LauncherTest, WithoutAnInstructionTheHoldEndsWithTheFailedRanksStatus) {
  auto pod = Pod();
  pod["MESHTRAIN_LAUNCHER_HOLD_SECONDS"] = "1";
  testing::ChildProcess launcher = Launch("[ \"$RANK\" = 0 ] && exit 3; exec sleep 60", pod, dir_ / "hold.log");
  const auto started = Clock::now();
  EXPECT_EQ(launcher.Wait(20s).status, 3) << launcher.Output();
  EXPECT_GE(Clock::now() - started, 1s);
  EXPECT_TRUE(Contains(launcher.Output(), "(up to 1 s)")) << launcher.Output();
  EXPECT_TRUE(Contains(launcher.Output(), "no instruction from the operator within 1 s; exiting with status 3"))
      << launcher.Output();
}

TEST_F(LauncherTest, WithoutATokenAFailedRankEndsTheLauncherAsBefore) {
  testing::ChildProcess launcher = Launch("[ \"$RANK\" = 1 ] && exit 3; exec sleep 60", Pod(""), dir_ / "plain.log");
  EXPECT_EQ(launcher.Wait(20s).status, 3) << launcher.Output();
  EXPECT_TRUE(Contains(launcher.Output(), "rank 1 failed with status 3; stopping the other ranks")) << launcher.Output();
  EXPECT_FALSE(Contains(launcher.Output(), "control endpoint")) << launcher.Output();
  EXPECT_EQ(Request(port_, "GET", "/attempt", 500ms).code, 0) << "something serves the control endpoint";
}

TEST_F(LauncherTest, ATokenShorterThan16CharactersIsAConfigurationError) {
  testing::ChildProcess launcher = Launch("exit 0", Pod("short-token\n"), dir_ / "short.log");
  EXPECT_EQ(launcher.Wait(20s).status, 78) << launcher.Output();
  EXPECT_TRUE(Contains(launcher.Output(), "MESHTRAIN_LAUNCHER_TOKEN_FILE=" + (dir_ / "token").string() +
                                              ": the token is 11 characters long; it must have at least 16"))
      << launcher.Output();
}

TEST_F(LauncherTest, ATokenFileThatCannotBeReadIsAConfigurationError) {
  auto pod = Pod();
  pod["MESHTRAIN_LAUNCHER_TOKEN_FILE"] = (dir_ / "missing").string();
  testing::ChildProcess launcher = Launch("exit 0", pod, dir_ / "missing.log");
  EXPECT_EQ(launcher.Wait(20s).status, 78) << launcher.Output();
  EXPECT_TRUE(Contains(launcher.Output(), "MESHTRAIN_LAUNCHER_TOKEN_FILE=" + (dir_ / "missing").string() +
                                              ": cannot open it: No such file or directory"))
      << launcher.Output();
}

TEST_F(LauncherTest, TheTokenIsReadFromItsFileNotTheEnvironment) {
  auto pod = Pod("");
  pod["MESHTRAIN_LAUNCHER_TOKEN"] = kToken;  // as the operator once gave it: ignored
  testing::ChildProcess launcher = Launch("[ \"$RANK\" = 1 ] && exit 3; exec sleep 60", pod, dir_ / "env.log");
  EXPECT_EQ(launcher.Wait(20s).status, 3) << launcher.Output();
  EXPECT_FALSE(Contains(launcher.Output(), "control endpoint")) << launcher.Output();
}

// Once `launcher` runs its two ranks, sends it SIGTERM and expects it to pass the signal
// on, to die of it, and to leave no rank behind. Returns its output.
std::string StopWithSigterm(testing::ChildProcess& launcher) {
  std::vector<pid_t> ranks;
  for (const auto until = Clock::now() + 10s; ranks.size() < 2 && Clock::now() < until;) ranks = launcher.Children();
  EXPECT_EQ(ranks.size(), 2u);
  ::kill(launcher.pid(), SIGTERM);
  const testing::ChildExit ended = launcher.Wait(20s);
  EXPECT_EQ(ended.status, 128 + SIGTERM) << ended.output;
  EXPECT_TRUE(Contains(ended.output, "received signal 15; passing it to 2 rank(s)")) << ended.output;
  for (pid_t rank : ranks) EXPECT_NE(::kill(rank, 0), 0) << "rank process " << rank << " outlived its launcher";
  return ended.output;
}

TEST_F(LauncherTest, SigtermReachesTheRanksAndEndsTheLauncher) {
  testing::ChildProcess launcher = Launch("exec sleep 60", Pod(), dir_ / "sigterm.log");
  AwaitState(port_, "running");
  StopWithSigterm(launcher);
}

// `meshtrain launch SCRIPT` (the local launcher): its ranks as children, its output in a file.
testing::ChildProcess LaunchLocally(const std::string& prelude, const std::string& script, const fs::path& log) {
  return testing::ChildProcess({"/bin/sh", "-c",
                                prelude + "exec \"$0\" launch --nodes 1 --nproc-per-node 2 -- /bin/sh -c \"$1\"",
                                MESHTRAIN_CLI, script},
                               {}, log);
}

// The local launcher passes SIGTERM to its ranks, then dies of it itself.
TEST_F(LauncherTest, TheLocalLauncherPassesSigtermToItsRanksAndThenDiesOfIt) {
  testing::ChildProcess launcher = LaunchLocally("", "exec sleep 60", dir_ / "local-sigterm.log");
  const std::string output = StopWithSigterm(launcher);
  EXPECT_TRUE(Contains(output, "stopped by signal 15")) << output;
}

// Whether `pid` is a process that has not ended (a zombie has).
bool Alive(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return false;
  const size_t state = line.rfind(')') + 2;  // after "PID (COMMAND) "
  return state < line.size() && line[state] != 'Z';
}

// A local launcher killed with SIGKILL, which it cannot pass on, takes its ranks with it,
// and leaves nothing behind in its temporary directory (the ranks' failure files included).
TEST_F(LauncherTest, TheRanksOfALocalLauncherKilledWithSigkillDieWithIt) {
  const fs::path temporary = dir_ / "sigkill-tmp";
  fs::create_directories(temporary);
  testing::ChildProcess launcher =
      LaunchLocally("export TMPDIR='" + temporary.string() + "'; ", "exec sleep 60", dir_ / "local-sigkill.log");
  std::vector<pid_t> ranks;
  for (const auto until = Clock::now() + 10s; ranks.size() < 2 && Clock::now() < until;) ranks = launcher.Children();
  ASSERT_EQ(ranks.size(), 2u);
  ::kill(launcher.pid(), SIGKILL);
  EXPECT_EQ(launcher.Wait(10s).status, 128 + SIGKILL);
  for (const auto until = Clock::now() + 5s; (Alive(ranks[0]) || Alive(ranks[1])) && Clock::now() < until;)
    std::this_thread::sleep_for(10ms);
  for (pid_t rank : ranks) EXPECT_FALSE(Alive(rank)) << "rank process " << rank << " outlived its launcher";
  for (const auto& left : fs::directory_iterator(temporary)) ADD_FAILURE() << "left behind: " << left.path();
}

// Under nohup (SIGHUP ignored), a SIGHUP neither stops the local launcher nor its ranks,
// which inherit the ignoring: each sends one to the launcher and to itself, and exits 0.
TEST_F(LauncherTest, AnIgnoredSighupStaysIgnoredByTheLocalLauncherAndItsRanks) {
  testing::ChildProcess launcher =
      LaunchLocally("trap '' HUP; ", "kill -HUP $PPID; kill -HUP $$; exit 0", dir_ / "local-nohup.log");
  const testing::ChildExit ended = launcher.Wait(20s);
  EXPECT_EQ(ended.status, 0) << ended.output;
  EXPECT_TRUE(Contains(ended.output, "launch: 2 ranks on 1 virtual nodes succeeded")) << ended.output;
  EXPECT_FALSE(Contains(ended.output, "received signal")) << ended.output;
}

}  // namespace
}  // namespace meshtrain
