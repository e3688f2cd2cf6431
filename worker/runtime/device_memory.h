// Device arrays: n elements of T in a backend's device memory, taken from a
// CachingAllocator (and counted in its category) and returned on destruction.
// Move-only. Not thread-safe.

#pragma once

#include <cstddef>
#include <utility>

#include "worker/runtime/device_ptr.h"
#include "worker/runtime/memory.h"

namespace meshtrain::runtime {

template <class T>
class DeviceArray {
 public:
  DeviceArray() = default;
  // Uninitialised: the engine fills what it reads first.
  DeviceArray(CachingAllocator* allocator, int64_t n, MemoryCategory category)
      : allocator_(allocator),
        size_(n),
        address_(n > 0 ? static_cast<T*>(allocator->Allocate(size_t(n) * sizeof(T), category)) : nullptr) {}
  DeviceArray(DeviceArray&& other) noexcept { *this = std::move(other); }
  DeviceArray& operator=(DeviceArray&& other) noexcept {
    std::swap(allocator_, other.allocator_);
    std::swap(size_, other.size_);
    std::swap(address_, other.address_);
    return *this;
  }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  ~DeviceArray() {
    if (address_ != nullptr) allocator_->Free(address_);
  }

  DevicePtr<T> get() const { return DevicePtr<T>(reinterpret_cast<uintptr_t>(address_)); }
  int64_t size() const { return size_; }
  size_t bytes() const { return size_t(size_) * sizeof(T); }

 private:
  CachingAllocator* allocator_ = nullptr;
  int64_t size_ = 0;
  T* address_ = nullptr;
};

}  // namespace meshtrain::runtime
