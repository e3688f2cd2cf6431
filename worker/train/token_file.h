// Token files: a 24-byte little-endian header, then the tokens.
//
//   offset  0  magic "MTOK"
//   offset  4  version, u32 = 1
//   offset  8  token width in bytes, u32: 2 (uint16) or 4 (uint32)
//   offset 12  reserved, u32 = 0
//   offset 16  token count, u64
//   offset 24  count tokens of `width` bytes
//
// Files are memory-mapped read-only. A TokenFile is immutable after Open and safe to
// read from several threads.

#pragma once

#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace meshtrain::train {

// A missing, unreadable, malformed or truncated token file; what() names the file.
class TokenFileError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class TokenFile {
 public:
  static constexpr size_t kHeaderBytes = 24;

  // Maps `path`. Throws TokenFileError.
  static TokenFile Open(const std::string& path);

  TokenFile(TokenFile&& other) noexcept;
  TokenFile& operator=(TokenFile&& other) noexcept;
  TokenFile(const TokenFile&) = delete;
  TokenFile& operator=(const TokenFile&) = delete;
  ~TokenFile();

  const std::string& path() const { return path_; }
  uint64_t size() const { return count_; }
  int width() const { return width_; }
  uint32_t operator[](uint64_t i) const {
    return width_ == 2 ? reinterpret_cast<const uint16_t*>(tokens_)[i] : reinterpret_cast<const uint32_t*>(tokens_)[i];
  }

 private:
  TokenFile() = default;
  std::string path_;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  const unsigned char* tokens_ = nullptr;
  uint64_t count_ = 0;
  int width_ = 0;
};

// Writes `tokens` with the narrowest width that holds them (uint16 when all < 65536),
// through a temporary file and rename, so a reader never sees half a file.
// Throws TokenFileError naming the file (a full disk, say).
void WriteTokenFile(const std::string& path, std::span<const uint32_t> tokens);

// The byte-level tokenizer: one token per byte, vocabulary 256.
std::vector<uint32_t> ByteTokens(std::string_view text);
std::string TokensToText(std::span<const uint32_t> tokens);

// A text file as byte tokens in two token files: `train` gets the first part and
// `validation` the last `validation_fraction` of the text, so the two never share a
// passage (validation empty: everything goes to train). Returns the token counts.
// Throws TokenFileError naming a file that cannot be read ("cannot open") or written.
struct TokenSplit {
  size_t train = 0, validation = 0;
};
TokenSplit WriteTextAsTokenFiles(const std::string& text_path, const std::string& train,
                                 const std::string& validation, double validation_fraction);

}  // namespace meshtrain::train
