// The pod launcher's control endpoint (worker/launch/launcher_control.h) without sockets
// or ranks: its answers to the operator's requests, and the handshake with the launcher's
// loop, played here by a thread. Then a whole launcher (node_launcher.h) over its socket,
// with shell scripts for ranks: a suspend.

#include "worker/launch/launcher_control.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <sstream>
#include <string>
#include <thread>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "api/worker_contract.h"
#include "worker/launch/node_launcher.h"

namespace meshtrain::launch {
namespace {

using namespace std::chrono_literals;

constexpr const char* kToken = "0123456789abcdef";

struct Answer {
  int code = 0;
  std::string content_type;
  nlohmann::json body;
};

Answer Request(LauncherControl& control, const std::string& method, const std::string& target) {
  const std::string response =
      metrics::HttpAnswer(metrics::ParseHttpRequest(method + " " + target + " HTTP/1.1\r\n\r\n"), control.Routes());
  Answer answer;
  answer.code = std::stoi(response.substr(9, 3));
  const size_t type = response.find("Content-Type: ");
  answer.content_type = response.substr(type + 14, response.find("\r\n", type) - type - 14);
  const std::string body = response.substr(response.find("\r\n\r\n") + 4);
  answer.body = answer.content_type == "application/json" ? nlohmann::json::parse(body) : nlohmann::json(body);
  return answer;
}

std::string Target(const std::string& path, int attempt, const std::string& token = kToken) {
  return path + "?attempt=" + std::to_string(attempt) + "&token=" + token;
}

// Plays the launcher's loop: waits for one instruction, stores it in *seen and completes it.
std::thread Loop(LauncherControl& control, AttemptInstruction* seen, AttemptStatus after, std::string refusal = "") {
  return std::thread([&control, seen, after, refusal] {
    std::optional<AttemptInstruction> instruction;
    while (!(instruction = control.Pending())) std::this_thread::sleep_for(1ms);
    *seen = *instruction;
    std::this_thread::sleep_for(20ms);  // the answer waits for the loop
    control.Complete(after, refusal);
  });
}

TEST(LauncherControl, ParsesAnAttempt) {
  EXPECT_EQ(ParseAttempt("0"), 0);
  EXPECT_EQ(ParseAttempt("17"), 17);
  EXPECT_EQ(ParseAttempt("2147483647"), 2147483647);
  for (const char* bad : {"", "-1", "+1", "1a", " 1", "1.0", "2147483648", "99999999999", "0x10"}) {
    EXPECT_EQ(ParseAttempt(bad), std::nullopt) << bad;
  }
}

TEST(LauncherControl, AnswersTheStateAndRefusesWhatIsWrongChangingNothing) {
  LauncherControl control(kToken, AttemptStatus{2, AttemptState::kFailed, RankExit{3, 76, "lost rank 1"}, {}});
  const nlohmann::json failed = {
      {"attempt", 2}, {"state", "failed"}, {"exitCode", 76}, {"rank", 3}, {"reason", "lost rank 1"}};
  Answer get = Request(control, "GET", "/attempt");
  EXPECT_EQ(get.code, 200);
  EXPECT_EQ(get.content_type, "application/json");
  EXPECT_EQ(get.body, failed);

  struct Case {
    std::string method, target;
    int code;
    std::string error;  // in the answer's "error", or its text
  };
  const Case cases[] = {
      {"POST", Target("/attempt/stop", 3, "0123456789abcdeX"), 403, "the token is wrong"},
      {"POST", Target("/attempt/stop", 3, "0123456789abcdef0"), 403, "the token is wrong"},
      {"POST", Target("/attempt/stop", 3, "0123456789abcde"), 403, "the token is wrong"},
      {"POST", Target("/attempt/stop", 3, ""), 403, "the token is wrong"},
      {"POST", "/attempt/stop?attempt=3", 403, "lacks the token parameter"},
      {"POST", "/attempt/start?attempt=2&token=wrong", 403, "the token is wrong"},
      {"POST", std::string("/attempt/stop?token=") + kToken, 400, "lacks the attempt parameter"},
      {"POST", std::string("/attempt/stop?attempt=x&token=") + kToken, 400, "attempt=\"x\" is not an integer"},
      {"POST", std::string("/attempt/start?attempt=-1&token=") + kToken, 400, "attempt=\"-1\" is not an integer"},
      {"POST", std::string("/attempt/stop?attempt=%ff&token=") + kToken, 400, "is not an integer"},
      {"POST", Target("/attempt/start", 2), 409, "attempt 2 is not ready: this launcher is at attempt 2, failed"},
      {"POST", Target("/attempt/start", 3), 409, "attempt 3 is not ready: this launcher is at attempt 2, failed"},
      {"POST", Target("/attempt/start", 1), 409, "attempt 1 is not ready"},
      {"GET", Target("/attempt/stop", 3), 405, "only POST is allowed"},
      {"POST", "/attempt", 405, "only GET and HEAD are allowed"},
      {"GET", "/attempts", 404, "this endpoint serves /attempt, /attempt/stop, /attempt/start and /attempt/suspend"},
  };
  for (const Case& c : cases) {
    const Answer answer = Request(control, c.method, c.target);
    EXPECT_EQ(answer.code, c.code) << c.method << " " << c.target << ": " << answer.body;
    const std::string error = answer.body.is_object() ? answer.body.value("error", "") : answer.body.get<std::string>();
    EXPECT_NE(error.find(c.error), std::string::npos) << c.method << " " << c.target << ": " << answer.body;
    if (c.code == 409) {
      EXPECT_EQ(answer.body["state"], "failed") << "a conflict says the state";
      EXPECT_EQ(answer.body["exitCode"], 76);
    }
    EXPECT_FALSE(control.Pending()) << c.method << " " << c.target;
  }
  const std::string with_body = metrics::HttpAnswer(
      metrics::ParseHttpRequest("POST " + Target("/attempt/stop", 3) + " HTTP/1.1\r\nContent-Length: 2\r\n\r\n"),
      control.Routes());
  EXPECT_EQ(with_body.substr(0, 12), "HTTP/1.1 413");

  // Stopping for this attempt or an earlier one changes nothing, and needs no loop.
  for (int attempt : {0, 2}) {
    const Answer stop = Request(control, "POST", Target("/attempt/stop", attempt));
    EXPECT_EQ(stop.code, 200);
    EXPECT_EQ(stop.body, failed);
  }
  EXPECT_FALSE(control.Pending());
  EXPECT_EQ(Request(control, "GET", "/attempt").body, failed);
}

TEST(LauncherControl, AStopAndAStartAreAnsweredOnceTheLoopCarriedThemOut) {
  LauncherControl control(kToken, AttemptStatus{0, AttemptState::kFailed, RankExit{1, 3, ""}, {}});
  AttemptInstruction seen;
  std::thread loop = Loop(control, &seen, AttemptStatus{1, AttemptState::kReady, {}, {}});
  const Answer stop = Request(control, "POST", Target("/attempt/stop", 1));
  loop.join();
  EXPECT_EQ(seen.kind, AttemptInstruction::kStop);
  EXPECT_EQ(seen.attempt, 1);
  EXPECT_EQ(stop.code, 200);
  EXPECT_EQ(stop.body, (nlohmann::json{{"attempt", 1}, {"state", "ready"}}));
  EXPECT_FALSE(control.Pending());

  loop = Loop(control, &seen, AttemptStatus{1, AttemptState::kRunning, {}, {}});
  const Answer start = Request(control, "POST", Target("/attempt/start", 1));
  loop.join();
  EXPECT_EQ(seen.kind, AttemptInstruction::kStart);
  EXPECT_EQ(seen.attempt, 1);
  EXPECT_EQ(start.code, 200);
  EXPECT_EQ(start.body, (nlohmann::json{{"attempt", 1}, {"state", "running"}}));

  // Repeated, the start changes nothing.
  const Answer again = Request(control, "POST", Target("/attempt/start", 1));
  EXPECT_EQ(again.code, 200);
  EXPECT_EQ(again.body["state"], "running");
  EXPECT_FALSE(control.Pending());

  // A stop from a running attempt; the loop may refuse what it cannot do.
  loop = Loop(control, &seen, AttemptStatus{1, AttemptState::kRunning, {}, {}}, "the ranks would not stop");
  const Answer refused = Request(control, "POST", Target("/attempt/stop", 5));
  loop.join();
  EXPECT_EQ(seen.attempt, 5);
  EXPECT_EQ(refused.code, 409);
  EXPECT_EQ(refused.body["error"], "the ranks would not stop");
  EXPECT_EQ(refused.body["attempt"], 1);
}

TEST(LauncherControl, ClosingAnswersTheWaitingInstructionAndEveryLaterOne) {
  LauncherControl control(kToken, AttemptStatus{0, AttemptState::kRunning, {}, {}});
  std::thread closer([&control] {
    while (!control.Pending()) std::this_thread::sleep_for(1ms);
    control.Close("the launcher received signal 15 and is exiting");
  });
  const Answer waiting = Request(control, "POST", Target("/attempt/stop", 1));
  closer.join();
  EXPECT_EQ(waiting.code, 503);
  EXPECT_EQ(waiting.body["error"], "the launcher received signal 15 and is exiting");
  EXPECT_EQ(waiting.body["state"], "running");
  EXPECT_EQ(Request(control, "POST", Target("/attempt/stop", 2)).code, 503);
  EXPECT_EQ(Request(control, "GET", "/attempt").code, 200) << "the state can still be read";
}

TEST(LauncherControl, ASuspendIsAnsweredOnceTheLoopTookItAndReportsEachRank) {
  LauncherControl control(kToken, AttemptStatus{2, AttemptState::kRunning, {}, {}});
  AttemptInstruction seen;
  std::thread loop = Loop(control, &seen, AttemptStatus{2, AttemptState::kStopping, {}, {}});
  const Answer suspend = Request(control, "POST", Target("/attempt/suspend", 2));
  loop.join();
  EXPECT_EQ(seen.kind, AttemptInstruction::kSuspend);
  EXPECT_EQ(suspend.code, 200);
  EXPECT_EQ(suspend.body, (nlohmann::json{{"attempt", 2}, {"state", "stopping"}}));
  // Repeated while the ranks stop, or once they have, it changes nothing.
  EXPECT_EQ(Request(control, "POST", Target("/attempt/suspend", 2)).body["state"], "stopping");
  EXPECT_FALSE(control.Pending());
  control.Set(AttemptStatus{2, AttemptState::kSuspended, {},
                            {RankExit{0, api::worker::kExitStopped, "stopped after step 7"}, RankExit{1, 137, ""}}});
  const nlohmann::json suspended = {
      {"attempt", 2},
      {"state", "suspended"},
      {"ranks", {{{"rank", 0}, {"exitCode", 79}, {"reason", "stopped after step 7"}}, {{"rank", 1}, {"exitCode", 137}}}}};
  EXPECT_EQ(Request(control, "GET", "/attempt").body, suspended);
  EXPECT_EQ(Request(control, "POST", Target("/attempt/suspend", 3)).body, suspended);
  EXPECT_FALSE(control.Pending());
  EXPECT_EQ(Request(control, "POST", Target("/attempt/suspend", 3, "0123456789abcdeX")).code, 403);
}

// An HTTP/1.1 request to 127.0.0.1:`port`; the answer's body, or "" when none came.
std::string Http(int port, const std::string& method, const std::string& target) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(uint16_t(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string answer;
  if (::connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) == 0) {
    const std::string request = method + " " + target + " HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
    if (::write(fd, request.data(), request.size()) == ssize_t(request.size())) {
      char buffer[4096];
      for (ssize_t n; (n = ::read(fd, buffer, sizeof buffer)) > 0;) answer.append(buffer, size_t(n));
    }
  }
  ::close(fd);
  const size_t body = answer.find("\r\n\r\n");
  return body == std::string::npos ? "" : answer.substr(body + 4);
}

int FreePort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof address;
  ::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length);
  ::close(fd);
  return ntohs(address.sin_port);
}

