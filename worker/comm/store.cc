#include "worker/comm/store.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
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
#include <list>
#include <map>

namespace meshtrain::comm {
namespace {

using Clock = std::chrono::steady_clock;

enum Op : uint8_t { kSet = 1, kGet = 2, kAdd = 3, kWait = 4, kCheck = 5, kAuth = 6 };
enum Status : uint8_t { kOk = 0, kTimedOut = 1, kBadRequest = 2, kChallenge = 3 };
constexpr uint32_t kMaxFrame = 64u << 20;

// Authentication (store.h).
constexpr size_t kNonceBytes = 32, kMacBytes = 32, kMinKeyBytes = 32;
constexpr uint32_t kAuthFrame = 1 + kNonceBytes + kMacBytes;
constexpr milliseconds kAuthPatience(10000);
constexpr const char* kClientLabel = "meshtrain store client";
constexpr const char* kServerLabel = "meshtrain store server";

std::string RandomBytes(size_t n) {
  std::string bytes(n, '\0');
  if (RAND_bytes(reinterpret_cast<unsigned char*>(bytes.data()), int(n)) != 1) {
    throw StoreError("store: the system has no randomness for a nonce or key");
  }
  return bytes;
}

// HMAC-SHA256(key, label || first || second).
std::string Mac(const std::string& key, const char* label, const std::string& first, const std::string& second) {
  const std::string message = std::string(label) + first + second;
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  HMAC(EVP_sha256(), key.data(), int(key.size()), reinterpret_cast<const unsigned char*>(message.data()),
       message.size(), digest, &length);
  return std::string(reinterpret_cast<char*>(digest), length);
}

// Compares MACs in constant time.
bool SameMac(const std::string& a, const std::string& b) {
  return a.size() == b.size() && a.size() == kMacBytes && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

void PutU32(std::string* out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out->push_back(char((v >> (8 * i)) & 0xFF));
}
void PutI64(std::string* out, int64_t v) {
  for (int i = 0; i < 8; ++i) out->push_back(char((uint64_t(v) >> (8 * i)) & 0xFF));
}
void PutString(std::string* out, const std::string& s) {
  PutU32(out, uint32_t(s.size()));
  out->append(s);
}

// Reads fields from a frame; ok() turns false on a short frame.
class Reader {
 public:
  explicit Reader(std::string_view data) : data_(data) {}
  bool ok() const { return ok_; }
  uint32_t U32() {
    if (!Need(4)) return 0;
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) v |= uint32_t(uint8_t(data_[pos_ + i])) << (8 * i);
    pos_ += 4;
    return v;
  }
  int64_t I64() {
    if (!Need(8)) return 0;
    uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v |= uint64_t(uint8_t(data_[pos_ + i])) << (8 * i);
    pos_ += 8;
    return int64_t(v);
  }
  uint8_t U8() { return Need(1) ? uint8_t(data_[pos_++]) : 0; }
  std::string String() {
    const uint32_t n = U32();
    if (!Need(n)) return "";
    std::string s(data_.substr(pos_, n));
    pos_ += n;
    return s;
  }

 private:
  bool Need(size_t n) {
    if (pos_ + n > data_.size()) ok_ = false;
    return ok_;
  }
  std::string_view data_;
  size_t pos_ = 0;
  bool ok_ = true;
};

std::string Frame(uint8_t head, const std::string& body) {
  std::string out;
  PutU32(&out, uint32_t(body.size() + 1));
  out.push_back(char(head));
  out.append(body);
  return out;
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
// Server: one poll() loop; gets and waits for missing keys park until the key is
// set or their deadline passes.

struct StoreServer::State {
  struct Connection {
    std::string in, out;
    std::string peer;  // address:port, for the log
    bool authenticated = false;
    std::string nonce;  // the challenge sent to it
    Clock::time_point auth_deadline;
  };
  struct Waiter {
    int fd;
    uint8_t op;  // kGet or kWait
    std::vector<std::string> keys;
    Clock::time_point deadline;
  };
  std::string secret;  // the job's key; empty: no authentication
  std::atomic<int64_t>* refused = nullptr;
  std::map<std::string, std::string> data;
  std::map<int, Connection> connections;
  std::list<Waiter> waiters;
  bool stopping = false;
  std::mutex mutex;  // guards `stopping` against Stop() from another thread

  bool Ready(const Waiter& w) const {
    return std::all_of(w.keys.begin(), w.keys.end(), [&](const std::string& k) { return data.contains(k); });
  }
  void Answer(const Waiter& w) {
    connections[w.fd].out += Frame(kOk, w.op == kGet ? [&] {
      std::string body;
      PutString(&body, data.at(w.keys[0]));
      return body;
    }() : std::string());
  }
  void WakeWaiters() {
    for (auto it = waiters.begin(); it != waiters.end();) {
      if (Ready(*it)) {
        Answer(*it);
        it = waiters.erase(it);
      } else {
        ++it;
      }
    }
  }

  // Handles one request; false if it was malformed (the connection is then closed).
  bool Handle(int fd, std::string_view frame) {
    Reader r(frame);
    const uint8_t op = r.U8();
    std::string& out = connections[fd].out;
    switch (op) {
      case kSet: {
        std::string key = r.String(), value = r.String();
        if (!r.ok()) return false;
        data[std::move(key)] = std::move(value);
        out += Frame(kOk, "");
        WakeWaiters();
        return true;
      }
      case kAdd: {
        const std::string key = r.String();
        const int64_t delta = r.I64();
        if (!r.ok()) return false;
        int64_t value = 0;
        if (auto it = data.find(key); it != data.end()) value = std::strtoll(it->second.c_str(), nullptr, 10);
        value += delta;
        data[key] = std::to_string(value);
        std::string body;
        PutI64(&body, value);
        out += Frame(kOk, body);
        WakeWaiters();
        return true;
      }
      case kCheck: {
        const std::string key = r.String();
        if (!r.ok()) return false;
        out += Frame(kOk, std::string(1, data.contains(key) ? '\1' : '\0'));
        return true;
      }
      case kGet:
      case kWait: {
        Waiter w{fd, op, {}, {}};
        const uint32_t n = op == kGet ? 1 : r.U32();
        for (uint32_t i = 0; i < n && r.ok(); ++i) w.keys.push_back(r.String());
        const int64_t timeout_ms = r.I64();
        if (!r.ok() || w.keys.empty()) return false;
        w.deadline = Clock::now() + milliseconds(std::max<int64_t>(0, timeout_ms));
        if (Ready(w)) Answer(w);
        else waiters.push_back(std::move(w));
        return true;
      }
      default:
        return false;
    }
  }

  // A new connection: challenged when there is a key.
  void Accept(int fd, const std::string& peer) {
    Connection& c = connections[fd];
    c.peer = peer;
    c.authenticated = secret.empty();
    if (c.authenticated) return;
    c.nonce = RandomBytes(kNonceBytes);
    c.out = Frame(kChallenge, c.nonce);
    c.auth_deadline = Clock::now() + kAuthPatience;
    // At once, before the client's first bytes are read: a client without the key then
    // learns why it is dropped.
    const ssize_t n = ::send(fd, c.out.data(), c.out.size(), MSG_NOSIGNAL);
    if (n > 0) c.out.erase(0, size_t(n));
  }

  // Logs and counts a connection that failed to authenticate; the caller drops it.
  bool Refuse(const Connection& c, const std::string& why) {
    std::fprintf(stderr, "meshtrain store: refused %s: %s\n", c.peer.c_str(), why.c_str());
    ++*refused;
    return false;
  }

  // Checks a client's answer to its challenge; false refuses it.
  bool Authenticate(int fd, std::string_view frame) {
    Connection& c = connections[fd];
    if (frame.size() != kAuthFrame || uint8_t(frame[0]) != kAuth) {
      return Refuse(c, "it sent a request before authenticating (no key?)");
    }
    const std::string client_nonce(frame.substr(1, kNonceBytes)), mac(frame.substr(1 + kNonceBytes));
    if (!SameMac(mac, Mac(secret, kClientLabel, c.nonce, client_nonce))) return Refuse(c, "it does not hold the job's key");
    c.authenticated = true;
    c.out += Frame(kOk, Mac(secret, kServerLabel, client_nonce, c.nonce));
    return true;
  }

  // Connections whose challenge went unanswered for too long.
  std::vector<int> Unauthenticated(Clock::time_point now) {
    std::vector<int> late;
    for (auto& [fd, c] : connections) {
      if (!c.authenticated && c.auth_deadline <= now) {
        Refuse(c, "it did not authenticate within " + std::to_string(kAuthPatience.count() / 1000) + " s");
        late.push_back(fd);
      }
    }
    return late;
  }

  void Expire(Clock::time_point now) {
    for (auto it = waiters.begin(); it != waiters.end();) {
      if (it->deadline <= now) {
        connections[it->fd].out += Frame(kTimedOut, "");
        it = waiters.erase(it);
      } else {
        ++it;
      }
    }
  }

  void Drop(int fd) {
    ::close(fd);
    connections.erase(fd);
    waiters.remove_if([&](const Waiter& w) { return w.fd == fd; });
  }
};

StoreServer::StoreServer(const std::string& host, uint16_t port, std::string key)
    : state_(std::make_unique<State>()) {
  if (!key.empty() && key.size() < kMinKeyBytes) {
    throw StoreError("store: a key of " + std::to_string(key.size()) + " bytes is too short; it needs " +
                     std::to_string(kMinKeyBytes));
  }
  state_->secret = std::move(key);
  state_->refused = &refused_;
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
  for (auto& [fd, connection] : state_->connections) ::close(fd);
  state_->connections.clear();
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
    for (auto& [fd, c] : s.connections) fds.push_back({fd, short(POLLIN | (c.out.empty() ? 0 : POLLOUT)), 0});
    int timeout_ms = -1;
    const auto now = Clock::now();
    auto wake_by = [&](Clock::time_point deadline) {
      const int64_t left = std::max<int64_t>(0, std::chrono::duration_cast<milliseconds>(deadline - now).count() + 1);
      timeout_ms = timeout_ms < 0 ? int(left) : std::min(timeout_ms, int(left));
    };
    for (const State::Waiter& w : s.waiters) wake_by(w.deadline);
    for (const auto& [fd, c] : s.connections) {
      if (!c.authenticated) wake_by(c.auth_deadline);
    }
    if (::poll(fds.data(), fds.size(), timeout_ms) < 0 && errno != EINTR) return;
    s.Expire(Clock::now());
    for (int fd : s.Unauthenticated(Clock::now())) s.Drop(fd);
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
        s.Accept(fd, std::string(address) + ":" + std::to_string(ntohs(peer.sin_port)));
      }
    }
    for (size_t i = 2; i < fds.size(); ++i) {
      const int fd = fds[i].fd;
      if (!s.connections.contains(fd)) continue;
      State::Connection& c = s.connections[fd];
      bool drop = (fds[i].revents & (POLLERR | POLLNVAL)) != 0;
      if (!drop && (fds[i].revents & (POLLIN | POLLHUP))) {
        char buffer[65536];
        const ssize_t n = ::recv(fd, buffer, sizeof buffer, 0);
        if (n > 0) c.in.append(buffer, size_t(n));
        else if (n == 0 || (errno != EAGAIN && errno != EINTR)) drop = true;
        while (!drop && c.in.size() >= 4) {
          Reader header(c.in);
          const uint32_t length = header.U32();
          if (!c.authenticated && length != kAuthFrame) {
            drop = !s.Refuse(c, "it sent a request before authenticating (no key?)");
            break;
          }
          if (length == 0 || length > kMaxFrame) {
            drop = true;
            break;
          }
          if (c.in.size() < 4 + size_t(length)) break;
          const std::string frame = c.in.substr(4, length);
          c.in.erase(0, 4 + size_t(length));
          drop = c.authenticated ? !s.Handle(fd, frame) : !s.Authenticate(fd, frame);
        }
      }
      if (!drop && !s.connections[fd].out.empty()) {
        std::string& out = s.connections[fd].out;
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
      if (fd_ >= 0 && ::connect(fd_, found->ai_addr, found->ai_addrlen) == 0) {
        ::freeaddrinfo(found);
        const int one = 1;
        ::setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        if (!key.empty()) Authenticate(key, kAuthPatience);
        return;
      }
      last_error = std::strerror(errno);
      if (fd_ >= 0) ::close(fd_);
      fd_ = -1;
      ::freeaddrinfo(found);
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
    const auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now()).count();
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
    const auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now()).count();
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

void StoreClient::Authenticate(const std::string& key, milliseconds timeout) {
  std::lock_guard lock(mutex_);
  const auto deadline = Clock::now() + timeout;
  const std::string what = "authentication";
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
    Fail(what, "the coordinator refused this rank's key (it differs from the job's)", true);
  }
  if (uint8_t(proof[0]) != kOk || !SameMac(proof.substr(1), Mac(key, kServerLabel, client_nonce, server_nonce))) {
    Fail(what, "the coordinator could not prove that it holds the job's key", true);
  }
}

std::string StoreClient::Call(const std::string& request, const std::string& what, milliseconds timeout) {
  std::lock_guard lock(mutex_);
  // The coordinator answers a wait at its own deadline; allow a little more for the trip.
  const auto deadline = Clock::now() + timeout + milliseconds(2000);
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
constexpr milliseconds kShortCall(30000);  // set, add and check are answered at once
}  // namespace

void StoreClient::Set(const std::string& key, const std::string& value) {
  std::string body;
  PutString(&body, key);
  PutString(&body, value);
  Call(Frame(kSet, body), "set(\"" + key + "\")", kShortCall);
}

std::string StoreClient::Get(const std::string& key, milliseconds timeout) {
  std::string body;
  PutString(&body, key);
  PutI64(&body, timeout.count());
  const std::string reply = Call(Frame(kGet, body), "get(\"" + key + "\")", timeout);
  return Reader(reply).String();
}

int64_t StoreClient::Add(const std::string& key, int64_t delta) {
  std::string body;
  PutString(&body, key);
  PutI64(&body, delta);
  return Reader(Call(Frame(kAdd, body), "add(\"" + key + "\")", kShortCall)).I64();
}

void StoreClient::Wait(const std::vector<std::string>& keys, milliseconds timeout) {
  std::string body, names;
  PutU32(&body, uint32_t(keys.size()));
  for (const std::string& k : keys) {
    PutString(&body, k);
    names += (names.empty() ? "\"" : ", \"") + k + "\"";
  }
  PutI64(&body, timeout.count());
  Call(Frame(kWait, body), "wait(" + names + ")", timeout);
}

bool StoreClient::Check(const std::string& key) {
  std::string body;
  PutString(&body, key);
  return Reader(Call(Frame(kCheck, body), "check(\"" + key + "\")", kShortCall)).U8() != 0;
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

void WriteNewStoreKey(const std::string& path) {
  const std::string key = RandomBytes(kMinKeyBytes);
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) throw StoreError(Errno("cannot create the store key " + path));
  const bool written = ::write(fd, key.data(), key.size()) == ssize_t(key.size());
  if (::close(fd) != 0 || !written) throw StoreError(Errno("cannot write the store key " + path));
}

}  // namespace meshtrain::comm
