// libFuzzer target for loss masks (worker/train/token_file.h, TokenMask): the file beside
// a shard of prompt/completion data that says which tokens are targets.
//
// The input: a mask file's bytes, read for a shard of the count its header gives (so that
// the bits are reached) and of one token more.
//
// Beyond "no crash", it checks on every input:
//   - only TokenFileError escapes, its message naming the mask;
//   - a mask that reads is one for the shard's count, with ceil(count / 8) bytes of bits;
//   - CountTargets over ranges taken from the input equals target(i) counted one by one,
//     as the data loader's two uses of a mask (Next, GlobalTargets) must agree.

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "worker/train/token_file.h"

namespace {

using meshtrain::train::TokenFileError;
using meshtrain::train::TokenMask;

[[noreturn]] void Fail(const char* what, const std::string& detail) {
  std::fprintf(stderr, "%s: %s\n", what, detail.c_str());
  std::abort();
}

uint64_t CountOf(const uint8_t* data, size_t size) {
  uint64_t count = 0;
  for (int i = 7; i >= 0 && size >= 24; --i) count = count << 8 | data[16 + i];
  return count;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  const std::string mask_file = "fuzz/shard.bin.mask";
  const uint64_t declared = CountOf(data, size);
  for (const uint64_t tokens : {declared, declared + 1}) {
    try {
      const TokenMask mask = TokenMask::Parse(bytes, tokens, mask_file, "fuzz/shard.bin");
      if (tokens != declared || size - 24 != tokens / 8 + (tokens % 8 != 0)) {
        Fail("a mask that does not fit its shard was read", std::to_string(tokens));
      }
      // Ranges from the input's bytes: [first, first + count) inside the shard.
      for (size_t k = 0; k + 1 < size && k < 64; k += 2) {
        const uint64_t first = tokens == 0 ? 0 : (uint64_t(data[k]) * 131 + k) % tokens;
        const uint64_t count = std::min<uint64_t>(tokens - first, uint64_t(data[k + 1]) * 3);
        uint64_t one_by_one = 0;
        for (uint64_t i = first; i < first + count; ++i) one_by_one += mask.target(i);
        if (mask.CountTargets(first, count) != one_by_one) {
          Fail("CountTargets disagrees with target()", std::to_string(first) + " + " + std::to_string(count));
        }
      }
    } catch (const TokenFileError& e) {
      if (!std::string_view(e.what()).starts_with(mask_file + ": ")) Fail("an error without its mask", e.what());
    }
  }
  return 0;
}
