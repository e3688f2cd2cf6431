// The operator's side of the pod launchers' control endpoint (api::worker::kLauncherPort,
// worker/launch/launcher_control.h): POST /attempt/stop and /attempt/start, each with the
// attempt and the pod's launcher token, answered with the launcher's state. The requests
// go out through the launchers' PodPoller (Post), never inside a reconcile.
//
// Thread-safety: pure functions.

#pragma once

#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

namespace meshtrain::controller {

struct LauncherCall {
  nlohmann::json pod;
  std::string action;  // stop: end any older attempt and wait; start: run the stopped attempt
  int64_t attempt = 0;
  bool operator==(const LauncherCall&) const = default;
};

// The call's path and query: /attempt/ACTION?attempt=N&token=T (the pod's own token).
std::string LauncherCallTarget(const LauncherCall& call);

}  // namespace meshtrain::controller
