#include "operator/kube/work_queue.h"

#include <algorithm>
#include <cmath>

namespace meshtrain::kube {

WorkQueue::WorkQueue(WorkQueueOptions options) : options_(options), bucket_(options.qps, options.burst) {}

void WorkQueue::AddLocked(const std::string& key) {
  if (shutting_down_ || dirty_.count(key)) return;
  dirty_.insert(key);
  if (processing_.count(key)) return;  // Done() queues it again
  queue_.push_back(key);
  ready_since_[key] = Clock::now();
  cv_.notify_one();
}

void WorkQueue::Add(const std::string& key) {
  std::lock_guard lock(mu_);
  AddLocked(key);
}

void WorkQueue::AddAfter(const std::string& key, Clock::duration delay) {
  std::lock_guard lock(mu_);
  if (shutting_down_) return;
  if (delay <= Clock::duration::zero()) return AddLocked(key);
  const auto due = Clock::now() + delay;
  // One pending delay per key is enough: keep the earliest.
  for (auto it = delayed_.begin(); it != delayed_.end(); ++it) {
    if (it->second != key) continue;
    if (it->first <= due) return;
    delayed_.erase(it);
    break;
  }
  delayed_.emplace(due, key);
  cv_.notify_all();
}

void WorkQueue::AddRateLimited(const std::string& key) {
  Clock::duration item_delay;
  {
    std::lock_guard lock(mu_);
    const int failures = failures_[key]++;
    const double ms = static_cast<double>(options_.base_delay.count()) * std::pow(2.0, std::min(failures, 40));
    item_delay = std::chrono::milliseconds(static_cast<int64_t>(std::min(ms, double(options_.max_delay.count()))));
  }
  AddAfter(key, std::max(item_delay, bucket_.Reserve()));
}

void WorkQueue::Forget(const std::string& key) {
  std::lock_guard lock(mu_);
  failures_.erase(key);
}

int WorkQueue::NumRequeues(const std::string& key) const {
  std::lock_guard lock(mu_);
  auto it = failures_.find(key);
  return it == failures_.end() ? 0 : it->second;
}

void WorkQueue::PromoteDueLocked(Clock::time_point now) {
  while (!delayed_.empty() && delayed_.begin()->first <= now) {
    std::string key = delayed_.begin()->second;
    delayed_.erase(delayed_.begin());
    AddLocked(key);
  }
}

std::optional<std::string> WorkQueue::Get(Clock::duration* waited) {
  std::unique_lock lock(mu_);
  for (;;) {
    PromoteDueLocked(Clock::now());
    if (!queue_.empty()) break;
    if (shutting_down_) return std::nullopt;
    if (delayed_.empty()) {
      cv_.wait(lock);
    } else {
      cv_.wait_until(lock, delayed_.begin()->first);
    }
  }
  std::string key = std::move(queue_.front());
  queue_.pop_front();
  if (auto it = ready_since_.find(key); it != ready_since_.end()) {
    if (waited) *waited = Clock::now() - it->second;
    ready_since_.erase(it);
  }
  processing_.insert(key);
  dirty_.erase(key);
  return key;
}

void WorkQueue::Done(const std::string& key) {
  std::lock_guard lock(mu_);
  processing_.erase(key);
  if (dirty_.count(key)) {
    queue_.push_back(key);
    ready_since_[key] = Clock::now();
    cv_.notify_one();
  }
}

size_t WorkQueue::Len() const {
  std::lock_guard lock(mu_);
  return queue_.size();
}

void WorkQueue::ShutDown() {
  std::lock_guard lock(mu_);
  shutting_down_ = true;
  delayed_.clear();
  cv_.notify_all();
}

}  // namespace meshtrain::kube
