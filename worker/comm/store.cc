#include "worker/comm/store.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/rand.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>

#include "worker/comm/store_protocol.h"

namespace meshtrain::comm {

using namespace store;

namespace {

using Clock = std::chrono::steady_clock;

constexpr milliseconds kHandshakeFloor(100);  // a local coordinator answers in well under 1 ms

std::string RandomBytes(size_t n) {
  std::string bytes(n, '\0');
  if (RAND_bytes(reinterpret_cast<unsigned char*>(bytes.data()), int(n)) != 1) {
    throw StoreError("store: the system has no randomness for a nonce or key");
  }
  return bytes;
}

std::string Errno(const std::string& what) { return what + ": " + std::strerror(errno); }

// Splits "host:port"; throws StoreError.
std::pair<std::string, std::string> SplitHostPort(const std::string& address) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == address.size()) {
    throw StoreError("coordinator address \"" + address + "\" is not host:port");
  }
  return {address.substr(0, colon), address.substr(colon + 1)};
}

}  // namespace

// ---------------------------------------------------------------------------
// Server: one poll() loop moving bytes between the sockets and a StoreService, which
// parks gets and waits for missing keys until the key is set or their deadline passes.

struct StoreServer::State {
  State(std::string key, std::atomic<int64_t>* refused)
      : service(std::move(key), [refused](const std::string& peer, const std::string& why) {
          std::fprintf(stderr, "meshtrain store: refused %s: %s\n", peer.c_str(), why.c_str());
          ++*refused;
        }) {}

  StoreService service;
  bool stopping = false;
  std::mutex mutex;  // guards `stopping` against Stop() from another thread

  void Drop(int fd) {
    ::close(fd);
    service.Close(fd);
  }
};

StoreServer::StoreServer(const std::string& host, uint16_t port, std::string key) {
  if (!key.empty() && key.size() < kMinKeyBytes) {
    throw StoreError("store: a key of " + std::to_string(key.size()) + " bytes is too short; it needs " +
                     std::to_string(kMinKeyBytes));
  }
  state_ = std::make_unique<State>(std::move(key), &refused_);
  listen_fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (listen_fd_ < 0) throw StoreError(Errno("store: socket"));
  const int one = 1;
  ::setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  if (::inet_pton(AF_INET, host.c_str(), &addr.sin_addr) != 1) {
    ::close(listen_fd_);
    throw StoreError("store: cannot listen on \"" + host + "\": not an IPv4 address");
  }
  if (::bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 || ::listen(listen_fd_, 1024) != 0) {
    const std::string error = Errno("store: cannot listen on " + host + ":" + std::to_string(port));
    ::close(listen_fd_);
    throw StoreError(error);
  }
  socklen_t len = sizeof addr;
  ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len);
  port_ = ntohs(addr.sin_port);
  ::fcntl(listen_fd_, F_SETFL, O_NONBLOCK);
  if (::pipe2(wake_fds_, O_CLOEXEC | O_NONBLOCK) != 0) {
    ::close(listen_fd_);
    throw StoreError(Errno("store: pipe"));
  }
  thread_ = std::thread([this] { Serve(); });
}

StoreServer::~StoreServer() {
  Stop();
  ::close(wake_fds_[0]);
  ::close(wake_fds_[1]);
}

void StoreServer::Stop() {
  {
    std::lock_guard lock(state_->mutex);
    if (state_->stopping) return;
    state_->stopping = true;
  }
  (void)!::write(wake_fds_[1], "x", 1);
  thread_.join();
  for (int fd : state_->service.Connections()) state_->Drop(fd);
  ::close(listen_fd_);
}

