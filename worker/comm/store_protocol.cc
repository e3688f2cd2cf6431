#include "worker/comm/store_protocol.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>

#include <algorithm>
#include <cstdlib>

namespace meshtrain::comm::store {

void PutU32(std::string* out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out->push_back(char((v >> (8 * i)) & 0xFF));
}

void PutI64(std::string* out, int64_t v) {
  for (int i = 0; i < 8; ++i) out->push_back(char((uint64_t(v) >> (8 * i)) & 0xFF));
}

void PutString(std::string* out, std::string_view s) {
  PutU32(out, uint32_t(s.size()));
  out->append(s);
}

std::string Frame(uint8_t head, std::string_view body) {
  std::string out;
  PutU32(&out, uint32_t(body.size() + 1));
  out.push_back(char(head));
  out.append(body);
  return out;
}

bool Reader::Need(size_t n) {
  if (data_.size() - pos_ < n) ok_ = false;
  return ok_;
}

uint32_t Reader::U32() {
  if (!Need(4)) return 0;
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= uint32_t(uint8_t(data_[pos_ + i])) << (8 * i);
  pos_ += 4;
  return v;
}

int64_t Reader::I64() {
  if (!Need(8)) return 0;
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= uint64_t(uint8_t(data_[pos_ + i])) << (8 * i);
  pos_ += 8;
  return int64_t(v);
}

uint8_t Reader::U8() { return Need(1) ? uint8_t(data_[pos_++]) : 0; }

std::string Reader::String() {
  const uint32_t n = U32();
  if (!Need(n)) return "";
  std::string s(data_.substr(pos_, n));
  pos_ += n;
  return s;
}

FrameSplit SplitFrame(std::string_view stream) {
  FrameSplit split;
  if (stream.size() < 4) return split;
  split.length = Reader(stream).U32();
  if (split.length == 0 || split.length > kMaxFrame) split.kind = FrameSplit::kMalformed;
  else if (stream.size() - 4 >= split.length) split.kind = FrameSplit::kComplete, split.body = stream.substr(4, split.length);
  return split;
}

std::string EncodeRequest(const Request& request) {
  std::string body;
  if (request.op == kWait) PutU32(&body, uint32_t(request.keys.size()));
  for (const std::string& key : request.keys) PutString(&body, key);
  if (request.op == kSet) PutString(&body, request.value);
  if (request.op == kGet || request.op == kWait || request.op == kAdd) PutI64(&body, request.number);
  return Frame(request.op, body);
}

std::optional<Request> ParseRequest(std::string_view body) {
  Reader r(body);
  Request request;
  request.op = Op(r.U8());
  switch (request.op) {
    case kSet:
      request.keys = {r.String()};
      request.value = r.String();
      break;
    case kAdd:
    case kGet:
      request.keys = {r.String()};
      request.number = r.I64();
      break;
    case kCheck:
      request.keys = {r.String()};
      break;
    case kWait: {
      const uint32_t n = r.U32();
      if (n == 0 || n > r.left() / 4) return std::nullopt;  // each key takes 4 bytes at least
      for (uint32_t i = 0; i < n && r.ok(); ++i) request.keys.push_back(r.String());
      request.number = r.I64();
      break;
    }
    default:
      return std::nullopt;
  }
  if (!r.ok()) return std::nullopt;
  return request;
}

std::string Mac(std::string_view key, const char* label, std::string_view first, std::string_view second) {
  std::string message(label);
  message.append(first).append(second);
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  HMAC(EVP_sha256(), key.data(), int(key.size()), reinterpret_cast<const unsigned char*>(message.data()),
       message.size(), digest, &length);
  return std::string(reinterpret_cast<char*>(digest), length);
}

bool SameMac(std::string_view a, std::string_view b) {
  return a.size() == b.size() && a.size() == kMacBytes && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

std::optional<std::string> VerifyClientAnswer(std::string_view key, std::string_view server_nonce,
                                              std::string_view body, std::string* why) {
  if (body.size() != kAuthFrame || uint8_t(body[0]) != kAuth) {
    *why = "it sent a request before authenticating (no key?)";
    return std::nullopt;
  }
  const std::string_view client_nonce = body.substr(1, kNonceBytes), mac = body.substr(1 + kNonceBytes);
  if (!SameMac(mac, Mac(key, kClientLabel, server_nonce, client_nonce))) {
    *why = "it does not hold the job's key";
    return std::nullopt;
  }
  return Mac(key, kServerLabel, client_nonce, server_nonce);
}

// ---------------------------------------------------------------------------
// StoreService

StoreService::StoreService(std::string key, RefuseLog refused) : key_(std::move(key)), refused_(std::move(refused)) {}

void StoreService::Open(int id, std::string peer, std::string nonce, Clock::time_point now) {
  Connection& c = connections_[id] = Connection{};
  c.peer = std::move(peer);
  c.authenticated = key_.empty();
  if (c.authenticated) return;
  c.nonce = std::move(nonce);
  c.out = Frame(kChallenge, c.nonce);
  c.auth_deadline = now + kAuthPatience;
}

std::string& StoreService::Output(int id) { return connections_[id].out; }

void StoreService::Close(int id) {
  connections_.erase(id);
  waiters_.remove_if([&](const Waiter& w) { return w.id == id; });
}

std::vector<int> StoreService::Connections() const {
  std::vector<int> ids;
  for (const auto& [id, c] : connections_) ids.push_back(id);
  return ids;
}

bool StoreService::Receive(int id, std::string_view bytes, Clock::time_point now) {
  Connection& c = connections_[id];
  c.in.append(bytes);
  while (c.in.size() >= 4) {
    const FrameSplit frame = SplitFrame(c.in);
    // A stranger is dropped on its first bytes, before it can make the server hold a frame.
    if (!c.authenticated && frame.length != kAuthFrame) {
      return Refuse(c, "it sent a request before authenticating (no key?)");
    }
    if (frame.kind == FrameSplit::kMalformed) return false;
    if (frame.kind == FrameSplit::kIncomplete) break;
    const std::string body(frame.body);
    c.in.erase(0, 4 + size_t(frame.length));
    if (!(c.authenticated ? Handle(id, body, now) : Authenticate(c, body))) return false;
  }
  return true;
}

bool StoreService::Refuse(const Connection& c, const std::string& why) {
  refused_(c.peer, why);
  return false;
}

bool StoreService::Authenticate(Connection& c, std::string_view body) {
  std::string why;
  const std::optional<std::string> proof = VerifyClientAnswer(key_, c.nonce, body, &why);
  if (!proof) return Refuse(c, why);
  c.authenticated = true;
  c.out += Frame(kOk, *proof);
  return true;
}

bool StoreService::Ready(const Waiter& w) const {
  return std::all_of(w.keys.begin(), w.keys.end(), [&](const std::string& k) { return data_.contains(k); });
}

void StoreService::Answer(const Waiter& w) {
  std::string body;
  if (w.op == kGet) PutString(&body, data_.at(w.keys[0]));
  connections_[w.id].out += Frame(kOk, body);
}

void StoreService::WakeWaiters() {
  for (auto it = waiters_.begin(); it != waiters_.end();) {
    if (Ready(*it)) {
      Answer(*it);
      it = waiters_.erase(it);
    } else {
      ++it;
    }
  }
}

// One authenticated request; false if it was malformed.
bool StoreService::Handle(int id, std::string_view body, Clock::time_point now) {
  std::optional<Request> request = ParseRequest(body);
  if (!request) return false;
  std::string& out = connections_[id].out;
  std::string& key = request->keys[0];
  switch (request->op) {
    case kSet:
      data_[std::move(key)] = std::move(request->value);
      out += Frame(kOk, "");
      WakeWaiters();
      return true;
    case kAdd: {
      int64_t value = 0;
      if (auto it = data_.find(key); it != data_.end()) value = std::strtoll(it->second.c_str(), nullptr, 10);
      value = int64_t(uint64_t(value) + uint64_t(request->number));  // wraps, as the hardware would
      data_[key] = std::to_string(value);
      std::string reply;
      PutI64(&reply, value);
      out += Frame(kOk, reply);
      WakeWaiters();
      return true;
    }
    case kCheck:
      out += Frame(kOk, std::string(1, data_.contains(key) ? '\1' : '\0'));
      return true;
    case kGet:
    case kWait: {
      const auto timeout = std::clamp(std::chrono::milliseconds(request->number), std::chrono::milliseconds(0), kLongestWait);
      Waiter w{id, request->op, std::move(request->keys), now + timeout};
      if (Ready(w)) Answer(w);
      else waiters_.push_back(std::move(w));
      return true;
    }
    default:
      return false;
  }
}

std::vector<int> StoreService::Expire(Clock::time_point now) {
  for (auto it = waiters_.begin(); it != waiters_.end();) {
    if (it->deadline <= now) {
      connections_[it->id].out += Frame(kTimedOut, "");
      it = waiters_.erase(it);
    } else {
      ++it;
    }
  }
  std::vector<int> late;
  for (auto& [id, c] : connections_) {
    if (!c.authenticated && c.auth_deadline <= now) {
      Refuse(c, "it did not authenticate within " + std::to_string(kAuthPatience.count() / 1000) + " s");
      late.push_back(id);
    }
  }
  return late;
}

std::optional<StoreService::Clock::time_point> StoreService::NextDeadline() const {
  std::optional<Clock::time_point> next;
  auto consider = [&](Clock::time_point t) { next = next ? std::min(*next, t) : t; };
  for (const Waiter& w : waiters_) consider(w.deadline);
  for (const auto& [id, c] : connections_) {
    if (!c.authenticated) consider(c.auth_deadline);
  }
  return next;
}

}  // namespace meshtrain::comm::store
