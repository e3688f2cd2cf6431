// Reads each running job's training progress from its rank-0 pod's metrics endpoint, off
// the reconcile path. Every `interval`, each watched job whose previous request has ended
// gets one GET bounded by `timeout`. Requests run concurrently on cpprestsdk's thread
// pool, so a slow or hanging endpoint delays only its own job's reading, and never a
// reconcile. A reading that differs from the previous one calls `changed(job key)` (the
// controller enqueues the job); Reconcile then takes it with Latest().
//
// Thread-safety: every method may be called from any thread. `changed` is called from
// cpprestsdk's threads, never after Stop() has returned.

#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <stop_token>
#include <string>
#include <thread>

#include <nlohmann/json.hpp>

#include "api/training_job.h"

namespace meshtrain::controller {

struct ProgressPollerOptions {
  std::chrono::milliseconds interval{5000};  // between the starts of two requests to one pod
  std::chrono::milliseconds timeout{1000};   // a request's limit, connect to last byte
};

class ProgressPoller {
 public:
  ProgressPoller(ProgressPollerOptions options, std::function<void(const std::string& job_key)> changed);
  ~ProgressPoller();

  void Start();
  // Stops polling and waits for the requests in flight (each ends within the timeout).
  void Stop();

  // From now on, reads `pod`'s progress for the job (by its uid and status.podIP),
  // instead of any earlier pod's. A pod without an IP yet is watched once it has one.
  void Watch(const std::string& job_key, const nlohmann::json& pod);
  void Forget(const std::string& job_key);
  // The latest reading taken from `pod` (matched by uid), if any.
  std::optional<api::ProgressStatus> Latest(const std::string& job_key, const nlohmann::json& pod) const;

 private:
  struct State;
  void Loop(std::stop_token stop);

  const ProgressPollerOptions options_;
  std::shared_ptr<State> state_;  // shared with requests in flight
  std::jthread thread_;
};

// Reads step, loss, tokens/s, ETA and checkpoint facts from a worker's Prometheus text
// exposition (the names of api/worker_contract.h). Returns false when none is present.
bool ParseProgress(const std::string& metrics_text, api::ProgressStatus* progress);

}  // namespace meshtrain::controller
