#include "worker/runtime/stream.h"

namespace meshtrain::runtime {

Event::Event() : state_(std::make_shared<State>()) {}

void Event::Record(Stream& stream) {
  uint64_t generation;
  {
    std::lock_guard lock(state_->mutex);
    generation = ++state_->recorded;
  }
  stream.Enqueue([state = state_, generation] {
    std::lock_guard lock(state->mutex);
    state->completed = std::max(state->completed, generation);
    state->reached.notify_all();
  });
}

bool Event::Query() const {
  std::lock_guard lock(state_->mutex);
  return state_->completed >= state_->recorded;
}

bool Event::Synchronize(std::chrono::milliseconds timeout) const {
  std::unique_lock lock(state_->mutex);
  const uint64_t target = state_->recorded;
  return state_->reached.wait_for(lock, timeout, [&] { return state_->completed >= target; });
}

Stream::Stream(std::string name) : name_(std::move(name)), thread_([this] { Loop(); }) {}

Stream::~Stream() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  changed_.notify_all();
  thread_.join();
}

void Stream::Enqueue(std::function<void()> task) {
  {
    std::lock_guard lock(mutex_);
    queue_.push_back(std::move(task));
    ++enqueued_;
  }
  changed_.notify_all();
}

void Stream::Wait(const Event& event) {
  std::shared_ptr<Event::State> state = event.state_;
  uint64_t target;
  {
    std::lock_guard lock(state->mutex);
    target = state->recorded;
  }
  Enqueue([state, target] {
    std::unique_lock lock(state->mutex);
    state->reached.wait(lock, [&] { return state->completed >= target; });
  });
}

void Stream::Synchronize() {
  std::unique_lock lock(mutex_);
  const uint64_t target = enqueued_;
  changed_.wait(lock, [&] { return finished_ >= target; });
  if (error_) std::rethrow_exception(error_);
}

void Stream::Loop() {
  std::unique_lock lock(mutex_);
  for (;;) {
    changed_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopping, and drained
    std::function<void()> task = std::move(queue_.front());
    queue_.pop_front();
    const bool skip = error_ != nullptr;
    lock.unlock();
    std::exception_ptr failure;
    if (!skip) {
      try {
        task();
      } catch (...) {
        failure = std::current_exception();
      }
    }
    lock.lock();
    if (failure && !error_) error_ = failure;
    ++finished_;
    changed_.notify_all();
  }
}

}  // namespace meshtrain::runtime
