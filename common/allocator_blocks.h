// The caching allocator's size classes, shared by the allocator that rounds requests to
// them (worker/runtime/memory.h, CachingAllocator) and the memory model that counts what
// it will hold (api/engine_memory.h, which the planner adds up), so that the two cannot
// drift. Header-only and free of dependencies: neither side depends on the other for it.
// Thread-safety: a pure function.

#pragma once

#include <algorithm>
#include <cstddef>

namespace meshtrain::common {

// The bytes the caching allocator holds for a request of `bytes`: rounded up to 512 bytes
// below 1 MiB and to 2 MiB from there (a request of 0 holds 512).
constexpr size_t AllocatorBlockBytes(size_t bytes) {
  constexpr size_t kSmall = 512, kLarge = size_t(2) << 20, kLargeFrom = size_t(1) << 20;
  const size_t unit = bytes < kLargeFrom ? kSmall : kLarge;
  return std::max(unit, (bytes + unit - 1) / unit * unit);
}

}  // namespace meshtrain::common
