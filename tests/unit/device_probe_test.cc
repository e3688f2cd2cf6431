// The planner's device probe (operator/scheduler/device_probe.h): its figures are medians,
// its recompute factor has a floor, and its clock leaves out the time other threads held
// the CPU.

#include "operator/scheduler/device_probe.h"

#include <pthread.h>
#include <sched.h>
#include <time.h>

#include <atomic>
#include <chrono>
#include <numeric>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

namespace meshtrain::scheduler {
namespace {

TEST(DeviceProbe, MedianIgnoresABurstAndAZero) {
  // Five steps of about 0.1 s: one slowed 50x by a burst of load, one the clock got as 0.
  EXPECT_EQ(MedianOf({0.101, 5.0, 0.0, 0.099, 0.1}), 0.1);
  EXPECT_EQ(MedianOf({0.3}), 0.3);
  EXPECT_EQ(MedianOf({4.0, 1.0, 3.0, 2.0}), 2.5);  // an even count: the middle two's mean
  EXPECT_EQ(MedianOf({2.0, 2.0, 9.0, 2.0}), 2.0);
}

TEST(DeviceProbe, RecomputeFactorIsTheStepsDifferenceOverTheForward) {
  // Checkpointing adds 0.3 s to a 1 s step whose blocks' forwards are modelled at 0.25 s.
  EXPECT_DOUBLE_EQ(RecomputeFactor(1.0, 1.3, 0.25), 1.2);
  EXPECT_DOUBLE_EQ(RecomputeFactor(2.0, 3.0, 0.5), 2.0);
}

TEST(DeviceProbe, RecomputeFactorNeverFallsUnderItsFloor) {
  ASSERT_GT(kMinRecomputeFactor, 0);
  // The medians crossed (noise), met, or differ by less than the floor's share of the forward.
  EXPECT_EQ(RecomputeFactor(1.0, 0.9, 0.25), kMinRecomputeFactor);
  EXPECT_EQ(RecomputeFactor(1.0, 1.0, 0.25), kMinRecomputeFactor);
  EXPECT_EQ(RecomputeFactor(1.0, 1.0 + 0.25 * kMinRecomputeFactor / 2, 0.25), kMinRecomputeFactor);
  EXPECT_GT(RecomputeFactor(1.0, 1.0 + 0.25 * kMinRecomputeFactor * 1.5, 0.25), kMinRecomputeFactor);
}

TEST(DeviceProbe, SamplesWithAnOutlierAndAZeroGiveTheirMediansFactor) {
  // Interleaved steps as the probe takes them; a burst slowed the third of each, and one
  // checkpointing sample read 0.
  const double keep = MedianOf({1.00, 1.02, 7.5, 0.98, 1.01});
  const double checkpointing = MedianOf({1.26, 0.0, 9.1, 1.24, 1.25});
  EXPECT_EQ(keep, 1.01);
  EXPECT_EQ(checkpointing, 1.25);
  EXPECT_NEAR(RecomputeFactor(keep, checkpointing, 0.25), 0.96, 1e-12);
  // With the burst on the steps that keep everything and the zeros on the checkpointing
  // ones, the means would make the recompute cost less than nothing; the medians still
  // see it.
  const std::vector<double> keep_burst = {1.00, 7.5, 9.1, 0.98, 1.01};
  const std::vector<double> checkpointing_zero = {1.26, 0.0, 0.0, 1.24, 1.25};
  auto mean = [](const std::vector<double>& v) { return std::accumulate(v.begin(), v.end(), 0.0) / double(v.size()); };
  ASSERT_LT(mean(checkpointing_zero), mean(keep_burst));
  EXPECT_NEAR(RecomputeFactor(MedianOf(keep_burst), MedianOf(checkpointing_zero), 0.25), (1.24 - 1.01) / 0.25, 1e-12);
}

double ThreadCpuSeconds() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return double(t.tv_sec) + double(t.tv_nsec) * 1e-9;
}

TEST(DeviceProbe, ClockLeavesOutTimeAnotherThreadHeldTheCpu) {
  if (RunQueueWaitNanoseconds() < 0) GTEST_SKIP() << "no run-queue waits reported (/proc/thread-self/schedstat)";
  // This thread and a spinning one share one CPU, so this thread runs about half the time.
  cpu_set_t all;
  ASSERT_EQ(pthread_getaffinity_np(pthread_self(), sizeof all, &all), 0);
  int cpu = 0;
  while (!CPU_ISSET(cpu, &all)) ++cpu;
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(cpu, &one);
  ASSERT_EQ(pthread_setaffinity_np(pthread_self(), sizeof one, &one), 0);
  std::atomic<bool> stop{false};
  std::thread spinner([&] {  // inherits the one CPU
    while (!stop.load(std::memory_order_relaxed)) {
    }
  });
  const auto wall_start = std::chrono::steady_clock::now();
  const ProbeClock clock;
  const double cpu_start = ThreadCpuSeconds();
  volatile double sink = 0;
  while (ThreadCpuSeconds() - cpu_start < 0.2) {
    for (int i = 0; i < 10000; ++i) sink = sink + 1;
  }
  const double on_cpu = ThreadCpuSeconds() - cpu_start;
  const double probed = clock.Seconds();
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - wall_start).count();
  stop = true;
  spinner.join();
  ASSERT_EQ(pthread_setaffinity_np(pthread_self(), sizeof all, &all), 0);
  // The wall clock counts the spinner's turns; the probe's clock only this thread's.
  EXPECT_GT(wall, 1.5 * on_cpu) << "the spinner did not share the CPU";
  EXPECT_NEAR(probed, on_cpu, 0.2 * on_cpu) << "wall " << wall;
}

}  // namespace
}  // namespace meshtrain::scheduler
