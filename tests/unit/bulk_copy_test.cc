#include "worker/comm/fabric/bulk_copy.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

namespace meshtrain::comm::fabric {
namespace {

// Every size around the streaming threshold and the 64-byte line, at every kind of
// misalignment of either side; the bytes just outside the destination stay untouched.
TEST(BulkCopy, CopiesExactlyTheBytesAtAnyAlignment) {
  const size_t sizes[] = {0, 1, 63, 64, 65, 255, 257, kStreamingCopyBytes - 1, kStreamingCopyBytes,
                          kStreamingCopyBytes + 1, kStreamingCopyBytes + 64 * 3 + 7, (size_t{1} << 20) + 37};
  const size_t largest = (size_t{1} << 20) + 37;
  std::vector<uint8_t> source(largest + 128), destination(largest + 256);
  for (size_t i = 0; i < source.size(); ++i) source[i] = static_cast<uint8_t>(i * 131 + 7);
  for (size_t bytes : sizes) {
    for (size_t to_offset : {0, 1, 17, 63, 64}) {
      for (size_t from_offset : {0, 5, 32}) {
        std::fill(destination.begin(), destination.end(), 0xEE);
        BulkCopy(destination.data() + 64 + to_offset, source.data() + from_offset, bytes);
        const uint8_t* to = destination.data() + 64 + to_offset;
        for (size_t i = 0; i < bytes; ++i) {
          ASSERT_EQ(to[i], source[from_offset + i])
              << "byte " << i << " of " << bytes << " (to+" << to_offset << ", from+" << from_offset << ")";
        }
        ASSERT_EQ(to[-1], 0xEE) << bytes << " bytes wrote before the destination";
        ASSERT_EQ(to[bytes], 0xEE) << bytes << " bytes wrote past the destination";
      }
    }
  }
}

}  // namespace
}  // namespace meshtrain::comm::fabric
