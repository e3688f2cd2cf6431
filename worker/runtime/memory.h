// Memory accounting by category, and a caching allocator (docs/design.md, "The device seam").
//
// Every engine allocation names its category. MemoryAccounting keeps the current and
// peak bytes of each; CachingAllocator keeps freed blocks by size class and hands them
// out again, so steady-state steps do not return to the system allocator (or to
// cudaMalloc, which synchronises the device). The same allocator serves host, device
// and pinned host memory through a MemorySource (worker/runtime/cuda.h has the CUDA ones).
// Thread-safety: both classes are safe to use from several threads.

#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <new>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace meshtrain::runtime {

// kGathered: the unsharded copies of FSDP units (parameters gathered for compute, and
// their gradients before the reduce-scatter), which exist only while a unit is in use.
enum class MemoryCategory { kParams, kGrads, kOptimizer, kActivations, kComm, kOffload, kGathered };
inline constexpr size_t kMemoryCategories = 7;
const char* MemoryCategoryName(MemoryCategory category);  // "params", "grads", ...

// Where a CachingAllocator's blocks come from. `allocate` returns nullptr when out of memory.
struct MemorySource {
  const char* name;  // "host", "cuda", "pinned host": for error messages
  void* (*allocate)(size_t bytes);
  void (*free)(void* ptr);
};
// 64-byte aligned blocks of the system heap.
MemorySource HostMemory();

// What Allocate throws when the source has no memory left; what() names the source,
// the size and the category.
class OutOfMemory : public std::bad_alloc {
 public:
  explicit OutOfMemory(std::string message) : message_(std::move(message)) {}
  const char* what() const noexcept override { return message_.c_str(); }

 private:
  std::string message_;
};

class MemoryAccounting {
 public:
  void Allocated(MemoryCategory category, int64_t bytes);
  void Freed(MemoryCategory category, int64_t bytes);
  int64_t current(MemoryCategory category) const { return current_[size_t(category)].load(); }
  int64_t peak(MemoryCategory category) const { return peak_[size_t(category)].load(); }
  int64_t current_total() const { return total_.load(); }
  int64_t peak_total() const { return peak_total_.load(); }

 private:
  std::array<std::atomic<int64_t>, kMemoryCategories> current_{}, peak_{};
  std::atomic<int64_t> total_{0}, peak_total_{0};
};

// Blocks from `source`. Sizes are rounded up to 512 bytes below 1 MiB and to 2 MiB
// above, and freed blocks are reused for requests of the same rounded size.
//
// With a limit, the blocks held (in use and cached) never exceed it: a request that
// would pass it first returns the cache to the source, and if it still does not fit,
// throws OutOfMemory naming the category, the request, what is in use and the limit.
class CachingAllocator {
 public:
  explicit CachingAllocator(MemoryAccounting* accounting, MemorySource source = HostMemory(), int64_t limit = 0)
      : accounting_(accounting), source_(source), limit_(limit) {}
  ~CachingAllocator();
  CachingAllocator(const CachingAllocator&) = delete;
  CachingAllocator& operator=(const CachingAllocator&) = delete;

  // Throws OutOfMemory when the source has no memory left.
  void* Allocate(size_t bytes, MemoryCategory category);
  // REQUIRES: `ptr` came from Allocate on this allocator and was not freed.
  void Free(void* ptr);
  // Returns every cached block to the system.
  void ReleaseCached();
  size_t cached_bytes() const;

  // common::AllocatorBlockBytes: the size classes the planner's memory model counts too.
  static size_t RoundedSize(size_t bytes);
  int64_t limit() const { return limit_; }

 private:
  struct Live {
    size_t bytes;
    MemoryCategory category;
  };
  MemoryAccounting* accounting_;
  MemorySource source_;
  int64_t limit_;  // bytes; 0: none
  mutable std::mutex mutex_;
  std::unordered_map<void*, Live> live_;
  std::map<size_t, std::vector<void*>> cached_;
  size_t cached_bytes_ = 0;
  size_t live_bytes_ = 0;
};

// The per-rank memory limit tests and small machines set with MESHTRAIN_MEMORY_LIMIT_MIB:
// bytes, or 0 when unset. Throws std::invalid_argument naming a malformed value.
int64_t MemoryLimitFromEnvironment();

// "1.5 MiB" whatever the size: the unit of the memory lines scripts read.
std::string FormatMiB(int64_t bytes);
// "12 B", "4.0 KiB", "1.5 MiB", "2.00 GiB": sizes in messages and benchmark output.
std::string FormatBytes(size_t bytes);

// An array of n T from a host CachingAllocator, zero-filled, returned to it on destruction.
// Move-only. Not thread-safe.
template <class T>
class Buffer {
 public:
  Buffer() = default;
  Buffer(CachingAllocator* allocator, size_t n, MemoryCategory category)
      : allocator_(allocator), size_(n), data_(static_cast<T*>(allocator->Allocate(n * sizeof(T), category))) {
    std::fill(data_, data_ + n, T(0));
  }
  Buffer(Buffer&& other) noexcept { *this = std::move(other); }
  Buffer& operator=(Buffer&& other) noexcept {
    std::swap(allocator_, other.allocator_);
    std::swap(size_, other.size_);
    std::swap(data_, other.data_);
    return *this;
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() {
    if (data_ != nullptr) allocator_->Free(data_);
  }

  T* data() { return data_; }
  const T* data() const { return data_; }
  size_t size() const { return size_; }
  T& operator[](size_t i) { return data_[i]; }
  const T& operator[](size_t i) const { return data_[i]; }
  T* begin() { return data_; }
  T* end() { return data_ + size_; }
  const T* begin() const { return data_; }
  const T* end() const { return data_ + size_; }

 private:
  CachingAllocator* allocator_ = nullptr;
  size_t size_ = 0;
  T* data_ = nullptr;
};

}  // namespace meshtrain::runtime