// The whole launcher, with ranks that are shell scripts: rank 0 takes the stop signal as a
// rank does (it says where it stopped and exits kExitStopped), rank 1 ignores it. A suspend
// reports rank 0's words and rank 1 killed past the grace, and the launcher then holds.
TEST(NodeLauncher, ASuspendStopsTheRanksAndNamesTheOneThatDidNotAnswer) {
  ::setenv(api::worker::env::kNodeRank, "0", 1);
  ::setenv(api::worker::env::kNodes, "1", 1);
  ::setenv(api::worker::env::kRanksPerNode, "2", 1);
  NodeLaunch launch;
  launch.command = {"/bin/sh", "-c",
                    "if [ \"$RANK\" = 0 ]; then trap 'echo stopped after step 4 > \"$MESHTRAIN_FAILURE_FILE\"; exit 79' USR1; "
                    "else trap '' USR1; fi; while :; do sleep 0.05; done"};
  launch.grace = 700ms;
  launch.hold = 1500ms;
  launch.token = kToken;
  launch.control_host = "127.0.0.1";
  launch.control_port = FreePort();
  std::ostringstream log;
  int status = -1;
  std::thread launcher([&] { status = LaunchNode(launch, log); });
  // However the test ends, the launcher does: a SIGTERM to this process is its pod's end.
  struct Ended {
    std::thread& launcher;
    ~Ended() {
      if (!launcher.joinable()) return;
      ::kill(::getpid(), SIGTERM);
      launcher.join();
    }
  } ended{launcher};
  std::string state;
  for (int i = 0; i < 200 && state.find("running") == std::string::npos; ++i) {
    std::this_thread::sleep_for(20ms);
    state = Http(launch.control_port, "GET", "/attempt");
  }
  ASSERT_EQ(state, "{\"attempt\":0,\"state\":\"running\"}\n");
  std::this_thread::sleep_for(200ms);  // the shells set their traps
  const auto asked = std::chrono::steady_clock::now();
  const nlohmann::json answer = nlohmann::json::parse(Http(launch.control_port, "POST", Target("/attempt/suspend", 0)));
  EXPECT_EQ(answer["state"], "stopping");
  nlohmann::json suspended = nlohmann::json::object();
  for (int i = 0; i < 200 && suspended.value("state", "") != "suspended"; ++i) {
    std::this_thread::sleep_for(20ms);
    suspended = nlohmann::json::parse(Http(launch.control_port, "GET", "/attempt"));
  }
  const auto took = std::chrono::steady_clock::now() - asked;
  EXPECT_EQ(suspended, (nlohmann::json{{"attempt", 0},
                                       {"state", "suspended"},
                                       {"ranks",
                                        {{{"rank", 0}, {"exitCode", 79}, {"reason", "stopped after step 4"}},
                                         {{"rank", 1}, {"exitCode", 137}}}}}));
  EXPECT_GE(took, 700ms) << "rank 1 is killed only after the grace";
  launcher.join();
  EXPECT_EQ(status, 128 + SIGTERM) << "no instruction within the hold: it exits as a stopped pod\n" << log.str();
  EXPECT_NE(log.str().find("ranks that did not stop after a checkpoint: 1"), std::string::npos) << log.str();
}

}  // namespace
}  // namespace meshtrain::launch
