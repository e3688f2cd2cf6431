// The operator's side of the pod launchers' control endpoint (api::worker::kLauncherPort,
// worker/launch/launcher_control.h): POST /attempt/stop, /attempt/start and /attempt/suspend, each with the
// attempt and the pod's launcher token, answered with the launcher's state. The requests
// go out through the launchers' PodPoller (Post), never inside a reconcile.
//
// A pod's token is derived, not stored: HMAC-SHA256 under the operator's own key (the
// chart's Secret, --launcher-key-file) of the job's uid and the pod's node rank. The
// operator writes each node rank's token once into the job's Secret, which the pods mount;
// after a restart it derives the same tokens from the same key, and reads no Secret back.
// A token opens only its own job's launcher of that node rank.
//
// Thread-safety: pure functions, but LoadLauncherKey, which reads a file.

#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace meshtrain::controller {

// The fewest bytes an operator's key may have.
inline constexpr size_t kLauncherKeyMinBytes = 32;

// The operator's key: every byte of the file at `path`. Throws std::runtime_error naming
// the file when it cannot be read or holds fewer than kLauncherKeyMinBytes bytes.
std::string LoadLauncherKey(const std::string& path);

// The token of node rank `node_rank`'s launcher in the job with uid `job_uid`: 64 hex
// digits. REQUIRES: `key` is not empty.
std::string LauncherToken(std::string_view key, std::string_view job_uid, int64_t node_rank);

struct LauncherCall {
  nlohmann::json pod;
  // stop: end any older attempt and wait; start: run the stopped attempt; suspend: the
  // ranks checkpoint and stop, and the launcher reports how each ended
  std::string action;
  int64_t attempt = 0;
  bool operator==(const LauncherCall&) const = default;
};

// The call's path and query: /attempt/ACTION?attempt=N&token=T, with the pod's `token`.
std::string LauncherCallTarget(const LauncherCall& call, const std::string& token);

}  // namespace meshtrain::controller
