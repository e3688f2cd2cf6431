// libFuzzer target for the rendezvous Store's server (worker/comm/store_protocol.h): the
// framing and request decoding on the raw input, then a script of events played on a
// StoreService with up to four connections, as the server's sockets would deliver them.
//
// The input: byte 0 picks a key (odd) or none; then each event is a byte, whose low two
// bits name the connection and the rest what happens:
//   0 raw:      a length byte N, then N bytes the connection sends
//   1 answer:   32 bytes of client nonce; the harness sends the right answer to the
//               connection's challenge (the fuzzer cannot compute an HMAC)
//   2 request:  op, key and number bytes; the harness sends a well-formed request
//   3 time:     a byte B; the clock moves on B x 50 ms and deadlines expire
//   4 reconnect the connection
// Beyond "no crash", it checks on every input:
//   - a request that decodes encodes back to the bytes it was read from;
//   - the server only sends whole, well-formed replies (ok, timed out or a challenge);
//   - with a key, a connection gets nothing but its challenge until it answers rightly,
//     and then the server's proof.

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "worker/comm/store_protocol.h"

namespace {

using namespace meshtrain::comm::store;
using Clock = StoreService::Clock;

[[noreturn]] void Fail(const char* what) {
  std::fprintf(stderr, "%s\n", what);
  std::abort();
}

// The input, read front to back; reads past its end give zeros.
class Script {
 public:
  explicit Script(std::string_view data) : data_(data) {}
  bool done() const { return pos_ >= data_.size(); }
  uint8_t Byte() { return pos_ < data_.size() ? uint8_t(data_[pos_++]) : 0; }
  std::string Bytes(size_t n) {
    std::string s(data_.substr(std::min(pos_, data_.size()), n));
    pos_ += n;
    s.resize(n, '\0');
    return s;
  }

 private:
  std::string_view data_;
  size_t pos_ = 0;
};

void CheckDecoding(std::string_view input) {
  if (const std::optional<Request> request = ParseRequest(input)) {
    const std::string encoded = EncodeRequest(*request).substr(4);
    if (input.substr(0, encoded.size()) != encoded) Fail("a decoded request encodes to other bytes");
  }
  const FrameSplit split = SplitFrame(input);
  if (split.kind == FrameSplit::kComplete && (split.body.size() != split.length || split.length > kMaxFrame)) {
    Fail("a frame split at the wrong length");
  }
  std::string why;
  VerifyClientAnswer(std::string(kMinKeyBytes, 'k'), std::string(kNonceBytes, 'n'), input, &why);
}

struct Peer {
  bool open = false;
  bool admitted = false;       // authenticated, as far as the harness knows
  bool challenged = false;     // its challenge has been read
  int generation = 0;          // makes each connection's nonce its own
  std::string nonce;           // the server's challenge to it
  std::string client_nonce;    // of the last right answer sent
};

// Reads and checks the replies the service has for connection `id`, then clears them.
void ReadReplies(StoreService& service, int id, Peer& peer, const std::string& key) {
  std::string& out = service.Output(id);
  std::string_view rest = out;
  while (!rest.empty()) {
    const FrameSplit frame = SplitFrame(rest);
    if (frame.kind != FrameSplit::kComplete) Fail("the server sent part of a reply");
    const uint8_t status = uint8_t(frame.body[0]);
    const std::string_view payload = frame.body.substr(1);
    if (!key.empty() && !peer.challenged) {
      if (status != kChallenge || payload != peer.nonce) Fail("the first reply is not the challenge");
      peer.challenged = true;
    } else if (!peer.admitted) {
      if (status != kOk || payload != Mac(key, kServerLabel, peer.client_nonce, peer.nonce)) {
        Fail("a connection that has not authenticated got something other than the server's proof");
      }
      peer.admitted = true;
    } else if (status != kOk && status != kTimedOut) {
      Fail("a reply with an unexpected status");
    }
    rest.remove_prefix(4 + frame.length);
  }
  out.clear();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  CheckDecoding(input);

  Script script(input);
  const std::string key = script.Byte() & 1 ? std::string(kMinKeyBytes, 'k') : "";
  StoreService service(key, [](const std::string&, const std::string&) {});
  Clock::time_point now{std::chrono::hours(1)};
  Peer peers[4];
  auto open = [&](int id) {
    Peer& p = peers[id];
    p = Peer{true, key.empty(), false, p.generation + 1, std::string(kNonceBytes, char('a' + p.generation % 26 + id)), ""};
    service.Open(id, "peer" + std::to_string(id), p.nonce, now);
  };
  auto drop = [&](int id) {
    service.Close(id);
    peers[id].open = false;
  };
  while (!script.done()) {
    const uint8_t event = script.Byte();
    const int id = event & 3;
    if (!peers[id].open) open(id);
    bool keep = true;
    switch ((event >> 2) % 5) {
      case 0:
        keep = service.Receive(id, script.Bytes(script.Byte()), now);
        break;
      case 1: {
        Peer& p = peers[id];
        p.client_nonce = script.Bytes(kNonceBytes);
        keep = service.Receive(id, Frame(kAuth, p.client_nonce + Mac(key, kClientLabel, p.nonce, p.client_nonce)), now);
        break;
      }
      case 2: {
        Request request;
        request.op = Op(kSet + script.Byte() % 5);
        const int keys = request.op == kWait ? 1 + script.Byte() % 3 : 1;
        for (int k = 0; k < keys; ++k) request.keys.push_back("key" + std::to_string(script.Byte() % 4));
        request.value = std::to_string(int8_t(script.Byte()));
        request.number = int64_t(int8_t(script.Byte())) * 100;
        keep = service.Receive(id, EncodeRequest(request), now);
        break;
      }
      case 3:
        now += std::chrono::milliseconds(50 * script.Byte());
        for (int late : service.Expire(now)) drop(late);
        break;
      case 4:
        drop(id);
        continue;
    }
    if (!keep) {
      drop(id);
      continue;
    }
    for (int other = 0; other < 4; ++other) {
      if (peers[other].open) ReadReplies(service, other, peers[other], key);
    }
  }
  // The connections the service holds are the open ones.
  int held = 0;
  for (int id : service.Connections()) {
    if (id < 0 || id > 3 || !peers[id].open) Fail("the service holds a closed connection");
    ++held;
  }
  for (const Peer& p : peers) held -= p.open;
  if (held != 0) Fail("the service lost an open connection");
  return 0;
}
