#include "operator/kube/errors.h"

namespace meshtrain::kube {

const char* ErrorKindName(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::kNotFound: return "NotFound";
    case ErrorKind::kConflict: return "Conflict";
    case ErrorKind::kGone: return "Gone";
    case ErrorKind::kInvalid: return "Invalid";
    case ErrorKind::kUnauthorized: return "Unauthorized";
    case ErrorKind::kTooManyRequests: return "TooManyRequests";
    case ErrorKind::kServerError: return "ServerError";
    case ErrorKind::kUnavailable: return "Unavailable";
    case ErrorKind::kOther: return "Other";
  }
  return "Other";
}

KubeError::KubeError(ErrorKind kind, int code, std::string reason, std::string message, const std::string& what)
    : std::runtime_error(what), kind_(kind), code_(code), reason_(std::move(reason)), message_(std::move(message)) {}

ErrorKind ErrorKindForStatus(int code) {
  switch (code) {
    case 404: return ErrorKind::kNotFound;
    case 409: return ErrorKind::kConflict;
    case 410: return ErrorKind::kGone;
    case 400:
    case 422: return ErrorKind::kInvalid;
    case 401:
    case 403: return ErrorKind::kUnauthorized;
    case 429: return ErrorKind::kTooManyRequests;
    default: return code >= 500 ? ErrorKind::kServerError : ErrorKind::kOther;
  }
}

}  // namespace meshtrain::kube
