#include "operator/scheduler/device_probe.h"

#include <algorithm>
#include <cassert>
#include <fstream>

namespace meshtrain::scheduler {

int64_t RunQueueWaitNanoseconds() {
  // "<ns on a CPU> <ns waiting on a run queue> <timeslices>"
  std::ifstream schedstat("/proc/thread-self/schedstat");
  int64_t running = 0, waiting = -1;
  if (!(schedstat >> running >> waiting)) return -1;
  return waiting;
}

ProbeClock::ProbeClock() : start_(std::chrono::steady_clock::now()), waited_ns_(RunQueueWaitNanoseconds()) {}

double ProbeClock::Seconds() const {
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  if (waited_ns_ < 0) return wall;
  const int64_t waited = RunQueueWaitNanoseconds();
  if (waited < waited_ns_) return wall;
  // The run queue's clock is the scheduler's, not steady_clock: never less than nothing.
  return std::max(0.0, wall - double(waited - waited_ns_) * 1e-9);
}

double MedianOf(std::vector<double> samples) {
  assert(!samples.empty());
  const size_t middle = samples.size() / 2;
  std::nth_element(samples.begin(), samples.begin() + middle, samples.end());
  if (samples.size() % 2 == 1) return samples[middle];
  const double upper = samples[middle];
  const double lower = *std::max_element(samples.begin(), samples.begin() + middle);
  return (lower + upper) / 2;
}

double RecomputeFactor(double keep_seconds, double checkpointing_seconds, double forward_seconds) {
  assert(forward_seconds > 0);
  return std::max(kMinRecomputeFactor, (checkpointing_seconds - keep_seconds) / forward_seconds);
}

}  // namespace meshtrain::scheduler
