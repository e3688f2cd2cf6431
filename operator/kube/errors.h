// Typed errors for Kubernetes API requests.
//
// Every failed request becomes a KubeError whose kind says what the caller can do
// about it: NotFound and Conflict are ordinary control flow for a controller, Gone
// means a watch must relist, Invalid carries the server's field messages, and
// throttling, server and connection errors are retried by the client before they
// surface.

#pragma once

#include <stdexcept>
#include <string>

namespace meshtrain::kube {

enum class ErrorKind {
  kNotFound,         // 404
  kConflict,         // 409: stale resourceVersion, or AlreadyExists on create
  kGone,             // 410: the resourceVersion is too old to watch from
  kInvalid,          // 422, or 400 BadRequest
  kUnauthorized,     // 401 / 403
  kTooManyRequests,  // 429
  kServerError,      // 5xx
  kUnavailable,      // no HTTP response at all: connection refused, reset, timed out
  kOther,
};

class KubeError : public std::runtime_error {
 public:
  // `what` reads "VERB PATH: CODE Reason: message".
  KubeError(ErrorKind kind, int code, std::string reason, std::string message, const std::string& what);

  ErrorKind kind() const { return kind_; }
  int code() const { return code_; }              // HTTP status; 0 when there was no response
  const std::string& reason() const { return reason_; }    // Status.reason, e.g. "AlreadyExists"
  const std::string& message() const { return message_; }  // Status.message from the server
  bool retryable() const {
    return kind_ == ErrorKind::kTooManyRequests || kind_ == ErrorKind::kServerError || kind_ == ErrorKind::kUnavailable;
  }

 private:
  ErrorKind kind_;
  int code_;
  std::string reason_;
  std::string message_;
};

// The kind for an HTTP status code.
ErrorKind ErrorKindForStatus(int code);

}  // namespace meshtrain::kube
