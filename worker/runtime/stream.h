// Streams and events with CUDA semantics, on the CPU.
//
// A Stream is an ordered queue of tasks run by its own thread: work enqueued on one
// stream runs in order, work on different streams runs concurrently. An Event marks a
// point in a stream: Record() captures "everything enqueued so far", Stream::Wait()
// makes later work on another stream wait for that point (cudaStreamWaitEvent), and
// Synchronize() blocks the caller until it is reached. The engine schedules compute,
// communication and copies on separate streams with these, on either device.
//
// Errors are sticky, as in CUDA: once a task throws, the stream skips the rest of its
// queue and Synchronize() rethrows the first failure. Events recorded on a failed
// stream are still reached, carrying the failure, and a stream that waits on one fails
// with it: one failed collective fails every stream ordered after it, and nothing hangs.
// Thread-safety: all methods may be called from any thread.

#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

namespace meshtrain::runtime {

class Stream;

class Event {
 public:
  Event();

  // Marks the current end of `stream`'s queue. Re-recording moves the mark.
  void Record(Stream& stream);
  // True once the last recorded point has been reached (or if never recorded).
  bool Query() const;
  // Blocks until the last recorded point is reached, or `timeout` passes; true if reached.
  bool Synchronize(std::chrono::milliseconds timeout = std::chrono::hours(24)) const;

 private:
  friend class Stream;
  struct State {
    std::mutex mutex;
    std::condition_variable reached;
    uint64_t recorded = 0;  // generation of the last Record()
    uint64_t completed = 0;  // highest generation reached
    std::exception_ptr error;  // of the stream that reached it, if that stream had failed
  };
  std::shared_ptr<State> state_;
};

class Stream {
 public:
  explicit Stream(std::string name);
  // Runs what is queued, then stops the thread.
  ~Stream();
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  const std::string& name() const { return name_; }

  void Enqueue(std::function<void()> task);
  // Later work on this stream waits until `event`'s current mark is reached. With
  // `waited_seconds`, the stream's thread adds the time it spent blocked there (read it
  // after a Synchronize).
  void Wait(const Event& event, double* waited_seconds = nullptr);
  // Blocks until everything enqueued so far has run; rethrows a task's failure.
  void Synchronize();

 private:
  friend class Event;
  // A task that runs even on a failed stream, given its failure (null if none).
  struct Task {
    std::function<void()> run;
    std::function<void(std::exception_ptr)> mark;
  };
  void Push(Task task);
  void Loop();

  std::string name_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<Task> queue_;
  uint64_t enqueued_ = 0, finished_ = 0;
  std::exception_ptr error_;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace meshtrain::runtime
