#include "worker/runtime/stream.h"

namespace meshtrain::runtime {

Event::Event() : state_(std::make_shared<State>()) {}

void Event::Record(Stream& stream) {
  uint64_t generation;
  {
    std::lock_guard lock(state_->mutex);
    generation = ++state_->recorded;
  }
  stream.Push({nullptr, [state = state_, generation](std::exception_ptr failure) {
                  std::lock_guard lock(state->mutex);
                  state->completed = std::max(state->completed, generation);
                  state->error = failure;
                  state->reached.notify_all();
                }});
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

void Stream::Enqueue(std::function<void()> task) { Push({std::move(task), nullptr}); }

void Stream::Push(Task task) {
  {
    std::lock_guard lock(mutex_);
    queue_.push_back(std::move(task));
    ++enqueued_;
  }
  changed_.notify_all();
}

void Stream::Wait(const Event& event, double* waited_seconds) {
  std::shared_ptr<Event::State> state = event.state_;
  uint64_t target;
  {
    std::lock_guard lock(state->mutex);
    target = state->recorded;
  }
  Enqueue([state, target, waited_seconds] {
    const auto start = std::chrono::steady_clock::now();
    std::unique_lock lock(state->mutex);
    state->reached.wait(lock, [&] { return state->completed >= target; });
    if (waited_seconds != nullptr) {
      *waited_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    }
    if (state->error) std::rethrow_exception(state->error);
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
    Task task = std::move(queue_.front());
    queue_.pop_front();
    const std::exception_ptr failed = error_;
    lock.unlock();
    std::exception_ptr failure;
    if (task.mark) {
      task.mark(failed);
    } else if (!failed) {
      try {
        task.run();
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
