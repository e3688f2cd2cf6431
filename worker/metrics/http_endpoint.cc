#include "worker/metrics/http_endpoint.h"

#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <iterator>
#include <list>
#include <stdexcept>
#include <vector>


namespace meshtrain::metrics {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// After its answer, a connection is read and discarded until the client closes (or this
// long): closing with unread bytes would reset it, and the client could lose the answer.
constexpr milliseconds kLinger(1000);
// After accept() fails (out of descriptors), the listener rests this long, not spinning.
constexpr milliseconds kAcceptPause(100);

// One client, from accept to close; it owns its socket.
struct Connection {
  Connection(int socket, Clock::time_point end) : fd(socket), deadline(end) {}
  ~Connection() { ::close(fd); }
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;

  enum Phase { kReading, kWriting, kLingering } phase = kReading;
  const int fd;
  Clock::time_point deadline;
  std::string in, out;
  size_t sent = 0;
};

// Returns the listening socket and stores its port; throws naming what it serves and `address`.
int Listen(const std::string& name, const std::string& host, int port, int* bound_port) {
  const std::string address = host + ":" + std::to_string(port);
  const std::string cannot = "cannot serve " + name + " on " + address + ": ";
  if (port < 0 || port > 65535) throw std::runtime_error(cannot + "no such port");
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICHOST | AI_NUMERICSERV;  // no name lookup to wait for
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  if (const int rc = ::getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &found); rc != 0) {
    throw std::runtime_error(cannot + ::gai_strerror(rc));
  }
  std::string error = "no address";
  int fd = -1;
  for (const addrinfo* a = found; a && fd < 0; a = a->ai_next) {
    fd = ::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) {
      error = std::strerror(errno);
      continue;
    }
    const int one = 1;  // a restarted worker binds again at once, past TIME_WAIT
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(fd, a->ai_addr, a->ai_addrlen) != 0 || ::listen(fd, 128) != 0) {
      error = std::strerror(errno);
      ::close(fd);
      fd = -1;
    }
  }
  ::freeaddrinfo(found);
  if (fd < 0) throw std::runtime_error(cannot + error);
  sockaddr_storage bound{};
  socklen_t length = sizeof bound;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &length);
  *bound_port = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                                  : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  return fd;
}

// Moves connection `c` on after poll() gave it `events`: reads its request and answers,
// sends the answer, then lingers. False when it is to be closed.
bool Advance(Connection& c, short events, const std::vector<HttpRoute>& routes) {
  if (events & (POLLERR | POLLNVAL)) return false;
  if (c.phase == Connection::kReading && events) {
    char buffer[kMaxRequestHead];
    // The parse needs at most kMaxRequestHead bytes to decide, so no more are kept.
    const ssize_t n = ::recv(c.fd, buffer, kMaxRequestHead - c.in.size(), 0);
    if (n == 0) return false;  // gone before it asked
    if (n < 0) return errno == EAGAIN || errno == EINTR;
    c.in.append(buffer, size_t(n));
    const HttpParse parse = ParseHttpRequest(c.in);
    if (parse.status == HttpParse::kIncomplete) return true;
    c.out = HttpAnswer(parse, routes);
    c.phase = Connection::kWriting;  // and at once, rather than after another poll
  }
  if (c.phase == Connection::kWriting) {
    const ssize_t n = ::send(c.fd, c.out.data() + c.sent, c.out.size() - c.sent, MSG_NOSIGNAL);
    if (n < 0) return errno == EAGAIN || errno == EINTR;
    c.sent += size_t(n);
    if (c.sent < c.out.size()) return true;
    ::shutdown(c.fd, SHUT_WR);
    c.phase = Connection::kLingering;
    c.deadline = std::min(c.deadline, Clock::now() + kLinger);
    return true;
  }
  if (c.phase == Connection::kLingering && events) {
    char discard[4096];
    const ssize_t n = ::recv(c.fd, discard, sizeof discard, 0);
    return n > 0 || (n < 0 && (errno == EAGAIN || errno == EINTR));
  }
  return true;
}

}  // namespace

HttpEndpoint::HttpEndpoint(const std::string& host, int port, std::vector<HttpRoute> routes,
                           HttpEndpointOptions options)
    : routes_(std::move(routes)), options_(std::move(options)) {
  listen_fd_ = Listen(options_.name, host, port, &port_);
  if (::pipe2(wake_fds_, O_CLOEXEC | O_NONBLOCK) != 0) {
    const std::string error = std::strerror(errno);
    ::close(listen_fd_);
    throw std::runtime_error("cannot serve " + options_.name + " on " + host + ":" + std::to_string(port) +
                             ": pipe: " + error);
  }
  thread_ = std::thread([this] { Serve(); });
}

HttpEndpoint::~HttpEndpoint() {
  (void)!::write(wake_fds_[1], "x", 1);
  thread_.join();
  ::close(listen_fd_);
  ::close(wake_fds_[0]);
  ::close(wake_fds_[1]);
}

void HttpEndpoint::Serve() {
  std::list<Connection> connections;
  std::vector<pollfd> fds;
  Clock::time_point accept_after;  // a pause after accept() failed
  for (;;) {
    const auto now = Clock::now();
    const bool room = int(connections.size()) < options_.max_connections;
    fds.assign({{wake_fds_[0], POLLIN, 0}, {listen_fd_, short(room && now >= accept_after ? POLLIN : 0), 0}});
    // When full, a connection's end makes room; a pause ends by the clock.
    Clock::time_point wake = room && now < accept_after ? accept_after : now + std::chrono::minutes(1);
    for (const Connection& c : connections) {
      fds.push_back({c.fd, short(c.phase == Connection::kWriting ? POLLOUT : POLLIN), 0});
      wake = std::min(wake, c.deadline);
    }
    const auto wait = std::chrono::duration_cast<milliseconds>(wake - now).count() + 1;
    if (::poll(fds.data(), fds.size(), int(std::clamp<int64_t>(wait, 0, 60000))) < 0 && errno != EINTR) return;
    if (fds[0].revents) return;  // stopping

    // Each connection's poll entry, by position: the ones accepted below have none yet.
    size_t entry = 2;
    for (auto it = connections.begin(); it != connections.end(); ++entry) {
      const bool keep = Clock::now() < it->deadline && Advance(*it, fds[entry].revents, routes_);
      it = keep ? std::next(it) : connections.erase(it);
    }

    if (fds[1].revents & POLLIN) {
      while (int(connections.size()) < options_.max_connections) {
        const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0 && (errno == EINTR || errno == ECONNABORTED)) continue;
        if (fd < 0) {
          if (errno != EAGAIN) accept_after = Clock::now() + kAcceptPause;
          break;
        }
        connections.emplace_back(fd, Clock::now() + options_.timeout);
      }
    }
  }
}

}  // namespace meshtrain::metrics
