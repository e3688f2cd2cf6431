// libFuzzer target for token shards' headers (worker/train/token_file.h): MTOK, llm.c's
// and raw uint16 files.
//
// The input: a token file's bytes, read in both formats (TokenFormat::kHeader, as
// spec.data.format auto reads it, and kUint16): by ReadTokenFileLayout, and from a memfd
// by TokenFile::Open, the file then moved as the data loader moves it into its list.
//
// Beyond "no crash", it checks on every input:
//   - only TokenFileError escapes, its message naming the file;
//   - a layout that reads covers the file exactly: header + count x width bytes, width 2
//     or 4, and Open agrees with it after the move;
//   - Read gives the file's little-endian tokens, and CheckVocabulary names the first
//     token at or above a limit taken from the input, with its byte offset, as a scan
//     one token at a time finds it.

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "worker/train/token_file.h"

namespace {

using namespace meshtrain::train;

[[noreturn]] void Fail(const char* what, const std::string& detail) {
  std::fprintf(stderr, "%s: %s\n", what, detail.c_str());
  std::abort();
}

void CheckError(const TokenFileError& e, const std::string& file) {
  if (!std::string_view(e.what()).starts_with(file + ": ")) Fail("an error that does not name its file", e.what());
}

// Opens the memfd's file as the data loader does, and holds it to `layout`.
void CheckOpen(const std::string& path, TokenFormat format, const TokenFileLayout& layout, const uint8_t* data,
               uint32_t limit) {
  std::vector<TokenFile> files;
  try {
    files.push_back(TokenFile::Open(path, format));
  } catch (const TokenFileError& e) {
    Fail("a layout that reads does not open", e.what());
  }
  const TokenFile& file = files.back();
  if (file.format() != layout.format || file.size() != layout.count || file.width() != layout.width) {
    Fail("Open disagrees with the layout", path);
  }
  std::vector<int32_t> tokens(size_t(layout.count));
  file.Read(0, layout.count, tokens.data());
  uint64_t first_past = layout.count;
  for (uint64_t i = 0; i < layout.count; ++i) {
    uint32_t token = 0;
    const uint8_t* bytes = data + layout.header_bytes + i * unsigned(layout.width);
    for (int b = layout.width - 1; b >= 0; --b) token = token << 8 | bytes[b];
    if (uint32_t(tokens[i]) != token || file[i] != token) Fail("a token is not its bytes", std::to_string(i));
    if (token >= limit && first_past == layout.count) first_past = i;
  }
  try {
    file.CheckVocabulary(limit);
    if (first_past != layout.count) Fail("CheckVocabulary missed a token past it", std::to_string(first_past));
  } catch (const TokenFileError& e) {
    const std::string expected = "token " + std::to_string(first_past) + " (byte offset " +
                                 std::to_string(layout.header_bytes + first_past * unsigned(layout.width)) + ")";
    if (first_past == layout.count || std::string_view(e.what()).find(expected) == std::string_view::npos) {
      Fail("CheckVocabulary names another token", std::string(e.what()) + " (expected " + expected + ")");
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string file = "fuzz/shard.bin";
  // A vocabulary from the input's last bytes: some tokens at or above it, some below.
  const uint32_t limit = size >= 2 ? uint32_t(data[size - 1]) << 8 | data[size - 2] : 256;
  int fd = -1;
  for (TokenFormat format : {TokenFormat::kHeader, TokenFormat::kUint16}) {
    TokenFileLayout layout;
    try {
      layout = ReadTokenFileLayout(std::span(data, size), format, file);
    } catch (const TokenFileError& e) {
      CheckError(e, file);
      continue;
    }
    if ((layout.width != 2 && layout.width != 4) ||
        layout.header_bytes + layout.count * unsigned(layout.width) != size) {
      Fail("a layout that does not cover the file", std::string(layout.format));
    }
    if (fd < 0) {
      fd = ::memfd_create("shard", MFD_CLOEXEC);
      if (fd < 0 || ::write(fd, data, size) != ssize_t(size)) Fail("cannot write the memfd", std::strerror(errno));
    }
    CheckOpen("/proc/self/fd/" + std::to_string(fd), format, layout, data, limit);
  }
  if (fd >= 0) ::close(fd);
  return 0;
}
