#include "operator/kube/errors.h"

namespace meshtrain::kube {

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
