// Token shards in the three formats users have on disk. A header picks the format; a raw
// file has none, so it is read only when the spec says so (spec.data.format: uint16).
//
//   MTOK (meshtrain's own), little-endian:
//     offset  0  magic "MTOK"
//     offset  4  version, u32 = 1
//     offset  8  token width in bytes, u32: 2 (uint16) or 4 (uint32)
//     offset 12  reserved, u32 = 0
//     offset 16  token count, u64
//     offset 24  count tokens of `width` bytes
//   llm.c's (dev/data/data_common.py), 256 little-endian int32, then the tokens:
//     header[0] magic 20240520, header[1] version 1, header[2] token count: uint16 tokens
//     header[0] magic 20240801, header[1] version 7, header[2] token count: uint32 tokens
//       (llm.c's Llama 3 shards; version 2, which meshtrain wrote before, is read too)
//   raw uint16 (nanoGPT's train.bin, val.bin): tokens only, no header.
//
// A loss mask (prompt/completion fine-tuning data, prepare_data.h) lives beside its shard,
// named by appending ".mask" (fineweb_train_000001.bin.mask); spec.data names only the
// shards, and the data loader finds each one's mask. Little-endian:
//     offset  0  magic "MTMK"
//     offset  4  version, u32 = 1
//     offset  8  reserved, two u32 = 0
//     offset 16  token count, u64 (the shard's)
//     offset 24  ceil(count / 8) bytes: bit i (byte i / 8, least significant bit first) is 1
//                when token i is a target (the loss counts predicting it), 0 when it is
//                context only (a prompt's tokens)
// A shard without a mask has every token a target. Globs skip *.mask files (ExpandGlobs).
//
// Shards and masks may come from elsewhere (a data set downloaded whole): a header that
// does not hold its file's bytes exactly is refused, naming the file, before a token is
// read, and a mask is read only once its header and size agree with its shard's count.
// Files are memory-mapped read-only. A TokenFile (and a TokenMask) is immutable after Open
// and safe to read from several threads.

#pragma once

#include <cstdint>
#include <optional>
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

enum class TokenFormat {
  kHeader,  // MTOK or llm.c, as the header says (spec.data.format: auto)
  kUint16,  // raw uint16 tokens (spec.data.format: uint16)
};

// "auto" or "uint16" (spec.data.format); throws std::invalid_argument otherwise.
TokenFormat ParseTokenFormat(std::string_view name);

// Where a token file's tokens are, as its header says.
struct TokenFileLayout {
  std::string_view format;  // "MTOK", "llm.c" or "uint16"
  size_t header_bytes = 0;
  int width = 0;  // bytes per token: 2 or 4
  uint64_t count = 0;
};

// The layout of a token file whose whole contents are `bytes`, read as `format` says:
// header_bytes + count x width == bytes.size(). Throws TokenFileError naming `path`, as
// TokenFile::Open does.
TokenFileLayout ReadTokenFileLayout(std::span<const unsigned char> bytes, TokenFormat format, const std::string& path);

class TokenFile {
 public:
  static constexpr size_t kHeaderBytes = 24;      // MTOK
  static constexpr size_t kLlmcHeaderBytes = 1024;  // llm.c

  // Maps `path`. Throws TokenFileError naming the file and what was expected (also for
  // a directory, FIFO or device: "is not a regular file").
  static TokenFile Open(const std::string& path, TokenFormat format = TokenFormat::kHeader);

  TokenFile(TokenFile&& other) noexcept;
  TokenFile& operator=(TokenFile&& other) noexcept;
  TokenFile(const TokenFile&) = delete;
  TokenFile& operator=(const TokenFile&) = delete;
  ~TokenFile();

