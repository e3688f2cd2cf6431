// What the operator reads from a job's pods (api/worker_contract.h): rank 0's training
// progress, from its Prometheus text exposition, and a launcher's attempt, from its
// control endpoint (worker/launch/node_launcher.h).
//
// Thread-safety: pure functions.

#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "api/training_job.h"

namespace meshtrain::controller {

// Reads step, loss, tokens/s, ETA and checkpoint facts from a worker's Prometheus text
// exposition (the names of api/worker_contract.h). Returns false when none is present.
bool ParseProgress(const std::string& metrics_text, api::ProgressStatus* progress);

// How one rank of a suspended launcher ended (its "ranks").
struct RankEnd {
  int64_t rank = 0, exit_code = 0;
  std::string reason;  // what the rank wrote: where it stopped, or why it failed; may be empty
  bool operator==(const RankEnd&) const = default;
};

// A pod launcher's answer to GET /attempt or to a control request.
struct LauncherState {
  int64_t attempt = 0;
  // running | failed | ready (stopped, waiting for start) | succeeded | stopping (a
  // suspend: its ranks checkpoint and stop) | suspended (they have all ended)
  std::string state;
  std::optional<int64_t> exit_code, rank;  // when failed: the first failed rank and its status
  std::string reason;  // when failed: what that rank said of it (at most kFailureReasonBytes); may be empty
  std::vector<RankEnd> ranks = {};  // when suspended: each rank that ran, in rank order
  bool operator==(const LauncherState&) const = default;
};

// nullopt when `answer` is not a launcher's state (a wrong or older endpoint).
std::optional<LauncherState> ParseLauncherState(const nlohmann::json& answer);

}  // namespace meshtrain::controller
