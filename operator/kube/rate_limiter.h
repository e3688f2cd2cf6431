// A token bucket: `qps` tokens a second, holding at most `burst`.
//
// Thread-safe. Used for the client's request limit and the work queue's global limit.

#pragma once

#include <chrono>
#include <mutex>

namespace meshtrain::kube {

class TokenBucket {
 public:
  using Clock = std::chrono::steady_clock;

  // qps <= 0 means unlimited.
  TokenBucket(double qps, int burst);

  // Takes a token now and returns how long the caller must wait before using it
  // (zero when one was available). Reservations queue in order.
  Clock::duration Reserve();

  // Reserve(), then sleep for the wait.
  void Wait();

 private:
  const double qps_;
  const double burst_;
  std::mutex mu_;
  double tokens_;          // may go negative: reserved ahead
  Clock::time_point last_;
};

}  // namespace meshtrain::kube