  const std::string& path() const { return path_; }
  uint64_t size() const { return count_; }
  int width() const { return width_; }
  std::string_view format() const { return format_; }  // "MTOK", "llm.c" or "uint16"
  uint32_t operator[](uint64_t i) const {
    return width_ == 2 ? reinterpret_cast<const uint16_t*>(tokens_)[i] : reinterpret_cast<const uint32_t*>(tokens_)[i];
  }
  // Copies tokens [first, first + count) into `out` as int32.
  void Read(uint64_t first, uint64_t count, int32_t* out) const;

  // Throws TokenFileError naming the file and the offset of the first token at or above
  // `vocab_size` (a scan of the whole file at memory bandwidth).
  void CheckVocabulary(uint32_t vocab_size) const;

 private:
  TokenFile() = default;
  std::string path_;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  size_t header_bytes_ = 0;
  const unsigned char* tokens_ = nullptr;
  uint64_t count_ = 0;
  int width_ = 0;
  std::string_view format_;
};

// Which tokens of a shard are targets (the mask format above).
class TokenMask {
 public:
  static constexpr const char* kSuffix = ".mask";

  // The mask beside `shard` (SHARD.mask), or none. Throws TokenFileError naming the mask
  // when it is malformed or its count is not the shard's `tokens`.
  static std::optional<TokenMask> OpenBeside(const std::string& shard, uint64_t tokens);
  // The mask whose whole contents are `data`, read from `path`, beside `shard` of `tokens`
  // tokens. Throws TokenFileError as OpenBeside does.
  static TokenMask Parse(std::string_view data, uint64_t tokens, const std::string& path, const std::string& shard);

  bool target(uint64_t i) const { return (bits_[i >> 3] >> (i & 7)) & 1; }
  // How many of tokens [first, first + count) are targets.
  uint64_t CountTargets(uint64_t first, uint64_t count) const;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::vector<uint8_t> bits_;
};

// Writes the mask of a shard's tokens (`targets[i]`: token i is a target) to `path`,
// atomically as WriteTokenFile.
void WriteTokenMask(const std::string& path, const std::vector<bool>& targets);

// The files that `patterns` (paths or globs) name: each pattern's matches sorted, in
// pattern order, less loss masks (*.mask) a glob matched. Throws TokenFileError naming a
// pattern that matches nothing.
std::vector<std::string> ExpandGlobs(const std::vector<std::string>& patterns);

// Writes `tokens` as MTOK with the narrowest width that holds them (uint16 when all
// < 65536), through a temporary file and rename, so a reader never sees half a file.
// Throws TokenFileError naming the file (a full disk, say).
void WriteTokenFile(const std::string& path, std::span<const uint32_t> tokens);

// Writes `tokens` as llm.c writes them: GPT-2's shards (20240520, version 1, uint16) for a
// vocabulary of at most 65536 tokens, else Llama 3's (20240801, version 7, uint32); a token
// past uint16 makes a wide shard whatever `vocab_size` says. Atomic as WriteTokenFile.
void WriteLlmcTokenFile(const std::string& path, std::span<const uint32_t> tokens, uint64_t vocab_size = 0);

// The byte-level tokenizer: one token per byte, vocabulary 256.
std::vector<uint32_t> ByteTokens(std::string_view text);

// The text of `tokens` under the byte-level tokenizer; with a larger vocabulary
// (`vocab_size` > 256) and no tokenizer to decode them, the ids, space-separated.
std::string TokensToText(std::span<const uint32_t> tokens, int64_t vocab_size = 256);

// A text file as byte tokens in two token files: `train` gets the first part and
// `validation` the last `validation_fraction` of the text, so the two never share a
// passage (validation empty: everything goes to train). Returns the token counts.
// Throws TokenFileError naming a file that cannot be read ("cannot open", "is not a
// regular file") or written.
struct TokenSplit {
  size_t train = 0, validation = 0;
};
TokenSplit WriteTextAsTokenFiles(const std::string& text_path, const std::string& train,
                                 const std::string& validation, double validation_fraction);

}  // namespace meshtrain::train
