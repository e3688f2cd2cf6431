#include "worker/runtime/cpu_stream.h"

#include <algorithm>

namespace meshtrain::runtime {

CpuEvent::CpuEvent() : state_(std::make_shared<State>()) {}

void CpuEvent::Record(Stream& stream) {
  uint64_t generation;
  {
    std::lock_guard lock(state_->mutex);
    generation = ++state_->recorded;
  }
  CpuStream::Of(stream).Push({nullptr, [state = state_, generation](std::exception_ptr failure) {
                                std::lock_guard lock(state->mutex);
                                state->completed = std::max(state->completed, generation);
                                state->error = failure;
                                state->reached.notify_all();
                              }});
}

bool CpuEvent::Query() {
  std::lock_guard lock(state_->mutex);
  return state_->completed >= state_->recorded;
}

bool CpuEvent::Synchronize(milliseconds timeout) {
  std::unique_lock lock(state_->mutex);
  const uint64_t target = state_->recorded;
  return state_->reached.wait_for(lock, timeout, [&] { return state_->completed >= target; });
}

CpuStream::CpuStream(std::string name, CpuJitter jitter)
    : name_(std::move(name)), jitter_(jitter), random_(jitter.seed), thread_([this] { Loop(); }) {}

CpuStream::~CpuStream() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  changed_.notify_all();
  thread_.join();
}

CpuStream& CpuStream::Of(Stream& stream) {
  auto* cpu = dynamic_cast<CpuStream*>(&stream);
  if (cpu == nullptr) throw std::logic_error("stream " + stream.name() + " is not a CPU stream, but CPU work was put on it");
  return *cpu;
}

void CpuStream::Enqueue(std::function<void()> task) { Push({std::move(task), nullptr}); }

void CpuStream::Push(Task task) {
  {
    std::lock_guard lock(mutex_);
    queue_.push_back(std::move(task));
    ++enqueued_;
  }
  changed_.notify_all();
}

void CpuStream::Wait(Event& event) {
  auto* cpu = dynamic_cast<CpuEvent*>(&event);
  if (cpu == nullptr) throw std::logic_error("stream " + name_ + " can only wait on CPU events");
  std::shared_ptr<CpuEvent::State> state = cpu->state_;
  uint64_t target;
  {
    std::lock_guard lock(state->mutex);
    target = state->recorded;
  }
  Enqueue([state, target] {
    std::unique_lock lock(state->mutex);
    state->reached.wait(lock, [&] { return state->completed >= target; });
    if (state->error) std::rethrow_exception(state->error);
  });
}

void CpuStream::Synchronize(milliseconds timeout) {
  std::unique_lock lock(mutex_);
  const uint64_t target = enqueued_;
  if (!changed_.wait_for(lock, timeout, [&] { return finished_ >= target; })) {
    throw StreamTimeout("stream " + name_ + ": its work did not finish within " + std::to_string(timeout.count()) +
                        " ms");
  }
  if (error_) std::rethrow_exception(error_);
}

void CpuStream::Loop() {
  std::unique_lock lock(mutex_);
  for (;;) {
    changed_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopping, and drained
    Task task = std::move(queue_.front());
    queue_.pop_front();
    const std::exception_ptr failed = error_;
    lock.unlock();
    if (jitter_.seed != 0 && random_() % jitter_.one_in == 0) {
      std::this_thread::sleep_for(std::chrono::microseconds(random_() % uint64_t(jitter_.max.count() + 1)));
    }
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

void CpuStreamTimer::Begin(Stream& stream) {
  CpuStream::Of(stream).Enqueue([this] {
    std::lock_guard lock(mutex_);
    begun_ = std::chrono::steady_clock::now();
  });
}

void CpuStreamTimer::End(Stream& stream) {
  CpuStream::Of(stream).Enqueue([this] {
    std::lock_guard lock(mutex_);
    seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - begun_).count();
  });
}

double CpuStreamTimer::Seconds() {
  std::lock_guard lock(mutex_);
  return seconds_;
}

}  // namespace meshtrain::runtime
