// The PodPoller's reads are bounded: at most max_in_flight at once, and endpoints that do
// not answer are read less and less often, so they cannot crowd out the ones that do.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <mutex>
#include <set>
#include <thread>

#include <gtest/gtest.h>

#include "operator/controller/pod_poller.h"

namespace meshtrain::controller {
namespace {

using nlohmann::json;
using namespace std::chrono_literals;

// Listeners on 127.0.1.1..N (which accept and never answer) and 127.0.2.1 (which answers
// each GET with a body that counts the answers), all on one port.
class Endpoints {
 public:
  explicit Endpoints(int hanging) {
    good_ = Listen("127.0.2.1", 0);
    sockaddr_in address{};
    socklen_t size = sizeof address;
    getsockname(good_, reinterpret_cast<sockaddr*>(&address), &size);
    port_ = ntohs(address.sin_port);
    for (int i = 1; i <= hanging; ++i) hanging_.push_back(Listen("127.0.1." + std::to_string(i), port_));
    thread_ = std::thread([this] { Serve(); });
  }
  ~Endpoints() {
    stop_ = true;
    thread_.join();
    for (int fd : held_) close(fd);
    for (int fd : hanging_) close(fd);
    close(good_);
  }
  int port() const { return port_; }
  int accepted() const { return accepted_.load(); }     // by the hanging ones
  int most_held() const { return most_held_.load(); }   // hanging connections open at once, at most

 private:
  static int Listen(const std::string& ip, int port) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_port = htons(uint16_t(port));
    inet_pton(AF_INET, ip.c_str(), &address.sin_addr);
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) != 0 || listen(fd, 128) != 0)
      throw std::runtime_error("cannot listen on " + ip);
    return fd;
  }
  void Serve() {
    int answers = 0;
    while (!stop_) {
      std::vector<pollfd> fds = {{good_, POLLIN, 0}};
      for (int fd : hanging_) fds.push_back({fd, POLLIN, 0});
      std::vector<int> held(held_.begin(), held_.end());
      for (int fd : held) fds.push_back({fd, POLLIN, 0});
      if (poll(fds.data(), fds.size(), 20) <= 0) continue;
      if (fds[0].revents & POLLIN) {
        const int fd = accept(good_, nullptr, nullptr);
        char buffer[4096];
        std::string request;
        while (request.find("\r\n\r\n") == std::string::npos) {
          const ssize_t n = read(fd, buffer, sizeof buffer);
          if (n <= 0) break;
          request.append(buffer, size_t(n));
        }
        const std::string body = "answer " + std::to_string(++answers);
        const std::string response = "HTTP/1.1 200 OK\r\nContent-Length: " + std::to_string(body.size()) +
                                     "\r\nConnection: close\r\n\r\n" + body;
        if (write(fd, response.data(), response.size()) < 0) {
        }
        close(fd);
      }
      for (size_t i = 1; i <= hanging_.size(); ++i) {
        if (!(fds[i].revents & POLLIN)) continue;
        held_.insert(accept(hanging_[i - 1], nullptr, nullptr));
        ++accepted_;
      }
      for (size_t i = 1 + hanging_.size(); i < fds.size(); ++i) {  // a client that gave up
        char buffer[4096];
        if ((fds[i].revents & (POLLIN | POLLHUP)) && read(fds[i].fd, buffer, sizeof buffer) <= 0) {
          close(fds[i].fd);
          held_.erase(fds[i].fd);
        }
      }
      most_held_ = std::max(most_held_.load(), int(held_.size()));
    }
  }

  int good_ = -1, port_ = 0;
  std::vector<int> hanging_;
  std::set<int> held_;  // open connections to the hanging listeners
  std::atomic<int> accepted_{0}, most_held_{0};
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

json Pod(const std::string& uid, const std::string& ip) {
  return {{"metadata", {{"uid", uid}}}, {"status", {{"podIP", ip}}}};
}

TEST(PodPoller, EndpointsThatHangNeitherCrowdOutNorOutnumberTheBound) {
  constexpr int kHanging = 20;
  Endpoints endpoints(kHanging);
  std::atomic<int> changes{0};
  PodPollerOptions options{.port = endpoints.port(),
                           .path = "/metrics",
                           .interval = 100ms,
                           .timeout = 200ms,
                           .max_in_flight = 4,
                           .max_backoff = 5s};
  PodPoller poller(options, [](const std::string& body) -> std::optional<json> { return json{{"body", body}}; },
                   [&](const std::string& job) {
                     if (job == "default/good") ++changes;
                   });
  std::vector<json> hanging;
  for (int i = 1; i <= kHanging; ++i) hanging.push_back(Pod("uid-" + std::to_string(i), "127.0.1." + std::to_string(i)));
  poller.Watch("default/hanging", hanging);
  const json good = Pod("uid-good", "127.0.2.1");
  poller.Watch("default/good", {good});
  poller.Start();
  std::this_thread::sleep_for(3s);
  const int changes_seen = changes.load();
  const std::optional<json> latest = poller.Latest("default/good", good);
  poller.Stop();

  // Read about every 100 ms for 3 s (30 times), though 20 others hang with only 4 slots:
  // served by the longest due alone, it was read twice.
  EXPECT_GE(changes_seen, 10) << "the endpoint that answers was crowded out";
  ASSERT_TRUE(latest.has_value());
  EXPECT_EQ((*latest)["body"].get<std::string>().rfind("answer ", 0), 0u);
  EXPECT_LE(endpoints.most_held(), options.max_in_flight);
  // Each hanging pod is read after 0.2, 0.4, 0.8, 1.6 s of backoff: about 4 times in 3 s.
  EXPECT_LE(endpoints.accepted(), 4 * kHanging + kHanging / 2);
  EXPECT_FALSE(poller.Latest("default/hanging", hanging[0]).has_value());
}

}  // namespace
}  // namespace meshtrain::controller
