// The operator's side of the pod launchers' control endpoint (api::worker::kLauncherPort,
// worker/launch/node_launcher.h): POST /attempt/stop and /attempt/start, each with the
// attempt and the pod's launcher token, answered with the launcher's state.
//
// Thread-safety: SendLauncherCalls may be called from any thread.

#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace meshtrain::controller {

struct LauncherCall {
  nlohmann::json pod;
  std::string action;  // stop: end any older attempt and wait; start: run the stopped attempt
  int64_t attempt = 0;
  bool operator==(const LauncherCall&) const = default;
};

struct LauncherAnswer {
  std::optional<nlohmann::json> state;  // the launcher's state after the call
  std::string error;                    // when there is none: what went wrong
};

// Sends every call at once and returns their answers in order, each within `timeout`
// (a stop waits for the old ranks to end: allow the launcher's grace).
std::vector<LauncherAnswer> SendLauncherCalls(const std::vector<LauncherCall>& calls, std::chrono::milliseconds timeout);

}  // namespace meshtrain::controller
