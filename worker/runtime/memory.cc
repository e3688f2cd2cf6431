#include "worker/runtime/memory.h"

#include <cstdio>
#include <cstdlib>
#include <new>
#include <stdexcept>
#include <string>

#include "common/allocator_blocks.h"

namespace meshtrain::runtime {

const char* MemoryCategoryName(MemoryCategory category) {
  static constexpr const char* kNames[kMemoryCategories] = {"params", "grads", "optimizer", "activations",
                                                            "comm",   "offload", "gathered"};
  return kNames[size_t(category)];
}

namespace {
void RaiseTo(std::atomic<int64_t>& peak, int64_t value) {
  int64_t seen = peak.load();
  while (value > seen && !peak.compare_exchange_weak(seen, value)) {
  }
}
}  // namespace

void MemoryAccounting::Allocated(MemoryCategory category, int64_t bytes) {
  const size_t c = size_t(category);
  RaiseTo(peak_[c], current_[c].fetch_add(bytes) + bytes);
  RaiseTo(peak_total_, total_.fetch_add(bytes) + bytes);
}

void MemoryAccounting::Freed(MemoryCategory category, int64_t bytes) {
  current_[size_t(category)].fetch_sub(bytes);
  total_.fetch_sub(bytes);
}

MemorySource HostMemory() {
  return {"host", [](size_t bytes) { return std::aligned_alloc(64, bytes); }, [](void* ptr) { std::free(ptr); }};
}

size_t CachingAllocator::RoundedSize(size_t bytes) { return common::AllocatorBlockBytes(bytes); }

void* CachingAllocator::Allocate(size_t bytes, MemoryCategory category) {
  const size_t rounded = RoundedSize(bytes);
  void* ptr = nullptr;
  std::unique_lock lock(mutex_);
  auto it = cached_.find(rounded);
  if (it != cached_.end() && !it->second.empty()) {
    ptr = it->second.back();
    it->second.pop_back();
    cached_bytes_ -= rounded;
  } else {
    if (limit_ > 0 && int64_t(live_bytes_ + cached_bytes_ + rounded) > limit_) {
      for (auto& [size, blocks] : cached_) {
        for (void* p : blocks) source_.free(p);
      }
      cached_.clear();
      cached_bytes_ = 0;
    }
    if (limit_ > 0 && int64_t(live_bytes_ + rounded) > limit_) {
      throw OutOfMemory(std::string("out of ") + source_.name + " memory: " + FormatBytes(rounded) + " for " +
                        MemoryCategoryName(category) + " would pass the limit of " + FormatBytes(size_t(limit_)) +
                        ", with " + FormatBytes(live_bytes_) + " in use");
    }
    ptr = source_.allocate(rounded);
    if (ptr == nullptr) {
      throw OutOfMemory(std::string("out of ") + source_.name + " memory: " + FormatBytes(rounded) + " for " +
                        MemoryCategoryName(category) + ", with " + FormatBytes(live_bytes_) + " in use");
    }
  }
  live_[ptr] = {rounded, category};
  live_bytes_ += rounded;
  lock.unlock();
  accounting_->Allocated(category, int64_t(rounded));
  return ptr;
}

void CachingAllocator::Free(void* ptr) {
  if (ptr == nullptr) return;
  Live live;
  {
    std::lock_guard lock(mutex_);
    auto it = live_.find(ptr);
    if (it == live_.end()) throw std::invalid_argument("CachingAllocator::Free: pointer not allocated here");
    live = it->second;
    live_.erase(it);
    live_bytes_ -= live.bytes;
    cached_[live.bytes].push_back(ptr);
    cached_bytes_ += live.bytes;
  }
  accounting_->Freed(live.category, int64_t(live.bytes));
}

void CachingAllocator::ReleaseCached() {
  std::lock_guard lock(mutex_);
  for (auto& [bytes, blocks] : cached_) {
    for (void* p : blocks) source_.free(p);
  }
  cached_.clear();
  cached_bytes_ = 0;
}

size_t CachingAllocator::cached_bytes() const {
  std::lock_guard lock(mutex_);
  return cached_bytes_;
}

int64_t MemoryLimitFromEnvironment() {
  const char* value = std::getenv("MESHTRAIN_MEMORY_LIMIT_MIB");
  if (value == nullptr || *value == 0) return 0;
  char* end = nullptr;
  const long long mib = std::strtoll(value, &end, 10);
  if (*end != 0 || mib < 0 || mib > (1ll << 30)) {
    throw std::invalid_argument(std::string("MESHTRAIN_MEMORY_LIMIT_MIB: '") + value +
                                "' is not a whole number of MiB");
  }
  return int64_t(mib) << 20;
}

std::string FormatMiB(int64_t bytes) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f MiB", double(bytes) / (1 << 20));
  return text;
}

std::string FormatBytes(size_t bytes) {
  char text[32];
  if (bytes < 1024) {
    std::snprintf(text, sizeof(text), "%zu B", bytes);
  } else if (bytes < (size_t{1} << 20)) {
    std::snprintf(text, sizeof(text), "%.1f KiB", double(bytes) / 1024.0);
  } else if (bytes < (size_t{1} << 30)) {
    std::snprintf(text, sizeof(text), "%.1f MiB", double(bytes) / 1048576.0);
  } else {
    std::snprintf(text, sizeof(text), "%.2f GiB", double(bytes) / 1073741824.0);
  }
  return text;
}

CachingAllocator::~CachingAllocator() {
  ReleaseCached();
  for (auto& [ptr, live] : live_) {  // a leak by the caller; do not leak it further
    accounting_->Freed(live.category, int64_t(live.bytes));
    source_.free(ptr);
  }
}

}  // namespace meshtrain::runtime
