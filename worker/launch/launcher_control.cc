#include "worker/launch/launcher_control.h"

#include <climits>

#include <nlohmann/json.hpp>

namespace meshtrain::launch {
namespace {

using metrics::HttpRequestHead;
using metrics::HttpResponse;

nlohmann::json StatusJson(const AttemptStatus& status) {
  nlohmann::json json = {{"attempt", status.attempt}, {"state", AttemptStateName(status.state)}};
  if (status.state == AttemptState::kFailed) {
    json["exitCode"] = status.failure.status;
    json["rank"] = status.failure.rank;
    if (!status.failure.reason.empty()) json["reason"] = status.failure.reason;
  }
  if (status.state == AttemptState::kSuspended) {
    json["ranks"] = nlohmann::json::array();
    for (const RankExit& exit : status.stops) {
      nlohmann::json rank = {{"rank", exit.rank}, {"exitCode", exit.status}};
      if (!exit.reason.empty()) rank["reason"] = exit.reason;
      json["ranks"].push_back(std::move(rank));
    }
  }
  return json;
}

HttpResponse Json(int code, const nlohmann::json& body) {
  // A query's value may decode to bytes that are not UTF-8; they are replaced, not thrown on.
  HttpResponse response;
  response.code = code;
  response.content_type = "application/json";
  response.body = body.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
  return response;
}

HttpResponse Error(int code, const std::string& error, nlohmann::json body = nlohmann::json::object()) {
  body["error"] = error;
  return Json(code, body);
}

// Whether `given` is `secret`, in a time that depends on the secret's length only.
bool SameSecret(std::string_view given, std::string_view secret) {
  unsigned difference = given.size() != secret.size();
  for (size_t i = 0; i < secret.size(); ++i) {
    difference |= uint8_t(secret[i]) ^ uint8_t(i < given.size() ? given[i] : 0);
  }
  return difference == 0;
}

std::string Describe(const AttemptStatus& status) {
  return "this launcher is at attempt " + std::to_string(status.attempt) + ", " + AttemptStateName(status.state);
}

}  // namespace

const char* AttemptStateName(AttemptState state) {
  switch (state) {
    case AttemptState::kRunning: return "running";
    case AttemptState::kFailed: return "failed";
    case AttemptState::kReady: return "ready";
    case AttemptState::kSucceeded: return "succeeded";
    case AttemptState::kStopping: return "stopping";
    case AttemptState::kSuspended: return "suspended";
  }
  return "unknown";
}

std::optional<int> ParseAttempt(std::string_view text) {
  if (text.empty() || text.size() > 10) return std::nullopt;
  int64_t value = 0;
  for (char c : text) {
    if (c < '0' || c > '9') return std::nullopt;
    value = value * 10 + (c - '0');
  }
  if (value > INT_MAX) return std::nullopt;
  return int(value);
}

LauncherControl::LauncherControl(std::string token, AttemptStatus initial)
    : token_(std::move(token)), status_(initial) {}

std::vector<metrics::HttpRoute> LauncherControl::Routes() {
  const auto get = [this](const HttpRequestHead&) { return Json(200, StatusJson(status())); };
  const auto stop = [this](const HttpRequestHead& request) { return Instruct(request, AttemptInstruction::kStop); };
  const auto start = [this](const HttpRequestHead& request) { return Instruct(request, AttemptInstruction::kStart); };
  const auto suspend = [this](const HttpRequestHead& request) { return Instruct(request, AttemptInstruction::kSuspend); };
  return {{"/attempt", {"GET"}, get},
          {"/attempt/stop", {"POST"}, stop},
          {"/attempt/start", {"POST"}, start},
          {"/attempt/suspend", {"POST"}, suspend}};
}

HttpResponse LauncherControl::Instruct(const HttpRequestHead& request, AttemptInstruction::Kind kind) {
  const std::optional<std::string> token = metrics::QueryParameter(request.target, "token");
  if (!token || !SameSecret(*token, token_)) {
    return Error(403, token ? "the token is wrong" : "the query lacks the token parameter");
  }
  const std::optional<std::string> text = metrics::QueryParameter(request.target, "attempt");
  const std::optional<int> attempt = text ? ParseAttempt(*text) : std::nullopt;
  if (!attempt) {
    return Error(400, text ? "the query parameter attempt=\"" + *text + "\" is not an integer in [0, 2^31)"
                           : "the query lacks the attempt parameter");
  }

  std::unique_lock lock(mutex_);
  if (!closed_.empty()) return Error(503, closed_, StatusJson(status_));
  last_instruction_ = std::chrono::steady_clock::now();
  if (kind == AttemptInstruction::kStop && *attempt <= status_.attempt) return Json(200, StatusJson(status_));
  if (kind == AttemptInstruction::kSuspend &&
      (status_.state == AttemptState::kStopping || status_.state == AttemptState::kSuspended))
    return Json(200, StatusJson(status_));
  if (kind == AttemptInstruction::kStart) {
    if (*attempt == status_.attempt && status_.state == AttemptState::kRunning) return Json(200, StatusJson(status_));
    if (*attempt != status_.attempt || status_.state != AttemptState::kReady) {
      return Error(409, "attempt " + std::to_string(*attempt) + " is not ready: " + Describe(status_),
                   StatusJson(status_));
    }
  }
  pending_ = AttemptInstruction{kind, *attempt};
  const uint64_t completions = completions_;
  completed_.wait(lock, [&] { return completions_ != completions || !closed_.empty(); });
  if (completions_ == completions) return Error(503, closed_, StatusJson(status_));
  if (!refusal_.empty()) return Error(409, refusal_, StatusJson(status_));
  return Json(200, StatusJson(status_));
}

AttemptStatus LauncherControl::status() const {
  std::lock_guard lock(mutex_);
  return status_;
}

void LauncherControl::Set(const AttemptStatus& status) {
  std::lock_guard lock(mutex_);
  status_ = status;
}

std::chrono::steady_clock::time_point LauncherControl::last_instruction() const {
  std::lock_guard lock(mutex_);
  return last_instruction_;
}

std::optional<AttemptInstruction> LauncherControl::Pending() const {
  std::lock_guard lock(mutex_);
  return pending_;
}

void LauncherControl::Complete(const AttemptStatus& status, const std::string& refusal) {
  {
    std::lock_guard lock(mutex_);
    status_ = status;
    pending_.reset();
    refusal_ = refusal;
    ++completions_;
  }
  completed_.notify_all();
}

void LauncherControl::Close(const std::string& why) {
  {
    std::lock_guard lock(mutex_);
    closed_ = why;
    pending_.reset();
  }
  completed_.notify_all();
}

}  // namespace meshtrain::launch
