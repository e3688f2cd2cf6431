// The rendezvous Store's wire protocol (store.h has the format) and the server's state
// without its sockets: framing, request decoding, the handshake check and what each
// connection's bytes do. StoreServer moves bytes between sockets and a StoreService;
// tests/fuzz/store_fuzzer.cc pushes arbitrary streams through the same code.
//
// Thread-safety: the functions are pure; a StoreService belongs to one thread.

#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <list>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace meshtrain::comm::store {

enum Op : uint8_t { kSet = 1, kGet = 2, kAdd = 3, kWait = 4, kCheck = 5, kAuth = 6 };
enum Status : uint8_t { kOk = 0, kTimedOut = 1, kBadRequest = 2, kChallenge = 3 };
constexpr uint32_t kMaxFrame = 64u << 20;  // a frame's length prefix, either way

constexpr size_t kNonceBytes = 32, kMacBytes = 32, kMinKeyBytes = 32;
constexpr uint32_t kAuthFrame = 1 + kNonceBytes + kMacBytes;  // op, client nonce, MAC
constexpr std::chrono::milliseconds kAuthPatience(10000);
// Longer waits are cut to this, so that a deadline never overflows the clock.
constexpr std::chrono::milliseconds kLongestWait(std::chrono::hours(24 * 365));

void PutU32(std::string* out, uint32_t v);
void PutI64(std::string* out, int64_t v);
void PutString(std::string* out, std::string_view s);
// u32 length, `head` (an op or a status), `body`.
std::string Frame(uint8_t head, std::string_view body);

// Reads fields from a frame; ok() turns false, and stays false, on a short frame.
class Reader {
 public:
  explicit Reader(std::string_view data) : data_(data) {}
  bool ok() const { return ok_; }
  size_t left() const { return ok_ ? data_.size() - pos_ : 0; }
  uint32_t U32();
  int64_t I64();
  uint8_t U8();
  std::string String();

 private:
  bool Need(size_t n);
  std::string_view data_;
  size_t pos_ = 0;
  bool ok_ = true;
};

// The first frame of a stream. `length` is its length prefix once 4 bytes are in.
struct FrameSplit {
  enum Kind { kIncomplete, kMalformed, kComplete } kind = kIncomplete;
  uint32_t length = 0;
  std::string_view body;  // kComplete: the head byte and the fields, a view into the stream
};
// kMalformed: a length of 0 or over kMaxFrame.
FrameSplit SplitFrame(std::string_view stream);

struct Request {
  Op op = kSet;
  std::vector<std::string> keys;  // one, or for wait one or more
  std::string value;              // set
  int64_t number = 0;             // add: the delta; get and wait: the timeout in ms

  bool operator==(const Request&) const = default;
};
// A whole request frame, length prefix included.
std::string EncodeRequest(const Request& request);
// Decodes a request's frame body (op, fields; bytes after the fields are ignored).
// nullopt when the op is not a request's, a field is cut short, or a wait names no key.
std::optional<Request> ParseRequest(std::string_view body);

// HMAC-SHA256(key, label || first || second), and its constant-time comparison.
constexpr const char* kClientLabel = "meshtrain store client";
constexpr const char* kServerLabel = "meshtrain store server";
std::string Mac(std::string_view key, const char* label, std::string_view first, std::string_view second);
bool SameMac(std::string_view a, std::string_view b);

// The server's check of a client's answer (an auth frame's body) to the challenge
// `server_nonce`: the proof to send back in an ok reply, or nullopt with *why set.
std::optional<std::string> VerifyClientAnswer(std::string_view key, std::string_view server_nonce,
                                              std::string_view body, std::string* why);

// The server's keys, each connection's buffers and handshake, and the gets and waits
// parked until their keys are set. A connection is named by an id the caller chooses
// (StoreServer: its socket) and lives from Open() to Close().
class StoreService {
 public:
  using Clock = std::chrono::steady_clock;
  // Told a connection's peer and why it failed to authenticate; the caller then drops it.
  using RefuseLog = std::function<void(const std::string& peer, const std::string& why)>;

  // `key`: the job's key, or empty to admit every client.
  StoreService(std::string key, RefuseLog refused);

  // A new connection from `peer`. With a key, `nonce` (kNonceBytes fresh random bytes)
  // is its challenge, staged in Output(id), to be answered by now + kAuthPatience.
  void Open(int id, std::string peer, std::string nonce, Clock::time_point now);
  // Bytes from connection `id` (REQUIRES: open, as for Output): handles each complete
  // frame in order. False when it is to be dropped: a malformed request, or a handshake
  // that failed (logged).
  bool Receive(int id, std::string_view bytes, Clock::time_point now);
  // Bytes for connection `id`; the caller erases what it has sent.
  std::string& Output(int id);
  // Forgets a connection and its parked requests.
  void Close(int id);
  // Answers the parked requests whose deadline has passed ("timed out"), and returns
  // the connections whose handshake is overdue (logged; the caller drops them).
  std::vector<int> Expire(Clock::time_point now);
  // The earliest deadline of a parked request or handshake; nullopt when none.
  std::optional<Clock::time_point> NextDeadline() const;
  std::vector<int> Connections() const;

 private:
  struct Connection {
    std::string in, out;
    std::string peer;  // address:port, for the log
    bool authenticated = false;
    std::string nonce;  // the challenge sent to it
    Clock::time_point auth_deadline;
  };
  struct Waiter {
    int id;
    Op op;  // kGet or kWait
    std::vector<std::string> keys;
    Clock::time_point deadline;
  };

  bool Ready(const Waiter& w) const;
  void Answer(const Waiter& w);
  void WakeWaiters();
  bool Handle(int id, std::string_view body, Clock::time_point now);
  bool Authenticate(Connection& c, std::string_view body);
  bool Refuse(const Connection& c, const std::string& why);

  std::string key_;
  RefuseLog refused_;
  std::map<std::string, std::string> data_;
  std::map<int, Connection> connections_;
  std::list<Waiter> waiters_;
};

}  // namespace meshtrain::comm::store
