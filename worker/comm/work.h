// A Work completed by a host thread (the fabric backend's communicator thread).
//
// Thread-safety: Complete() from one thread, Wait()/IsCompleted() from any.

#pragma once

#include <condition_variable>
#include <mutex>
#include <string>

#include "worker/comm/communicator.h"

namespace meshtrain::comm {

class HostWork : public Work {
 public:
  // `what` names the operation and group for a Wait() that times out.
  explicit HostWork(std::string what) : what_(std::move(what)) {}

  // Marks the operation finished; a non-empty `error` makes Wait() throw it.
  void Complete(std::string error = {});

  void Wait(milliseconds timeout = kDefaultTimeout) override;
  bool IsCompleted() override;

 private:
  std::string what_;
  std::mutex mutex_;
  std::condition_variable done_changed_;
  bool done_ = false;
  std::string error_;
};

}  // namespace meshtrain::comm
