// libFuzzer target for safetensors headers and a sharded model's
// model.safetensors.index.json (worker/train/safetensors.h).
//
// The input: a header's JSON text (what follows a file's 8-byte length); then, after a NUL
// byte (which JSON text cannot hold), an index. The header is read as that of a file with
// kDataBytes of data; where its tensors end within kWrittenBytes, the file is also written
// whole (to a memfd: the length, the header, data bytes from the input), opened as a
// SafetensorsFile and every tensor read, as a rank reads them.
//
// Beyond "no crash", it checks on every input:
//   - only SafetensorsError escapes, its message naming the file;
//   - a header that parses gives tensors whose bytes lie inside the data, are exactly
//     their elements in their dtype, and share no byte with another tensor's;
//   - the file opened from disk has the same tensors and metadata, and its values are its
//     bytes: F32 and BF16 bit for bit, F16 finite where its exponent is not all ones;
//   - an index that parses maps tensors to plain file names beside it.

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "worker/train/safetensors.h"

namespace {

using namespace meshtrain::train;

constexpr uint64_t kDataBytes = uint64_t(1) << 20;
constexpr uint64_t kWrittenBytes = uint64_t(1) << 16;

[[noreturn]] void Fail(const char* what, const std::string& detail) {
  std::fprintf(stderr, "%s: %s\n", what, detail.c_str());
  std::abort();
}

void CheckError(const SafetensorsError& e, const std::string& file) {
  if (!std::string_view(e.what()).starts_with(file + ": ")) Fail("an error that does not name its file", e.what());
}

// The file of `header` with `data_bytes` of data cut from `fill`, written to a memfd;
// returns its descriptor.
int WriteFile(std::string_view header, uint64_t data_bytes, std::string_view fill) {
  std::string file(8, '\0');
  for (int i = 0; i < 8; ++i) file[size_t(i)] = char((uint64_t(header.size()) >> (8 * i)) & 0xFF);
  file += header;
  for (uint64_t i = 0; i < data_bytes; ++i) file += fill.empty() ? '\0' : fill[i % fill.size()];
  const int fd = ::memfd_create("safetensors", MFD_CLOEXEC);
  if (fd < 0) Fail("memfd_create failed", std::strerror(errno));
  for (size_t done = 0; done < file.size();) {
    const ssize_t n = ::write(fd, file.data() + done, file.size() - done);
    if (n <= 0) Fail("cannot write the memfd", std::strerror(errno));
    done += size_t(n);
  }
  return fd;
}

void ReadEveryTensor(std::string_view header, uint64_t data_begin, uint64_t data_end, std::string_view fill,
                     const SafetensorsHeader& parsed) {
  const int fd = WriteFile(header, data_end - data_begin, fill);
  const std::string path = "/proc/self/fd/" + std::to_string(fd);
  try {
    const SafetensorsFile file(path);
    if (file.metadata() != parsed.metadata || file.tensors().size() != parsed.tensors.size()) {
      Fail("the file on disk reads otherwise", path);
    }
    for (const auto& [name, entry] : file.tensors()) {
      const TensorEntry& expected = parsed.tensors.at(name);
      if (entry.offset != expected.offset || entry.shape != expected.shape || entry.dtype != expected.dtype) {
        Fail("a tensor on disk reads otherwise", name);
      }
      std::vector<float> values(size_t(entry.elements()));
      file.Read(name, entry, 0, entry.elements(), values.data());
      const int width = DtypeBytes(entry.dtype);
      for (size_t i = 0; i < values.size(); ++i) {
        uint32_t bits = 0;
        for (int b = width - 1; b >= 0; --b) {
          const uint64_t at = entry.offset + i * uint64_t(width) + uint64_t(b) - data_begin;
          bits = bits << 8 | uint8_t(fill.empty() ? 0 : fill[at % fill.size()]);
        }
        const float v = values[i];
        const bool ok = entry.dtype == Dtype::kF32    ? std::bit_cast<uint32_t>(v) == bits
                        : entry.dtype == Dtype::kBF16 ? std::bit_cast<uint32_t>(v) == bits << 16
                                                      : std::isfinite(v) == (((bits >> 10) & 0x1F) != 0x1F) &&
                                                            (!std::isfinite(v) || std::fabs(v) <= 65504.0f);
        if (!ok) Fail("a value is not its bytes", name + " element " + std::to_string(i));
      }
    }
  } catch (const SafetensorsError& e) {
    Fail("a header that parses does not open", e.what());
  }
  ::close(fd);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  const size_t nul = input.find('\0');
  const std::string_view header = input.substr(0, nul);
  const std::string_view index = nul == std::string_view::npos ? std::string_view() : input.substr(nul + 1);

  if (nul != std::string_view::npos) {
    const std::string index_file = "fuzz/model.safetensors.index.json";
    try {
      for (const auto& [tensor, name] : ParseSafetensorsIndex(index, index_file)) {
        if (name.empty() || name == "." || name == ".." || name.find('/') != std::string::npos) {
          Fail("the index names a file elsewhere", tensor + ": " + name);
        }
      }
    } catch (const SafetensorsError& e) {
      CheckError(e, index_file);
    }
  }

  const std::string file = "fuzz/model.safetensors";
  const uint64_t data_begin = 8 + header.size();
  SafetensorsHeader parsed;
  try {
    parsed = ParseSafetensorsHeader(header, data_begin, kDataBytes, file);
  } catch (const SafetensorsError& e) {
    CheckError(e, file);
    return 0;
  }
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  uint64_t data_end = data_begin;
  for (const auto& [name, t] : parsed.tensors) {
    for (int64_t d : t.shape) {
      if (d < 0) Fail("a negative dimension", name);
    }
    const uint64_t bytes = uint64_t(t.elements()) * uint64_t(DtypeBytes(t.dtype));
    if (t.offset < data_begin || t.offset - data_begin > kDataBytes || bytes > kDataBytes - (t.offset - data_begin)) {
      Fail("a tensor outside the data", name);
    }
    if (bytes > 0) ranges.emplace_back(t.offset, t.offset + bytes);
    data_end = std::max(data_end, t.offset + bytes);
  }
  std::sort(ranges.begin(), ranges.end());
  uint64_t furthest = 0;
  for (const auto& [begin, end] : ranges) {
    if (begin < furthest) Fail("two tensors share bytes", std::to_string(begin));
    furthest = std::max(furthest, end);
  }
  if (data_end - data_begin <= kWrittenBytes) ReadEveryTensor(header, data_begin, data_end, input, parsed);
  return 0;
}
