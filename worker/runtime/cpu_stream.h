// The CPU's streams, events and timers (stream.h): a stream is an ordered queue of tasks
// run by its own thread, an event a fence in that queue.
//
// Jitter (for tests): with a seed, the stream stalls before one task in `one_in`, chosen at
// random, for a random 0 to `max`, both drawn from its own generator, so work on different
// streams interleaves differently from run to run. An event the schedule forgot then
// shows as a wrong result or a failed check, not as a race that never fires. Rare long
// stalls rather than a short sleep before every task: those delay a long queue in
// proportion to its length and so keep the natural order of streams, and every sleep is a
// context switch. An offload copy with its wait removed went unseen in 6 runs of 6 with a
// 0-200 us sleep before every task, and was caught in 6 of 6 with these stalls, which took
// half the time.
// Thread-safety: all methods may be called from any thread.

#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "worker/runtime/stream.h"

namespace meshtrain::runtime {

struct CpuJitter {
  uint64_t seed = 0;  // 0: none
  std::chrono::microseconds max{800};
  uint64_t one_in = 8;
};

class CpuStream;

class CpuEvent final : public Event {
 public:
  CpuEvent();
  void Record(Stream& stream) override;
  bool Query() override;
  bool Synchronize(milliseconds timeout) override;

 private:
  friend class CpuStream;
  struct State {
    std::mutex mutex;
    std::condition_variable reached;
    uint64_t recorded = 0;      // generation of the last Record()
    uint64_t completed = 0;     // highest generation reached
    std::exception_ptr error;   // of the stream that reached it, if that stream had failed
  };
  std::shared_ptr<State> state_;
};

class CpuStream final : public Stream {
 public:
  explicit CpuStream(std::string name, CpuJitter jitter = {});
  ~CpuStream() override;  // runs what is queued, then stops the thread
  CpuStream(const CpuStream&) = delete;
  CpuStream& operator=(const CpuStream&) = delete;

  const std::string& name() const override { return name_; }
  void Wait(Event& event) override;
  void Synchronize(milliseconds timeout = kNoTimeout) override;
  void HostCallback(std::function<void()> callback) override { Enqueue(std::move(callback)); }

  // Runs `task` on this stream's thread after what is queued. A task that throws fails
  // the stream (the rest of its queue is skipped, and Synchronize rethrows).
  void Enqueue(std::function<void()> task);

  // The CpuStream behind `stream`; throws std::logic_error naming it when another
  // backend's stream is passed to CPU work.
  static CpuStream& Of(Stream& stream);

 private:
  friend class CpuEvent;
  // A task that runs even on a failed stream, given its failure (null if none).
  struct Task {
    std::function<void()> run;
    std::function<void(std::exception_ptr)> mark;
  };
  void Push(Task task);
  void Loop();

  std::string name_;
  CpuJitter jitter_;
  std::mt19937_64 random_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<Task> queue_;
  uint64_t enqueued_ = 0, finished_ = 0;
  std::exception_ptr error_;
  bool stopping_ = false;
  std::thread thread_;
};

// Intervals measured by the stream's own thread, between the tasks Begin and End enqueue.
class CpuStreamTimer final : public StreamTimer {
 public:
  void Begin(Stream& stream) override;
  void End(Stream& stream) override;
  double Seconds() override;

 private:
  std::mutex mutex_;
  std::chrono::steady_clock::time_point begun_;
  double seconds_ = 0;
};

}  // namespace meshtrain::runtime
