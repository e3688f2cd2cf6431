// Streams, events and timers: the contract every device backend keeps (docs/design.md, "The
// device seam").
//
// A Stream is an ordered queue of device work: work enqueued on one stream runs in order,
// work on different streams may run concurrently. An Event marks a point in a stream:
// Record() captures "everything enqueued so far", Stream::Wait() makes later work on
// another stream wait for that point (cudaStreamWaitEvent), and Synchronize() blocks the
// host until it is reached or a timeout passes. The engine schedules compute,
// communication and copies on separate streams with these alone, on either device.
//
// Errors are sticky, as in CUDA: once work on a stream fails, Synchronize() throws that
// failure. On the CPU an event recorded on a failed stream is still reached and carries
// the failure to the streams that wait on it, so nothing ordered after a failed
// collective runs, and nothing hangs.
//
// A StreamTimer measures intervals of a stream's timeline: Begin and End are enqueued like
// work, and Seconds() adds up the intervals that have completed. Around a Wait it gives
// the time the stream stood still (exposed communication); around a copy, the copy.
//
// Implementations: cpu_stream.h (a task queue on a thread) and the CUDA plugin
// (cudaStream_t, cudaEvent_t). Thread-safety: all methods may be called from any thread.

#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>

namespace meshtrain::runtime {

using std::chrono::milliseconds;

// A bound long enough never to end a healthy step, for callers that have none of their own.
inline constexpr milliseconds kNoTimeout = std::chrono::hours(24);

// What Synchronize throws when the work did not finish in time; what() names the stream.
class StreamTimeout : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class Stream;

class Event {
 public:
  virtual ~Event() = default;
  // Marks the current end of `stream`'s queue. Re-recording moves the mark.
  virtual void Record(Stream& stream) = 0;
  // True once the last recorded point has been reached (or if never recorded).
  virtual bool Query() = 0;
  // Blocks until the last recorded point is reached, or `timeout` passes; true if reached.
  virtual bool Synchronize(milliseconds timeout) = 0;
};

class Stream {
 public:
  virtual ~Stream() = default;  // lets what is queued finish first
  virtual const std::string& name() const = 0;
  // Later work on this stream waits until `event`'s current mark is reached.
  virtual void Wait(Event& event) = 0;
  // Blocks until everything enqueued so far has run. Throws the stream's first failure,
  // or StreamTimeout naming the stream when `timeout` passes first.
  virtual void Synchronize(milliseconds timeout = kNoTimeout) = 0;
  // Runs `callback` on a host thread once the work enqueued before it has run. For
  // observers only: it must not enqueue work or touch device memory. A callback that
  // throws fails the stream, as failed work does.
  virtual void HostCallback(std::function<void()> callback) = 0;
};

class StreamTimer {
 public:
  virtual ~StreamTimer() = default;
  // Begin and End alternate, on one stream at a time.
  virtual void Begin(Stream& stream) = 0;
  virtual void End(Stream& stream) = 0;
  // The total of the intervals ended so far. REQUIRES: the streams they ran on have been
  // synchronized since the last End.
  virtual double Seconds() = 0;
};

}  // namespace meshtrain::runtime
