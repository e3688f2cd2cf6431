// A rate-limited work queue of object keys, with client-go's semantics.
//
// - A key added many times before a worker takes it is processed once (deduplication).
// - A key being processed is never handed to a second worker; if it is added meanwhile,
//   it is queued again when the first worker calls Done().
// - AddRateLimited() delays a key by the larger of its own exponential backoff
//   (base_delay * 2^failures, capped at max_delay) and the global token bucket's wait.
//   Forget() resets the key's failures once it succeeds.
//
// Thread-safe.

#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>

#include "operator/kube/rate_limiter.h"

namespace meshtrain::kube {

struct WorkQueueOptions {
  std::chrono::milliseconds base_delay{5};
  std::chrono::milliseconds max_delay{1000 * 1000};
  double qps = 10;  // the global bucket
  int burst = 100;
};

class WorkQueue {
 public:
  using Clock = std::chrono::steady_clock;

  explicit WorkQueue(WorkQueueOptions options = {});

  void Add(const std::string& key);
  void AddAfter(const std::string& key, Clock::duration delay);
  void AddRateLimited(const std::string& key);
  void Forget(const std::string& key);
  int NumRequeues(const std::string& key) const;

  // Blocks until a key is ready or the queue shuts down (nullopt).
  // `waited`, when given, gets how long the key was ready before it was taken.
  std::optional<std::string> Get(Clock::duration* waited = nullptr);
  void Done(const std::string& key);

  // Keys ready to be taken (not counting delayed ones).
  size_t Len() const;
  void ShutDown();

 private:
  void AddLocked(const std::string& key);
  void PromoteDueLocked(Clock::time_point now);

  const WorkQueueOptions options_;
  TokenBucket bucket_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::string> queue_;
  std::map<std::string, Clock::time_point> ready_since_;  // keys in queue_ -> when they joined it
  std::set<std::string> dirty_;
  std::set<std::string> processing_;
  std::multimap<Clock::time_point, std::string> delayed_;
  std::map<std::string, int> failures_;
  bool shutting_down_ = false;
};

}  // namespace meshtrain::kube
