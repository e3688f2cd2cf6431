// What the planner's device probe (`meshtrain bench plan --measure`) makes of the steps it
// times: one rank's training step with every activation kept and with activation
// checkpointing, a few times each, become the step model's matrix rate and recompute
// factor (DeviceModel::matrix_flops_by_micro_batch, DeviceModel::recompute_factor).
//
// The probe shares the machine with whatever else runs there (in CI, builds and other
// tests on two cores), and three things keep that load out of its figures:
// - ProbeClock times a step as its wall time less the time the calling thread waited for
//   a CPU meanwhile, so time other processes held the cores does not count;
// - a figure is the median of its samples (MedianOf), so a burst that slows one step, or
//   a sample the clock got wrong, moves nothing;
// - the recompute factor, a difference of two close step times, has a floor
//   (kMinRecomputeFactor), so the noise left cannot make the recompute look free.
//
// Thread-safety: MedianOf and RecomputeFactor are pure; a ProbeClock measures the thread
// that made it and is read on that thread.

#pragma once

#include <chrono>
#include <cstdint>
#include <vector>

namespace meshtrain::scheduler {

// The calling thread's time waiting on a run queue for a CPU since it started, in
// nanoseconds (the second field of /proc/thread-self/schedstat); -1 where the kernel
// does not report it.
int64_t RunQueueWaitNanoseconds();

// Seconds since construction that the calling thread did not spend waiting for a CPU:
// its running time plus any time it blocked (on I/O, a lock or a sleep). On a machine
// the kernel does not report waits for, the wall time.
//
// With several OpenMP threads only the calling thread's waits come off: a worker thread
// kept from its CPU still delays the step, as the calling thread waits for it at the
// region's end.
class ProbeClock {
 public:
  ProbeClock();
  double Seconds() const;

 private:
  std::chrono::steady_clock::time_point start_;
  int64_t waited_ns_;  // RunQueueWaitNanoseconds() at construction
};

// The median of `samples`: the middle one, or the mean of the middle two of an even
// count. REQUIRES: `samples` is not empty.
double MedianOf(std::vector<double> samples);

// The least recompute factor the probe reports. A recomputed block forward is the block's
// forward run again, so its time over the forward's modelled FLOP time (at the step's
// average rate) is the step's average rate over the forward's: 0.96 to 1.44 in this
// project's CI runs on its 2-core machine. Under 0.5 the forward would run at more than
// twice the step's average rate, and the backward (twice the forward's FLOPs) at under
// 0.4 of the forward's rate, which no device the planner models does: a reading that low
// (or 0, when the two medians cross) is the clock's noise in the difference of two close
// step times, not the device.
inline constexpr double kMinRecomputeFactor = 0.5;

// The recompute factor from the step with every activation kept (`keep_seconds`) and the
// step with activation checkpointing (`checkpointing_seconds`), medians of the probe's
// samples, where the step model gives `forward_seconds` to the forward of all the blocks
// checkpointing recomputes: their difference over `forward_seconds`, at least
// kMinRecomputeFactor. REQUIRES: forward_seconds > 0.
double RecomputeFactor(double keep_seconds, double checkpointing_seconds, double forward_seconds);

}  // namespace meshtrain::scheduler