void StoreServer::Serve() {
  State& s = *state_;
  std::vector<pollfd> fds;
  for (;;) {
    {
      std::lock_guard lock(s.mutex);
      if (s.stopping) return;
    }
    fds.assign({{listen_fd_, POLLIN, 0}, {wake_fds_[0], POLLIN, 0}});
    for (int fd : s.service.Connections()) {
      fds.push_back({fd, short(POLLIN | (s.service.Output(fd).empty() ? 0 : POLLOUT)), 0});
    }
    int timeout_ms = -1;
    if (const auto next = s.service.NextDeadline()) {
      // A minute at most, so that a far deadline fits an int.
      const auto left = std::chrono::duration_cast<milliseconds>(*next - Clock::now()).count() + 1;
      timeout_ms = int(std::clamp<int64_t>(left, 0, 60000));
    }
    if (::poll(fds.data(), fds.size(), timeout_ms) < 0 && errno != EINTR) return;
    for (int fd : s.service.Expire(Clock::now())) s.Drop(fd);
    if (fds[0].revents & POLLIN) {
      for (;;) {
        sockaddr_in peer{};
        socklen_t peer_len = sizeof peer;
        const int fd = ::accept4(listen_fd_, reinterpret_cast<sockaddr*>(&peer), &peer_len, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) break;
        const int one = 1;
        ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        char address[INET_ADDRSTRLEN] = "?";
        ::inet_ntop(AF_INET, &peer.sin_addr, address, sizeof address);
        s.service.Open(fd, std::string(address) + ":" + std::to_string(ntohs(peer.sin_port)), RandomBytes(kNonceBytes),
                       Clock::now());
        // The challenge goes at once, before the client's first bytes are read: a client
        // without the key then learns why it is dropped.
        std::string& out = s.service.Output(fd);
        const ssize_t n = out.empty() ? 0 : ::send(fd, out.data(), out.size(), MSG_NOSIGNAL);
        if (n > 0) out.erase(0, size_t(n));
      }
    }
    const std::vector<int> open = s.service.Connections();
    for (size_t i = 2; i < fds.size(); ++i) {
      const int fd = fds[i].fd;
      if (!std::binary_search(open.begin(), open.end(), fd)) continue;  // dropped above
      bool drop = (fds[i].revents & (POLLERR | POLLNVAL)) != 0;
      if (!drop && (fds[i].revents & (POLLIN | POLLHUP))) {
        char buffer[65536];
        const ssize_t n = ::recv(fd, buffer, sizeof buffer, 0);
        if (n > 0) drop = !s.service.Receive(fd, std::string_view(buffer, size_t(n)), Clock::now());
        else if (n == 0 || (errno != EAGAIN && errno != EINTR)) drop = true;
      }
      std::string& out = s.service.Output(fd);
      if (!drop && !out.empty()) {
        const ssize_t n = ::send(fd, out.data(), out.size(), MSG_NOSIGNAL);
        if (n > 0) out.erase(0, size_t(n));
        else if (n < 0 && errno != EAGAIN && errno != EINTR) drop = true;
      }
      if (drop) s.Drop(fd);
    }
  }
}

// ---------------------------------------------------------------------------
// Client.

StoreClient::StoreClient(const std::string& coordinator, milliseconds connect_timeout, const std::string& key)
    : coordinator_(coordinator) {
  const auto [host, port] = SplitHostPort(coordinator);
  const auto deadline = Clock::now() + connect_timeout;
  std::string last_error = "no attempt";
  for (milliseconds backoff(10);; backoff = std::min(backoff * 2, milliseconds(500))) {
    addrinfo hints{};
    hints.ai_family = AF_INET;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* found = nullptr;
    if (const int rc = ::getaddrinfo(host.c_str(), port.c_str(), &hints, &found); rc != 0) {
      last_error = ::gai_strerror(rc);
    } else {
      fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
      const bool connected = fd_ >= 0 && ::connect(fd_, found->ai_addr, found->ai_addrlen) == 0;
      last_error = connected ? "" : std::strerror(errno);
      ::freeaddrinfo(found);
      if (connected) {
        const int one = 1;
        ::setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        // The handshake shares the connect deadline: a stopped coordinator's kernel still
        // accepts connections, and only an unanswered challenge shows that it is gone.
        // A coordinator that came up at the deadline still gets kHandshakeFloor.
        const auto left = std::chrono::ceil<milliseconds>(deadline - Clock::now());
        if (key.empty() || Authenticate(key, std::clamp(left, kHandshakeFloor, kAuthPatience))) return;
        last_error = "the connection ended before the coordinator's challenge (a coordinator stopping there)";
      } else if (fd_ >= 0) {
        ::close(fd_);
        fd_ = -1;
      }
    }
    if (Clock::now() + backoff >= deadline) break;
    std::this_thread::sleep_for(backoff);
  }
  throw StoreError("cannot reach the coordinator at " + coordinator + " within " +
                   std::to_string(connect_timeout.count()) + " ms: " + last_error);
}

