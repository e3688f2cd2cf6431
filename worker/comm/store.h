// The rendezvous Store: a small TCP key-value service that rank 0 runs at
// MESHTRAIN_COORDINATOR, through which ranks exchange endpoint names and ids and
// meet at barriers (docs/design.md, "How a job runs").
//
// Operations: set, get (waits for the key), add (atomic integer counter), wait (for
// several keys), check and barrier; every one takes a timeout. A coordinator that
// cannot be reached, dies or does not answer in time gives a StoreError naming the
// operation, the key and the coordinator; nothing blocks past its timeout.
//
// Wire format (little-endian): a request is u32 length, u8 op, then fields (strings
// as u32 length + bytes, integers as i64); a reply is u32 length, u8 status
// (0 ok, 1 timed out, 2 bad request, 3 challenge), then its payload.
//
// Authentication, with a key (the job's secret, at least 32 bytes; ReadStoreKey):
//   server -> client  challenge: a fresh random 32-byte nonce Ns
//   client -> server  op 6 (auth): its own nonce Nc, HMAC-SHA256(key, "meshtrain store client" Ns Nc)
//   server -> client  ok: HMAC-SHA256(key, "meshtrain store server" Nc Ns)
// Each side proves it holds the key without sending it, and a recorded answer is worth
// nothing against the next connection's nonce. A connection that sends anything else
// first, answers wrongly, or does not answer within 10 s is dropped, and the server logs
// its address; the others are not disturbed. Without a key, neither side authenticates.
// store_protocol.h has the protocol's code, apart from the sockets.
//
// Thread-safety: StoreServer runs its own thread; StoreClient serialises its calls
// with a mutex, so one client may be shared, though each thread usually has its own.

#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace meshtrain::comm {

using std::chrono::milliseconds;

class StoreError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class StoreServer {
 public:
  // Listens on host:port (port 0 picks a free one), admitting only clients that prove
  // they hold `key` (empty: every client). Throws StoreError if it cannot listen.
  StoreServer(const std::string& host, uint16_t port, std::string key = {});
  // Stops serving: waiting clients see the connection close.
  ~StoreServer();
  StoreServer(const StoreServer&) = delete;
  StoreServer& operator=(const StoreServer&) = delete;

  uint16_t port() const { return port_; }
  // Connections dropped for failing to authenticate, so far.
  int64_t refused() const { return refused_.load(); }
  void Stop();

 private:
  struct State;
  void Serve();

  uint16_t port_ = 0;
  std::atomic<int64_t> refused_{0};
  int listen_fd_ = -1;
  int wake_fds_[2] = {-1, -1};
  std::unique_ptr<State> state_;
  std::thread thread_;
};

class StoreClient {
 public:
  // Connects to "host:port", retrying until `connect_timeout` while the coordinator starts,
  // and authenticates with `key` when given, by the same deadline (at least 100 ms for the
  // handshake). A connection that ends before the coordinator's challenge is retried as a
  // refused one is: a coordinator stopping at that address (a previous gang's) accepted it.
  // Throws StoreError when the coordinator cannot be reached, does not answer the
  // handshake in time, refuses the key, or cannot prove that it holds it.
  StoreClient(const std::string& coordinator, milliseconds connect_timeout, const std::string& key = {});
  ~StoreClient();
  StoreClient(const StoreClient&) = delete;
  StoreClient& operator=(const StoreClient&) = delete;

  void Set(const std::string& key, const std::string& value);
  // The same, failing when no reply comes within `patience` (a heartbeat's bound).
  void Set(const std::string& key, const std::string& value, milliseconds patience);
  // Waits until `key` is set, up to `timeout`.
  std::string Get(const std::string& key, milliseconds timeout);
  // Adds `delta` to the integer at `key` (0 if unset) and returns the new value.
  int64_t Add(const std::string& key, int64_t delta);
  // Waits until every key is set, up to `timeout`.
  void Wait(const std::vector<std::string>& keys, milliseconds timeout);
  bool Check(const std::string& key);
  // Returns once `world` clients have called Barrier with the same name (for the same
  // time: a name can be reused), or throws after `timeout` saying how many arrived.
  void Barrier(const std::string& name, int world, milliseconds timeout);

  const std::string& coordinator() const { return coordinator_; }

 private:
  // Sends one request and returns the reply payload, failing when none comes within
  // `patience`; `timeout` is the coordinator's wait, and `what` describes the call for errors.
  std::string Call(const std::string& request, const std::string& what, milliseconds timeout, milliseconds patience);
  // The challenge-response above, on the fresh connection. Returns false, having closed
  // it, when the connection ended before the first byte of the challenge came.
  bool Authenticate(const std::string& key, milliseconds timeout);
  // Writes `bytes`, then reads one reply (status and payload), by `deadline`; mutex_ held.
  void SendAll(const std::string& bytes, std::chrono::steady_clock::time_point deadline, const std::string& what);
  std::string ReceiveReply(std::chrono::steady_clock::time_point deadline, const std::string& what);
  [[noreturn]] void Fail(const std::string& what, const std::string& why, bool close);

  std::string coordinator_;
  std::mutex mutex_;
  int fd_ = -1;
  std::map<std::string, int64_t> barrier_generation_;
};

// The job's Store key from `path` (MESHTRAIN_STORE_KEY_FILE). Throws StoreError naming the
// file when it cannot be read or holds fewer than 32 bytes.
std::string ReadStoreKey(const std::string& path);

// A new random 256-bit key. Throws StoreError when the system has no randomness.
std::string NewStoreKey();

}  // namespace meshtrain::comm
