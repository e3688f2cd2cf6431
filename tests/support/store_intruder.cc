#include "tests/support/store_intruder.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>

namespace meshtrain::testing {

std::string U32(uint32_t v) { return std::string{char(v), char(v >> 8), char(v >> 16), char(v >> 24)}; }

std::string StoreAuthFrame(const std::string& key, const std::string& server_nonce, const std::string& client_nonce) {
  const std::string message = "meshtrain store client" + server_nonce + client_nonce;
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  HMAC(EVP_sha256(), key.data(), int(key.size()), reinterpret_cast<const unsigned char*>(message.data()),
       message.size(), digest, &length);
  return U32(1 + 32 + 32) + '\6' + client_nonce + std::string(reinterpret_cast<char*>(digest), length);
}

RawStoreConnection::RawStoreConnection(const std::string& host, uint16_t port) {
  addrinfo hints{}, *found = nullptr;
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  if (::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found) != 0 || !found)
    throw std::runtime_error("cannot resolve " + host);
  fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
  const bool connected = fd_ >= 0 && ::connect(fd_, found->ai_addr, found->ai_addrlen) == 0;
  const int error = errno;
  ::freeaddrinfo(found);
  if (!connected) {
    if (fd_ >= 0) ::close(fd_);
    throw std::runtime_error("cannot connect to " + host + ":" + std::to_string(port) + ": " + std::strerror(error));
  }
}

RawStoreConnection::~RawStoreConnection() { ::close(fd_); }

void RawStoreConnection::Send(const std::string& bytes) { (void)!::send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL); }

std::string RawStoreConnection::Read(size_t n, std::chrono::milliseconds patience) {
  std::string out;
  while (out.size() < n) {
    pollfd p{fd_, POLLIN, 0};
    if (::poll(&p, 1, int(patience.count())) <= 0) break;
    char buffer[256];
    const ssize_t got = ::recv(fd_, buffer, std::min(sizeof buffer, n - out.size()), 0);
    if (got <= 0) break;
    out.append(buffer, size_t(got));
  }
  return out;
}

std::string RawStoreConnection::Challenge() {
  const std::string frame = Read(4 + 33);  // length 33, status 3, a 32-byte nonce
  return frame.size() == 37 && frame.substr(0, 4) == U32(33) && frame[4] == '\3' ? frame.substr(5) : "";
}

bool RawStoreConnection::ClosedByPeer() { return Read(1).empty(); }

std::vector<Intrusion> IntrudeOnStore(const std::string& host, uint16_t port, const std::string& captured_key) {
  std::vector<Intrusion> out;
  // Sends `bytes` after the challenge and expects the server to hang up.
  auto expect_refusal = [&](const std::string& what, const std::string& bytes) {
    RawStoreConnection c(host, port);
    Intrusion result{what, false, ""};
    if (c.Challenge().empty()) {
      result.detail = "the server sent no challenge";
    } else {
      c.Send(bytes);
      result.refused = c.ClosedByPeer();
      if (!result.refused) result.detail = "the server kept the connection open";
    }
    out.push_back(result);
  };
  {
    RawStoreConnection c(host, port);
    const std::string nonce = c.Challenge();
    c.Send(StoreAuthFrame(std::string(32, 'w'), nonce, std::string(32, 'n')));
    const bool refused = !nonce.empty() && c.ClosedByPeer();
    out.push_back({"wrong key", refused, refused ? "" : "the server answered a wrong key's proof"});
  }
  // A set of "endpoint/0" straight away: op 1, key, value.
  const std::string key = "endpoint/0", value = "tcp://198.18.0.66:1";
  expect_refusal("no key", U32(uint32_t(1 + 4 + key.size() + 4 + value.size())) + '\1' + U32(uint32_t(key.size())) + key +
                               U32(uint32_t(value.size())) + value);
  {
    std::string recorded;
    {
      RawStoreConnection first(host, port);
      recorded = StoreAuthFrame(captured_key, first.Challenge(), std::string(32, 'c'));
      first.Send(recorded);
      const std::string proof = first.Read(4 + 33);
      if (proof.size() != 37 || proof[4] != '\0') {
        out.push_back({"replayed handshake", false, "the server refused the handshake to be recorded"});
        recorded.clear();
      }
    }
    if (!recorded.empty()) expect_refusal("replayed handshake", recorded);
  }
  expect_refusal("garbage", "GET /metrics HTTP/1.1\r\nHost: store\r\n\r\n");
  expect_refusal("huge length prefix", U32(0xFFFFFFF0u) + "x");
  {
    RawStoreConnection c(host, port);
    c.Challenge();
    c.Send(U32(65) + '\6' + std::string(10, 'h'));
    out.push_back({"half a message, then a hang-up", true, ""});
  }
  return out;
}

}  // namespace meshtrain::testing