StoreClient::~StoreClient() {
  if (fd_ >= 0) ::close(fd_);
}

void StoreClient::Fail(const std::string& what, const std::string& why, bool close) {
  if (close && fd_ >= 0) {
    ::close(fd_);  // the stream is no longer in step
    fd_ = -1;
  }
  throw StoreError("store " + what + " at coordinator " + coordinator_ + ": " + why);
}

void StoreClient::SendAll(const std::string& bytes, Clock::time_point deadline, const std::string& what) {
  for (size_t sent = 0; sent < bytes.size();) {
    pollfd p{fd_, POLLOUT, 0};
    const auto left = std::chrono::ceil<milliseconds>(deadline - Clock::now()).count();
    if (::poll(&p, 1, int(std::max<int64_t>(0, left))) == 0) Fail(what, "could not send in time", true);
    const ssize_t n = ::send(fd_, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
    if (n <= 0 && errno != EINTR && errno != EAGAIN) Fail(what, Errno("send failed"), true);
    if (n > 0) sent += size_t(n);
  }
}

std::string StoreClient::ReceiveReply(Clock::time_point deadline, const std::string& what) {
  const auto patience = std::chrono::duration_cast<milliseconds>(deadline - Clock::now()).count();
  std::string reply;
  size_t need = 4;
  while (reply.size() < need) {
    pollfd p{fd_, POLLIN, 0};
    const auto left = std::chrono::ceil<milliseconds>(deadline - Clock::now()).count();
    if (::poll(&p, 1, int(std::max<int64_t>(0, left))) == 0) {
      Fail(what, "no reply within " + std::to_string(patience) + " ms", true);  // the reply may still come
    }
    char buffer[65536];
    const ssize_t n = ::recv(fd_, buffer, std::min(sizeof buffer, need - reply.size()), 0);
    if (n == 0 || (n < 0 && errno != EINTR && errno != EAGAIN)) {
      Fail(what, n == 0 ? "the coordinator closed the connection (it stopped or died)" : Errno("receive failed"), true);
    }
    if (n > 0) reply.append(buffer, size_t(n));
    if (need == 4 && reply.size() == 4) {
      const uint32_t length = Reader(reply).U32();
      if (length == 0 || length > kMaxFrame) Fail(what, "a malformed reply (length " + std::to_string(length) + ")", true);
      need = 4 + length;
    }
  }
  return reply.substr(4);
}

bool StoreClient::Authenticate(const std::string& key, milliseconds timeout) {
  std::lock_guard lock(mutex_);
  const auto deadline = Clock::now() + timeout;
  const std::string what = "authentication";
  // A coordinator sends its challenge as it accepts. A connection that ends before any of
  // it came was accepted by a listening socket whose coordinator then stopped.
  for (pollfd p{fd_, POLLIN, 0};;) {
    const auto left = std::chrono::ceil<milliseconds>(deadline - Clock::now()).count();
    const int ready = ::poll(&p, 1, int(std::max<int64_t>(0, left)));
    if (ready == 0) Fail(what, "no reply within " + std::to_string(timeout.count()) + " ms", true);
    if (ready > 0) break;
  }
  char first = 0;
  ssize_t n;
  do n = ::recv(fd_, &first, 1, MSG_PEEK);
  while (n < 0 && errno == EINTR);
  if (n <= 0) {
    ::close(fd_);
    fd_ = -1;
    return false;
  }
  const std::string challenge = ReceiveReply(deadline, what);
  if (uint8_t(challenge[0]) != kChallenge || challenge.size() != 1 + kNonceBytes) {
    Fail(what, "the coordinator does not challenge clients (it has no key)", true);
  }
  const std::string server_nonce = challenge.substr(1), client_nonce = RandomBytes(kNonceBytes);
  SendAll(Frame(kAuth, client_nonce + Mac(key, kClientLabel, server_nonce, client_nonce)), deadline, what);
  std::string proof;
  try {
    proof = ReceiveReply(deadline, what);
  } catch (const StoreError&) {
    // The coordinator closes a connection whose key is wrong, and so does one that stops.
    Fail(what, "the coordinator refused this rank's key (it differs from the job's), or stopped before it answered",
         true);
  }
  if (uint8_t(proof[0]) != kOk || !SameMac(proof.substr(1), Mac(key, kServerLabel, client_nonce, server_nonce))) {
    Fail(what, "the coordinator could not prove that it holds the job's key", true);
  }
  return true;
}

std::string StoreClient::Call(const std::string& request, const std::string& what, milliseconds timeout,
                              milliseconds patience) {
  std::lock_guard lock(mutex_);
  const auto deadline = Clock::now() + patience;
  if (fd_ < 0) Fail(what, "the connection was lost earlier", false);
  SendAll(request, deadline, what);
  const std::string reply = ReceiveReply(deadline, what);
  switch (uint8_t(reply[0])) {
    case kOk: return reply.substr(1);
    case kTimedOut: Fail(what, "timed out after " + std::to_string(timeout.count()) + " ms", false);
    case kChallenge:
      Fail(what, "the coordinator admits only clients with the job's key, and this rank has none (" +
                     std::string("MESHTRAIN_STORE_KEY_FILE)"), true);
    default: Fail(what, "the coordinator rejected the request", false);
  }
}

namespace {
constexpr milliseconds kShortCall(32000);  // set, add and check are answered at once
// The coordinator answers a wait at its own deadline; allow a little more for the trip.
constexpr milliseconds kTrip(2000);
}  // namespace

void StoreClient::Set(const std::string& key, const std::string& value) { Set(key, value, kShortCall); }

void StoreClient::Set(const std::string& key, const std::string& value, milliseconds patience) {
  Call(EncodeRequest({kSet, {key}, value, 0}), "set(\"" + key + "\")", milliseconds(0), patience);
}

std::string StoreClient::Get(const std::string& key, milliseconds timeout) {
  const std::string reply =
      Call(EncodeRequest({kGet, {key}, "", timeout.count()}), "get(\"" + key + "\")", timeout, timeout + kTrip);
  return Reader(reply).String();
}

int64_t StoreClient::Add(const std::string& key, int64_t delta) {
  const std::string what = "add(\"" + key + "\")";
  return Reader(Call(EncodeRequest({kAdd, {key}, "", delta}), what, milliseconds(0), kShortCall)).I64();
}

void StoreClient::Wait(const std::vector<std::string>& keys, milliseconds timeout) {
  std::string names;
  for (const std::string& k : keys) names += (names.empty() ? "\"" : ", \"") + k + "\"";
  Call(EncodeRequest({kWait, keys, "", timeout.count()}), "wait(" + names + ")", timeout, timeout + kTrip);
}

bool StoreClient::Check(const std::string& key) {
  const std::string what = "check(\"" + key + "\")";
  return Reader(Call(EncodeRequest({kCheck, {key}, "", 0}), what, milliseconds(0), kShortCall)).U8() != 0;
}

void StoreClient::Barrier(const std::string& name, int world, milliseconds timeout) {
  // Every rank passes the same barriers in the same order, so per-name generations agree.
  const std::string key = "barrier/" + name + "/" + std::to_string(barrier_generation_[name]++);
  const int64_t arrived = Add(key + "/count", 1);
  if (arrived == world) Set(key + "/done", "");
  try {
    Wait({key + "/done"}, timeout);
  } catch (const StoreError&) {
    const int64_t now = Add(key + "/count", 0);
    throw StoreError("barrier \"" + name + "\" at coordinator " + coordinator_ + " timed out after " +
                     std::to_string(timeout.count()) + " ms: " + std::to_string(now) + " of " + std::to_string(world) +
                     " ranks arrived");
  }
}

std::string ReadStoreKey(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw StoreError("cannot read the store key " + path + ": " + std::strerror(errno));
  const std::string key((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (key.size() < kMinKeyBytes) {
    throw StoreError("the store key " + path + " holds " + std::to_string(key.size()) + " bytes; it needs at least " +
                     std::to_string(kMinKeyBytes));
  }
  return key;
}

std::string NewStoreKey() { return RandomBytes(kMinKeyBytes); }

}  // namespace meshtrain::comm
