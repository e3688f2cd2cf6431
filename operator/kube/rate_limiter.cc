#include "operator/kube/rate_limiter.h"

#include <algorithm>
#include <thread>

namespace meshtrain::kube {

TokenBucket::TokenBucket(double qps, int burst)
    : qps_(qps), burst_(std::max(1, burst)), tokens_(std::max(1, burst)), last_(Clock::now()) {}

TokenBucket::Clock::duration TokenBucket::Reserve() {
  if (qps_ <= 0) return Clock::duration::zero();
  std::lock_guard lock(mu_);
  const auto now = Clock::now();
  tokens_ = std::min(burst_, tokens_ + std::chrono::duration<double>(now - last_).count() * qps_);
  last_ = now;
  tokens_ -= 1;
  if (tokens_ >= 0) return Clock::duration::zero();
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(-tokens_ / qps_));
}

void TokenBucket::Wait() {
  const auto wait = Reserve();
  if (wait > Clock::duration::zero()) std::this_thread::sleep_for(wait);
}

}  // namespace meshtrain::kube
