// Strangers on a rendezvous Store's port, played over raw sockets: what the tests send to
// show that the Store refuses them and that the job never notices (worker/comm/store.h
// gives the wire format and the handshake).
//
// Thread-safety: a RawStoreConnection belongs to one thread.

#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace meshtrain::testing {

std::string U32(uint32_t v);  // little-endian, as the Store frames lengths
// The client's handshake frame: op 6, its nonce, HMAC-SHA256(key, label Ns Nc).
std::string StoreAuthFrame(const std::string& key, const std::string& server_nonce, const std::string& client_nonce);

// A TCP connection to a Store that speaks bytes. Throws std::runtime_error when it cannot
// connect.
class RawStoreConnection {
 public:
  RawStoreConnection(const std::string& host, uint16_t port);
  ~RawStoreConnection();
  RawStoreConnection(const RawStoreConnection&) = delete;
  RawStoreConnection& operator=(const RawStoreConnection&) = delete;

  void Send(const std::string& bytes);
  // The next `n` bytes, or fewer if the connection closes or `patience` passes.
  std::string Read(size_t n, std::chrono::milliseconds patience = std::chrono::seconds(5));
  // The nonce of the challenge the server sends first, or "" if it sent none.
  std::string Challenge();
  // True when the server closed the connection (rather than answer, or wait).
  bool ClosedByPeer();

 private:
  int fd_ = -1;
};

struct Intrusion {
  std::string what;  // "wrong key", "no key", ...
  bool refused = false;
  std::string detail;  // what happened instead, when not refused
};

// Each stranger in turn, on its own connection: a wrong key, no key (a request without the
// handshake), a replayed handshake, garbage, a huge length prefix, and half a message
// followed by a hang-up (which has nothing to be refused: it only must not disturb). The
// replayed handshake is one recorded from a connection made with `captured_key`: what an
// eavesdropper on the job's network would have seen.
std::vector<Intrusion> IntrudeOnStore(const std::string& host, uint16_t port, const std::string& captured_key);

}  // namespace meshtrain::testing
