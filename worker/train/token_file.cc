#include "worker/train/token_file.h"

#include <fcntl.h>
#include <glob.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <utility>

#include "worker/train/atomic_file.h"

namespace meshtrain::train {
namespace {

constexpr char kMagic[4] = {'M', 'T', 'O', 'K'};
constexpr uint32_t kVersion = 1;

uint32_t ReadU32(const unsigned char* p) { return uint32_t(p[0]) | uint32_t(p[1]) << 8 | uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24; }
uint64_t ReadU64(const unsigned char* p) { return uint64_t(ReadU32(p)) | uint64_t(ReadU32(p + 4)) << 32; }
void PutU32(unsigned char* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = (v >> (8 * i)) & 0xFF;
}

[[noreturn]] void Fail(const std::string& path, const std::string& what) { throw TokenFileError(path + ": " + what); }

}  // namespace

TokenFormat ParseTokenFormat(std::string_view name) {
  if (name == "auto") return TokenFormat::kHeader;
  if (name == "uint16") return TokenFormat::kUint16;
  throw std::invalid_argument("must be \"auto\" (MTOK or llm.c, as the header says) or \"uint16\" (raw), got \"" +
                              std::string(name) + "\"");
}

namespace {

constexpr uint32_t kLlmcMagic16 = 20240520, kLlmcMagic32 = 20240801;

bool IsLlmcHeader(const unsigned char* h, size_t bytes) {
  if (bytes < TokenFile::kLlmcHeaderBytes) return false;
  const uint32_t magic = ReadU32(h), version = ReadU32(h + 4);
  return (magic == kLlmcMagic16 && version == 1) || (magic == kLlmcMagic32 && (version == 7 || version == 2));
}

bool IsMtokHeader(const unsigned char* h, size_t bytes) {
  return bytes >= TokenFile::kHeaderBytes && std::memcmp(h, kMagic, 4) == 0;
}

}  // namespace

TokenFile TokenFile::Open(const std::string& path, TokenFormat format) {
  // O_NONBLOCK: opening a FIFO would otherwise wait for a writer forever; it is refused below.
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) Fail(path, std::string("cannot open token file: ") + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    Fail(path, std::string("cannot stat: ") + std::strerror(err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    Fail(path, "is not a regular file");
  }
  const size_t bytes = size_t(st.st_size);
  if (bytes == 0) {
    ::close(fd);
    Fail(path, "is empty");
  }
  void* map = ::mmap(nullptr, bytes, PROT_READ, MAP_PRIVATE, fd, 0);
  const int err = errno;
  ::close(fd);
  if (map == MAP_FAILED) Fail(path, std::string("cannot map: ") + std::strerror(err));

  TokenFile file;  // unmaps on a throw below
  file.path_ = path;
  file.map_ = map;
  file.map_bytes_ = bytes;
  const auto* h = static_cast<const unsigned char*>(map);
  const TokenFileLayout layout = ReadTokenFileLayout({h, bytes}, format, path);
  file.format_ = layout.format;
  file.header_bytes_ = layout.header_bytes;
  file.width_ = layout.width;
  file.count_ = layout.count;
  file.tokens_ = h + layout.header_bytes;
  return file;
}

TokenFileLayout ReadTokenFileLayout(std::span<const unsigned char> data, TokenFormat format, const std::string& path) {
  const unsigned char* h = data.data();
  const size_t bytes = data.size();
  if (bytes == 0) Fail(path, "is empty");
  TokenFileLayout file;
  uint64_t count = 0;
  if (format == TokenFormat::kUint16) {
    if (IsLlmcHeader(h, bytes) || IsMtokHeader(h, bytes)) {
      Fail(path, std::string("starts with ") + (IsLlmcHeader(h, bytes) ? "llm.c's" : "an MTOK") +
                     " header, but spec.data.format says raw uint16; leave the format at auto");
    }
    if (bytes % 2 != 0) Fail(path, "has " + std::to_string(bytes) + " bytes, an odd count for raw uint16 tokens");
    file.format = "uint16";
    file.width = 2;
    count = bytes / 2;
  } else if (IsLlmcHeader(h, bytes)) {
    file.format = "llm.c";
    file.header_bytes = TokenFile::kLlmcHeaderBytes;
    file.width = ReadU32(h) == kLlmcMagic16 ? 2 : 4;
    count = ReadU32(h + 8);
  } else if (IsMtokHeader(h, bytes)) {
    if (ReadU32(h + 4) != kVersion) Fail(path, "has MTOK version " + std::to_string(ReadU32(h + 4)) + ", expected 1");
    const uint32_t width = ReadU32(h + 8);
    if (width != 2 && width != 4) Fail(path, "has token width " + std::to_string(width) + "; expected 2 or 4 bytes");
    file.format = "MTOK";
    file.header_bytes = TokenFile::kHeaderBytes;
    file.width = int(width);
    count = ReadU64(h + 16);
  } else if (bytes >= 8 && (ReadU32(h) == kLlmcMagic16 || ReadU32(h) == kLlmcMagic32)) {
    // llm.c's magic, but not a header llm.c writes: say which part is wrong.
    if (bytes < TokenFile::kLlmcHeaderBytes) {
      Fail(path, "starts with llm.c's magic " + std::to_string(ReadU32(h)) + " but has " + std::to_string(bytes) +
                     " bytes, short of its " + std::to_string(TokenFile::kLlmcHeaderBytes) + "-byte header");
    }
    Fail(path, "has llm.c's magic " + std::to_string(ReadU32(h)) + " with version " + std::to_string(ReadU32(h + 4)) +
                   "; llm.c writes 20240520 with version 1 and 20240801 with version 7");
  } else {
    Fail(path, "has no token file header: expected \"MTOK\" or llm.c's magic 20240520 (version 1) or 20240801 "
               "(version 7); a raw uint16 file (nanoGPT's train.bin) needs spec.data.format: uint16");
  }
  const uint64_t payload = bytes - file.header_bytes;
  if (count > payload / unsigned(file.width) || payload != count * unsigned(file.width)) {
    Fail(path, "is truncated or padded: its " + std::string(file.format) + " header says " + std::to_string(count) +
                   " tokens of " + std::to_string(file.width) + " bytes, but " + std::to_string(payload) +
                   " bytes follow it");
  }
  file.count = count;
  return file;
}

std::vector<std::string> ExpandGlobs(const std::vector<std::string>& patterns) {
  std::vector<std::string> files;
  for (const std::string& pattern : patterns) {
    glob_t g{};
    const int rc = ::glob(pattern.c_str(), GLOB_NOSORT, nullptr, &g);
    std::vector<std::string> matched(g.gl_pathv, g.gl_pathv + (rc == 0 ? g.gl_pathc : 0));
    ::globfree(&g);
    const bool literal = matched.size() == 1 && matched[0] == pattern;
    if (!literal) {  // a glob: loss masks beside the shards are not shards
      const std::string suffix = TokenMask::kSuffix;
      std::erase_if(matched, [&](const std::string& f) {
        return f.size() >= suffix.size() && f.compare(f.size() - suffix.size(), suffix.size(), suffix) == 0;
      });
    }
    if (matched.empty()) throw TokenFileError(pattern + ": no file matches");
    std::sort(matched.begin(), matched.end());
    files.insert(files.end(), matched.begin(), matched.end());
  }
  return files;
}

void TokenFile::Read(uint64_t first, uint64_t count, int32_t* out) const {
  if (width_ == 2) {
    const auto* t = reinterpret_cast<const uint16_t*>(tokens_) + first;
    for (uint64_t i = 0; i < count; ++i) out[i] = int32_t(t[i]);
  } else {
    const auto* t = reinterpret_cast<const uint32_t*>(tokens_) + first;
    for (uint64_t i = 0; i < count; ++i) out[i] = int32_t(t[i]);
  }
}

namespace {

// The index of the first of `tokens` at or above `limit`, or n. Blocks are reduced
// branch-free (the loop vectorizes) and only a block holding one is searched.
template <class T>
uint64_t FirstAtOrAbove(const T* tokens, uint64_t n, uint32_t limit) {
  constexpr uint64_t kBlock = 4096;
  for (uint64_t start = 0; start < n; start += kBlock) {
    const uint64_t end = std::min(n, start + kBlock);
    T largest = 0;
    for (uint64_t i = start; i < end; ++i) largest = std::max(largest, tokens[i]);
    if (uint32_t(largest) < limit) continue;
    for (uint64_t i = start; i < end; ++i) {
      if (uint32_t(tokens[i]) >= limit) return i;
    }
  }
  return n;
}

}  // namespace

void TokenFile::CheckVocabulary(uint32_t vocab_size) const {
  const uint64_t at = width_ == 2 ? FirstAtOrAbove(reinterpret_cast<const uint16_t*>(tokens_), count_, vocab_size)
                                  : FirstAtOrAbove(reinterpret_cast<const uint32_t*>(tokens_), count_, vocab_size);
  if (at == count_) return;
  Fail(path_, "token " + std::to_string(at) + " (byte offset " + std::to_string(header_bytes_ + at * unsigned(width_)) +
                  ") is " + std::to_string((*this)[at]) + ", outside the model's vocabulary of " +
                  std::to_string(vocab_size) + " (spec.model.vocabSize)");
}

TokenFile::TokenFile(TokenFile&& other) noexcept { *this = std::move(other); }

TokenFile& TokenFile::operator=(TokenFile&& other) noexcept {
  if (this != &other) {
    if (map_ != nullptr) ::munmap(map_, map_bytes_);
    path_ = std::move(other.path_);
    map_ = std::exchange(other.map_, nullptr);
    map_bytes_ = std::exchange(other.map_bytes_, 0);
    header_bytes_ = std::exchange(other.header_bytes_, 0);
    tokens_ = std::exchange(other.tokens_, nullptr);
    count_ = std::exchange(other.count_, 0);
    width_ = std::exchange(other.width_, 0);
    format_ = std::exchange(other.format_, {});
  }
  return *this;
}

TokenFile::~TokenFile() {
  if (map_ != nullptr) ::munmap(map_, map_bytes_);
}

namespace {

// Writes `bytes` to `path` through a temporary file, fsync and rename.
void WriteAtomically(const std::string& path, const std::vector<unsigned char>& bytes) {
  if (const std::string error = WriteFileAtomically(path, bytes.data(), bytes.size()); !error.empty()) Fail(path, error);
}

uint32_t NarrowestWidth(std::span<const uint32_t> tokens) {
  for (uint32_t t : tokens) {
    if (t > 0xFFFF) return 4;
  }
  return 2;
}

void PutTokens(unsigned char* out, std::span<const uint32_t> tokens, uint32_t width) {
  for (size_t i = 0; i < tokens.size(); ++i) {
    for (uint32_t k = 0; k < width; ++k) out[i * width + k] = (tokens[i] >> (8 * k)) & 0xFF;
  }
}

}  // namespace

void WriteTokenFile(const std::string& path, std::span<const uint32_t> tokens) {
  const uint32_t width = NarrowestWidth(tokens);
  std::vector<unsigned char> bytes(TokenFile::kHeaderBytes + tokens.size() * width);
  std::memcpy(bytes.data(), kMagic, 4);
  PutU32(bytes.data() + 4, kVersion);
  PutU32(bytes.data() + 8, width);
  PutU32(bytes.data() + 16, uint32_t(tokens.size()));
  PutU32(bytes.data() + 20, uint32_t(uint64_t(tokens.size()) >> 32));
  PutTokens(bytes.data() + TokenFile::kHeaderBytes, tokens, width);
  WriteAtomically(path, bytes);
}

void WriteLlmcTokenFile(const std::string& path, std::span<const uint32_t> tokens, uint64_t vocab_size) {
  if (tokens.size() > 0x7FFFFFFF) Fail(path, "llm.c's header holds at most 2^31-1 tokens; write more shards");
  const uint32_t width = vocab_size > 65536 ? 4 : NarrowestWidth(tokens);
  std::vector<unsigned char> bytes(TokenFile::kLlmcHeaderBytes + tokens.size() * width);
  PutU32(bytes.data(), width == 2 ? kLlmcMagic16 : kLlmcMagic32);
  PutU32(bytes.data() + 4, width == 2 ? 1 : 7);
  PutU32(bytes.data() + 8, uint32_t(tokens.size()));
  PutTokens(bytes.data() + TokenFile::kLlmcHeaderBytes, tokens, width);
  WriteAtomically(path, bytes);
}

namespace {

constexpr char kMaskMagic[4] = {'M', 'T', 'M', 'K'};

// Checks a mask's header `head` (its first 24 bytes, or all of a shorter file) against
// the file's size `bytes` and its shard's count `tokens`.
void CheckMaskHeader(std::string_view head, uint64_t bytes, uint64_t tokens, const std::string& path,
                     const std::string& shard) {
  const auto* h = reinterpret_cast<const unsigned char*>(head.data());
  if (head.size() < TokenFile::kHeaderBytes || std::memcmp(h, kMaskMagic, 4) != 0) {
    Fail(path, "is not a loss mask: expected the magic \"MTMK\" and a 24-byte header");
  }
  if (ReadU32(h + 4) != 1) Fail(path, "has mask version " + std::to_string(ReadU32(h + 4)) + ", expected 1");
  const uint64_t count = ReadU64(h + 16);
  if (count != tokens) {
    Fail(path, "is the loss mask of " + std::to_string(count) + " tokens, but its shard " + shard + " has " +
                   std::to_string(tokens));
  }
  // (count + 7) / 8 without wrapping at a count near 2^64.
  const uint64_t need = count / 8 + (count % 8 != 0);
  if (bytes - TokenFile::kHeaderBytes != need) {
    Fail(path, "is truncated or padded: " + std::to_string(count) + " tokens need " + std::to_string(need) +
                   " bytes of mask, but " + std::to_string(bytes - TokenFile::kHeaderBytes) + " follow the header");
  }
}

}  // namespace

TokenMask TokenMask::Parse(std::string_view data, uint64_t tokens, const std::string& path, const std::string& shard) {
  CheckMaskHeader(data.substr(0, TokenFile::kHeaderBytes), data.size(), tokens, path, shard);
  TokenMask mask;
  mask.path_ = path;
  mask.bits_.assign(data.begin() + long(TokenFile::kHeaderBytes), data.end());
  return mask;
}

std::optional<TokenMask> TokenMask::OpenBeside(const std::string& shard, uint64_t tokens) {
  const std::string path = shard + kSuffix;
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return std::nullopt;
  if (!S_ISREG(st.st_mode)) Fail(path, "is not a regular file");
  std::ifstream in(path, std::ios::binary);
  if (!in) Fail(path, "cannot open the loss mask");
  // The header first: the rest is read only once its size is the shard's count's.
  std::string head(TokenFile::kHeaderBytes, '\0');
  in.read(head.data(), std::streamsize(head.size()));
  head.resize(size_t(in.gcount()));
  if (in.bad()) Fail(path, "cannot read the loss mask");
  CheckMaskHeader(head, uint64_t(st.st_size), tokens, path, shard);
  TokenMask mask;
  mask.path_ = path;
  mask.bits_.resize(size_t(st.st_size) - TokenFile::kHeaderBytes);
  in.read(reinterpret_cast<char*>(mask.bits_.data()), std::streamsize(mask.bits_.size()));
  if (size_t(in.gcount()) != mask.bits_.size()) Fail(path, "cannot read the loss mask (it changed while read)");
  return mask;
}

uint64_t TokenMask::CountTargets(uint64_t first, uint64_t count) const {
  uint64_t n = 0, i = first;
  const uint64_t end = first + count;
  for (; i < end && (i & 7) != 0; ++i) n += target(i);
  for (; i + 8 <= end; i += 8) n += uint64_t(std::popcount(bits_[i >> 3]));
  for (; i < end; ++i) n += target(i);
  return n;
}

void WriteTokenMask(const std::string& path, const std::vector<bool>& targets) {
  std::vector<unsigned char> bytes(TokenFile::kHeaderBytes + (targets.size() + 7) / 8, 0);
  std::memcpy(bytes.data(), kMaskMagic, 4);
  PutU32(bytes.data() + 4, 1);
  PutU32(bytes.data() + 16, uint32_t(targets.size()));
  PutU32(bytes.data() + 20, uint32_t(uint64_t(targets.size()) >> 32));
  for (size_t i = 0; i < targets.size(); ++i) {
    if (targets[i]) bytes[TokenFile::kHeaderBytes + i / 8] |= uint8_t(1u << (i % 8));
  }
  WriteAtomically(path, bytes);
}

std::vector<uint32_t> ByteTokens(std::string_view text) {
  std::vector<uint32_t> tokens(text.size());
  for (size_t i = 0; i < text.size(); ++i) tokens[i] = static_cast<unsigned char>(text[i]);
  return tokens;
}

std::string TokensToText(std::span<const uint32_t> tokens, int64_t vocab_size) {
  std::string text;
  if (vocab_size > 256) {
    for (uint32_t t : tokens) text += (text.empty() ? "" : " ") + std::to_string(t);
    return text;
  }
  text.reserve(tokens.size());
  for (uint32_t t : tokens) text += char(t);
  return text;
}

TokenSplit WriteTextAsTokenFiles(const std::string& text_path, const std::string& train,
                                 const std::string& validation, double validation_fraction) {
  if (NotARegularFile(text_path)) Fail(text_path, "is not a regular file");
  std::ifstream in(text_path, std::ios::binary);
  if (!in) Fail(text_path, "cannot open");
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) Fail(text_path, "read error");
  const std::vector<uint32_t> tokens = ByteTokens(text);
  const std::span<const uint32_t> all(tokens);
  TokenSplit split;
  split.validation = validation.empty() ? 0 : size_t(double(tokens.size()) * validation_fraction);
  split.train = tokens.size() - split.validation;
  WriteTokenFile(train, all.first(split.train));
  if (!validation.empty()) WriteTokenFile(validation, all.last(split.validation));
  return split;
}

}  // namespace meshtrain::train
