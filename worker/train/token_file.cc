#include "worker/train/token_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <utility>

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

TokenFile TokenFile::Open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) Fail(path, std::string("cannot open token file: ") + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    Fail(path, std::string("cannot stat: ") + std::strerror(err));
  }
  const size_t bytes = size_t(st.st_size);
  if (bytes < kHeaderBytes) {
    ::close(fd);
    Fail(path, "is not a token file: " + std::to_string(bytes) + " bytes is shorter than the 24-byte header");
  }
  void* map = ::mmap(nullptr, bytes, PROT_READ, MAP_PRIVATE, fd, 0);
  const int err = errno;
  ::close(fd);
  if (map == MAP_FAILED) Fail(path, std::string("cannot map: ") + std::strerror(err));

  TokenFile file;
  file.path_ = path;
  file.map_ = map;
  file.map_bytes_ = bytes;
  const auto* h = static_cast<const unsigned char*>(map);
  if (std::memcmp(h, kMagic, 4) != 0) Fail(path, "is not a token file: bad magic (expected \"MTOK\")");
  if (ReadU32(h + 4) != kVersion) Fail(path, "has token file version " + std::to_string(ReadU32(h + 4)) + ", expected 1");
  const uint32_t width = ReadU32(h + 8);
  if (width != 2 && width != 4) Fail(path, "has token width " + std::to_string(width) + "; expected 2 or 4 bytes");
  const uint64_t count = ReadU64(h + 16);
  const uint64_t payload = bytes - kHeaderBytes;
  if (count > payload / width || payload != count * width) {
    Fail(path, "is truncated or padded: the header says " + std::to_string(count) + " tokens of " +
                   std::to_string(width) + " bytes, but " + std::to_string(payload) + " bytes follow it");
  }
  file.width_ = int(width);
  file.count_ = count;
  file.tokens_ = h + kHeaderBytes;
  return file;
}

TokenFile::TokenFile(TokenFile&& other) noexcept { *this = std::move(other); }

TokenFile& TokenFile::operator=(TokenFile&& other) noexcept {
  if (this != &other) {
    if (map_ != nullptr) ::munmap(map_, map_bytes_);
    path_ = std::move(other.path_);
    map_ = std::exchange(other.map_, nullptr);
    map_bytes_ = std::exchange(other.map_bytes_, 0);
    tokens_ = std::exchange(other.tokens_, nullptr);
    count_ = std::exchange(other.count_, 0);
    width_ = std::exchange(other.width_, 0);
  }
  return *this;
}

TokenFile::~TokenFile() {
  if (map_ != nullptr) ::munmap(map_, map_bytes_);
}

void WriteTokenFile(const std::string& path, std::span<const uint32_t> tokens) {
  uint32_t width = 2;
  for (uint32_t t : tokens) {
    if (t > 0xFFFF) width = 4;
  }
  std::vector<unsigned char> bytes(TokenFile::kHeaderBytes + tokens.size() * width);
  std::memcpy(bytes.data(), kMagic, 4);
  PutU32(bytes.data() + 4, kVersion);
  PutU32(bytes.data() + 8, width);
  PutU32(bytes.data() + 16, uint32_t(tokens.size()));
  PutU32(bytes.data() + 20, uint32_t(uint64_t(tokens.size()) >> 32));
  unsigned char* out = bytes.data() + TokenFile::kHeaderBytes;
  for (size_t i = 0; i < tokens.size(); ++i) {
    for (uint32_t k = 0; k < width; ++k) out[i * width + k] = (tokens[i] >> (8 * k)) & 0xFF;
  }
  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) Fail(tmp, std::string("cannot create: ") + std::strerror(errno));
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      Fail(path, std::string("write failed: ") + std::strerror(err));
    }
    done += size_t(n);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    Fail(path, std::string("cannot flush: ") + std::strerror(err));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    Fail(path, std::string("cannot rename into place: ") + std::strerror(err));
  }
}

std::vector<uint32_t> ByteTokens(std::string_view text) {
  std::vector<uint32_t> tokens(text.size());
  for (size_t i = 0; i < text.size(); ++i) tokens[i] = static_cast<unsigned char>(text[i]);
  return tokens;
}

std::string TokensToText(std::span<const uint32_t> tokens) {
  std::string text;
  text.reserve(tokens.size());
  for (uint32_t t : tokens) text += t < 256 ? char(t) : '?';
  return text;
}

TokenSplit WriteTextAsTokenFiles(const std::string& text_path, const std::string& train,
                                 const std::string& validation, double validation_fraction) {
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
