// Reads what the pods of each running job serve over HTTP, off the reconcile path: rank
// 0's training metrics (status.progress), and each launcher's attempt (in-place
// restarts). Every `interval`, each watched pod whose previous request has ended gets
// one GET of `path` bounded by `timeout`. Requests run concurrently on cpprestsdk's
// thread pool, so a slow or hanging endpoint delays only its own reading, and never a
// reconcile. Reads are bounded: at most `max_in_flight` at once. A pod whose read failed
// (no answer within the timeout, a refused connection, an error status) is read again
// only after a backoff that doubles up to `max_backoff`, and after the pods that answer:
// endpoints that hang take the slots only that others leave. `parse` turns an answer's body into a
// reading (nullopt: none); a reading that differs from the pod's previous one calls
// `changed(job key)` (the controller enqueues the job), and Reconcile then takes it with
// Latest().
//
// Thread-safety: every method may be called from any thread. `parse` and `changed` are
// called from cpprestsdk's threads, `changed` never after Stop() has returned.

#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <stop_token>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

namespace meshtrain::controller {

struct PodPollerOptions {
  int port = 0;              // on each pod's status.podIP
  std::string path;          // e.g. "/metrics"
  std::chrono::milliseconds interval{5000};  // between the starts of two requests to one pod
  std::chrono::milliseconds timeout{1000};   // a request's limit, connect to last byte
  int max_in_flight = 256;                   // GETs at once, over every pod
  std::chrono::milliseconds max_backoff{10000};  // the longest wait after failed reads
};

class PodPoller {
 public:
  using Parse = std::function<std::optional<nlohmann::json>(const std::string& body)>;
  PodPoller(PodPollerOptions options, Parse parse, std::function<void(const std::string& job_key)> changed);
  ~PodPoller();

  void Start();
  // Stops polling and waits for the requests in flight (each ends within the timeout).
  void Stop();

  // From now on, reads these pods for the job (by uid and status.podIP), instead of any
  // others. A pod's reading is kept while the same pod stays watched; a pod without an IP
  // yet is read once it has one.
  void Watch(const std::string& job_key, const std::vector<nlohmann::json>& pods);
  void Forget(const std::string& job_key);
  // The latest reading taken from `pod` (matched by uid), if any.
  std::optional<nlohmann::json> Latest(const std::string& job_key, const nlohmann::json& pod) const;
  // POSTs `target` (a path and query) to a watched pod, unless a POST to it is still in
  // flight; returns at once. An answer that parses as a reading (whatever its status
  // code) becomes the pod's latest and calls `changed`; a failure is logged.
  void Post(const std::string& job_key, const nlohmann::json& pod, const std::string& target);

 private:
  struct State;
  void Loop(std::stop_token stop);

  const PodPollerOptions options_;
  std::shared_ptr<State> state_;  // shared with requests in flight
  std::jthread thread_;
};

}  // namespace meshtrain::controller
