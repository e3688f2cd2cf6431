// The rendezvous Store: a small TCP key-value service that rank 0 runs at
// MESHTRAIN_COORDINATOR, through which ranks exchange endpoint names and ids and
// meet at barriers (DESIGN.md, "Rendezvous").
//
// Operations: set, get (waits for the key), add (atomic integer counter), wait (for
// several keys), check and barrier; every one takes a timeout. A coordinator that
// cannot be reached, dies or does not answer in time gives a StoreError naming the
// operation, the key and the coordinator; nothing blocks past its timeout.
//
// Wire format (little-endian): a request is u32 length, u8 op, then fields (strings
// as u32 length + bytes, integers as i64); a reply is u32 length, u8 status
// (0 ok, 1 timed out, 2 bad request), then its payload.
//
// Thread-safety: StoreServer runs its own thread; StoreClient serialises its calls
// with a mutex, so one client may be shared, though each thread usually has its own.

#pragma once

#include <chrono>
#include <map>
#include <cstdint>
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
  // Listens on host:port (port 0 picks a free one). Throws StoreError if it cannot.
  StoreServer(const std::string& host, uint16_t port);
  // Stops serving: waiting clients see the connection close.
  ~StoreServer();
  StoreServer(const StoreServer&) = delete;
  StoreServer& operator=(const StoreServer&) = delete;

  uint16_t port() const { return port_; }
  void Stop();

 private:
  struct State;
  void Serve();

  uint16_t port_ = 0;
  int listen_fd_ = -1;
  int wake_fds_[2] = {-1, -1};
  std::unique_ptr<State> state_;
  std::thread thread_;
};

class StoreClient {
 public:
  // Connects to "host:port", retrying until `connect_timeout` while the coordinator starts.
  StoreClient(const std::string& coordinator, milliseconds connect_timeout);
  ~StoreClient();
  StoreClient(const StoreClient&) = delete;
  StoreClient& operator=(const StoreClient&) = delete;

  void Set(const std::string& key, const std::string& value);
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
  // Sends one request and returns the reply payload; `what` describes the call for errors.
  std::string Call(const std::string& request, const std::string& what, milliseconds timeout);

  std::string coordinator_;
  std::mutex mutex_;
  int fd_ = -1;
  std::map<std::string, int64_t> barrier_generation_;
};

}  // namespace meshtrain::comm
