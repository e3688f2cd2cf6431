#include "worker/comm/work.h"

namespace meshtrain::comm {

void HostWork::Complete(std::string error) {
  {
    std::lock_guard lock(mutex_);
    done_ = true;
    error_ = std::move(error);
  }
  done_changed_.notify_all();
}

void HostWork::Wait(milliseconds timeout) {
  std::unique_lock lock(mutex_);
  if (!done_changed_.wait_for(lock, timeout, [&] { return done_; })) {
    throw CommError(what_ + ": not finished after " + std::to_string(timeout.count()) +
                    " ms of waiting");
  }
  if (!error_.empty()) throw CommError(error_);
}

bool HostWork::IsCompleted() {
  std::lock_guard lock(mutex_);
  return done_;
}

}  // namespace meshtrain::comm
