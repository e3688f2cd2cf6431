#include "worker/train/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <set>
#include <vector>

#include <nlohmann/json.hpp>

#include "api/hf_config.h"
#include "worker/runtime/bf16.h"
#include "worker/train/atomic_file.h"

namespace meshtrain::train {
namespace {

using Json = nlohmann::json;

// The header may not be larger than this (the format's own limit is 100 MB).
constexpr uint64_t kMaxHeader = 100u << 20;
// Nor a tensor, nor any dimension of it, hold more elements than this: counts and byte
// offsets cannot wrap.
constexpr uint64_t kMaxElements = uint64_t(1) << 40;

float FromHalf(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16, exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
  if (exponent == 0) {  // zero or subnormal: mantissa x 2^-24
    const float value = float(mantissa) * (1.0f / 16777216.0f);
    return sign ? -value : value;
  }
  const uint32_t bits = exponent == 31 ? sign | 0x7F800000u | (mantissa << 13)
                                       : sign | ((exponent + 112) << 23) | (mantissa << 13);
  return std::bit_cast<float>(bits);
}

// fp32 to IEEE half, rounded to nearest even; past the range, infinity.
uint16_t ToHalf(float x) {
  const uint32_t u = std::bit_cast<uint32_t>(x);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000);
  const uint32_t magnitude = u & 0x7FFFFFFFu;
  if (magnitude > 0x7F800000u) return uint16_t(sign | 0x7E00);  // NaN
  if (magnitude >= 0x477FF000u) return uint16_t(sign | 0x7C00);  // rounds past 65504: infinity
  if (magnitude < 0x38800000u) {  // below half's smallest normal: a subnormal multiple of 2^-24
    const float scaled = std::bit_cast<float>(magnitude) * 16777216.0f;
    return uint16_t(sign | uint16_t(std::nearbyint(scaled)));
  }
  const uint32_t rounded = magnitude + 0xFFFu + ((magnitude >> 13) & 1);  // to nearest even at bit 13
  return uint16_t(sign | uint16_t((rounded - 0x38000000u) >> 13));
}

std::string SystemError(int err) { return std::strerror(err); }

// A JSON value in a message: its first 80 bytes.
std::string Brief(const Json& value) {
  const std::string text = value.dump();
  return text.size() <= 80 ? text : text.substr(0, 77) + "...";
}

// Reads `size` bytes at `offset` of fd; false on a short read or error (errno set).
bool ReadAt(int fd, void* into, size_t size, uint64_t offset) {
  char* at = static_cast<char*>(into);
  while (size > 0) {
    const ssize_t n = ::pread(fd, at, size, off_t(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      if (n == 0) errno = EIO;
      return false;
    }
    at += n, size -= size_t(n), offset += uint64_t(n);
  }
  return true;
}

}  // namespace

std::string_view DtypeName(Dtype dtype) {
  switch (dtype) {
    case Dtype::kF32: return "F32";
    case Dtype::kF16: return "F16";
    case Dtype::kBF16: return "BF16";
  }
  return "?";
}

int DtypeBytes(Dtype dtype) { return dtype == Dtype::kF32 ? 4 : 2; }

Dtype DtypeNamed(std::string_view name) {
  std::string upper(name);
  std::transform(upper.begin(), upper.end(), upper.begin(), [](unsigned char c) { return char(std::toupper(c)); });
  for (Dtype d : {Dtype::kF32, Dtype::kF16, Dtype::kBF16}) {
    if (DtypeName(d) == upper) return d;
  }
  throw std::invalid_argument("dtype " + std::string(name) + ": f32, bf16 or f16 expected");
}

int64_t TensorEntry::elements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

SafetensorsHeader ParseSafetensorsHeader(std::string_view text, uint64_t data_begin, uint64_t data_size,
                                         const std::string& path) {
  // Each name once: of a key given twice, JSON's objects keep one value.
  std::set<std::string> names;
  const Json::parser_callback_t once = [&](int depth, Json::parse_event_t event, Json& parsed) {
    if (event == Json::parse_event_t::key && depth == 1) {
      const std::string& name = parsed.get_ref<const std::string&>();
      if (!names.insert(name).second) {
        throw SafetensorsError(path + ": " + (name == "__metadata__" ? std::string("__metadata__") : "tensor " + name) +
                               " is given twice in the header");
      }
    }
    return true;
  };
  Json header;
  try {
    header = api::ParseModelJson(text, path, once);
  } catch (const api::ModelJsonError& e) {
    throw SafetensorsError(path + ": header is " + e.reason());
  }
  if (!header.is_object()) throw SafetensorsError(path + ": header is not a JSON object");
  SafetensorsHeader out;
  struct Range {
    uint64_t begin, end;
    std::string name;
  };
  std::vector<Range> ranges;
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object()) throw SafetensorsError(path + ": __metadata__ is not an object of strings: " + Brief(entry));
      for (const auto& [key, value] : entry.items()) {
        if (!value.is_string()) {
          throw SafetensorsError(path + ": __metadata__ key \"" + key + "\" is not a string: " + Brief(value));
        }
        out.metadata.emplace(key, value.get<std::string>());
      }
      continue;
    }
    const std::string where = path + ": tensor " + name;
    if (!entry.is_object()) {
      throw SafetensorsError(where + ": expected {\"dtype\", \"shape\", \"data_offsets\"}, got " + Brief(entry));
    }
    if (!entry.contains("dtype") || !entry["dtype"].is_string()) throw SafetensorsError(where + ": has no dtype string");
    const std::string& dtype = entry["dtype"].get_ref<const std::string&>();
    TensorEntry t;
    if (dtype == "F32") t.dtype = Dtype::kF32;
    else if (dtype == "F16") t.dtype = Dtype::kF16;
    else if (dtype == "BF16") t.dtype = Dtype::kBF16;
    else throw SafetensorsError(where + ": dtype " + dtype + " is not one meshtrain reads (F32, F16 or BF16)");
    const Json shape = entry.contains("shape") ? entry["shape"] : Json();
    if (!shape.is_array()) throw SafetensorsError(where + ": has no shape list");
    uint64_t count = 1;
    for (const Json& d : shape) {
      const uint64_t dim = d.is_number_unsigned() ? d.get<uint64_t>() : kMaxElements + 1;
      if (dim > kMaxElements || (dim > 0 && count > kMaxElements / dim)) {
        throw SafetensorsError(where + ": shape " + Brief(shape) + " is not a tensor's");
      }
      t.shape.push_back(int64_t(dim));
      count *= dim;
    }
    const Json offsets = entry.contains("data_offsets") ? entry["data_offsets"] : Json();
    if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() ||
        !offsets[1].is_number_unsigned()) {
      throw SafetensorsError(where + ": data_offsets " + Brief(offsets) + " is not [begin, end]");
    }
    const uint64_t begin = offsets[0].get<uint64_t>(), end = offsets[1].get<uint64_t>();
    if (begin > end || end > data_size || end - begin != count * uint64_t(DtypeBytes(t.dtype))) {
      throw SafetensorsError(where + ": data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) +
                             ") do not hold " + std::to_string(count) + " " + dtype + " values in " +
                             std::to_string(data_size) + " bytes of data");
    }
    t.offset = data_begin + begin;
    out.tensors.emplace(name, std::move(t));
    if (begin < end) ranges.push_back({begin, end, name});
  }
  // No two tensors share a byte: in order of their first bytes, each starts at or after
  // the furthest end before it.
  std::sort(ranges.begin(), ranges.end(),
            [](const Range& a, const Range& b) { return a.begin != b.begin ? a.begin < b.begin : a.name < b.name; });
  const Range* furthest = nullptr;
  for (const Range& r : ranges) {
    if (furthest != nullptr && r.begin < furthest->end) {
      throw SafetensorsError(path + ": tensor " + r.name + ": data_offsets [" + std::to_string(r.begin) + ", " +
                             std::to_string(r.end) + ") overlap tensor " + furthest->name + "'s [" +
                             std::to_string(furthest->begin) + ", " + std::to_string(furthest->end) + ")");
    }
    if (furthest == nullptr || r.end > furthest->end) furthest = &r;
  }
  return out;
}

std::map<std::string, std::string> ParseSafetensorsIndex(std::string_view text, const std::string& path) {
  Json j;
  try {
    j = api::ParseModelJson(text, path);
  } catch (const api::ModelJsonError& e) {
    throw SafetensorsError(e.what());
  }
  if (!j.is_object() || !j.contains("weight_map") || !j.at("weight_map").is_object()) {
    throw SafetensorsError(path + ": has no weight_map object");
  }
  std::map<std::string, std::string> files;
  for (const auto& [tensor, file] : j.at("weight_map").items()) {
    if (!file.is_string()) throw SafetensorsError(path + ": weight_map's " + tensor + " is not a file name");
    const std::string name = file.get<std::string>();
    if (name.empty() || name.find('/') != std::string::npos || name == "." || name == "..") {
      throw SafetensorsError(path + ": weight_map's " + tensor + " names \"" + name + "\", not a file beside it");
    }
    files[tensor] = name;
  }
  return files;
}

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
  if (NotARegularFile(path)) throw SafetensorsError(path + ": is not a regular file");
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_ < 0) throw SafetensorsError(path + ": missing or unreadable (" + SystemError(errno) + ")");
  struct stat st {};
  if (::fstat(fd_, &st) != 0) {
    ::close(fd_);
    throw SafetensorsError(path + ": cannot stat (" + SystemError(errno) + ")");
  }
  const uint64_t file_size = uint64_t(st.st_size);
  try {
    unsigned char length[8];
    if (file_size < 8 || !ReadAt(fd_, length, 8, 0)) throw SafetensorsError(path + ": too short for a safetensors header");
    uint64_t header_size = 0;
    for (int i = 7; i >= 0; --i) header_size = header_size << 8 | length[i];
    if (header_size > kMaxHeader || header_size > file_size - 8) {
      throw SafetensorsError(path + ": header of " + std::to_string(header_size) + " bytes does not fit the file");
    }
    std::string text(header_size, '\0');
    if (!ReadAt(fd_, text.data(), header_size, 8)) throw SafetensorsError(path + ": cannot read its header");
    SafetensorsHeader header = ParseSafetensorsHeader(text, 8 + header_size, file_size - 8 - header_size, path);
    tensors_ = std::move(header.tensors);
    metadata_ = std::move(header.metadata);
  } catch (...) {
    ::close(fd_);
    throw;
  }
}

SafetensorsFile::~SafetensorsFile() {
  if (fd_ >= 0) ::close(fd_);
}

void SafetensorsFile::Read(const std::string& name, const TensorEntry& t, int64_t first, int64_t count,
                           float* values) const {
  const int element = DtypeBytes(t.dtype);
  // In pieces of at most 16 MiB of file bytes, converted as they come.
  constexpr int64_t kPiece = int64_t(1) << 22;
  thread_local std::vector<unsigned char> raw;
  for (int64_t done = 0; done < count;) {
    const int64_t n = std::min(kPiece, count - done);
    raw.resize(size_t(n * element));
    if (!ReadAt(fd_, raw.data(), raw.size(), t.offset + uint64_t(first + done) * uint64_t(element))) {
      throw SafetensorsError(path_ + ": tensor " + name + ": cannot read (" + SystemError(errno) + ")");
    }
    float* out = values + done;
    const unsigned char* in = raw.data();
    for (int64_t i = 0; i < n; ++i) {
      if (t.dtype == Dtype::kF32) {
        uint32_t bits = 0;
        for (int b = 3; b >= 0; --b) bits = bits << 8 | in[4 * i + b];
        out[i] = std::bit_cast<float>(bits);
      } else {
        const uint16_t half = uint16_t(in[2 * i] | in[2 * i + 1] << 8);
        out[i] = t.dtype == Dtype::kBF16 ? std::bit_cast<float>(uint32_t(half) << 16) : FromHalf(half);
      }
    }
    done += n;
  }
}

std::map<std::string, Tensor> ReadSafetensors(const std::string& path) {
  const SafetensorsFile file(path);
  std::map<std::string, Tensor> tensors;
  for (const auto& [name, entry] : file.tensors()) {
    Tensor t{entry.shape, std::vector<float>(size_t(entry.elements()))};
    file.Read(name, entry, 0, entry.elements(), t.values.data());
    tensors.emplace(name, std::move(t));
  }
  return tensors;
}

namespace {

std::string HeaderText(const std::vector<SafetensorsWriter::Entry>& tensors, Dtype dtype,
                       const std::map<std::string, std::string>& metadata) {
  Json header = Json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const SafetensorsWriter::Entry& t : tensors) {
    uint64_t count = 1;
    for (int64_t d : t.shape) count *= uint64_t(d);
    const uint64_t bytes = count * uint64_t(DtypeBytes(dtype));
    header[t.name] = {{"dtype", DtypeName(dtype)}, {"shape", t.shape}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the data starts 8-byte aligned, as the format advises
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[size_t(i)] = char((uint64_t(text.size()) >> (8 * i)) & 0xFF);
  return out + text;
}

}  // namespace

uint64_t SafetensorsWriter::Bytes(const std::vector<Entry>& tensors, Dtype dtype,
                                  const std::map<std::string, std::string>& metadata) {
  uint64_t values = 0;
  for (const Entry& t : tensors) {
    uint64_t count = 1;
    for (int64_t d : t.shape) count *= uint64_t(d);
    values += count;
  }
  return HeaderText(tensors, dtype, metadata).size() + values * uint64_t(DtypeBytes(dtype));
}

SafetensorsWriter::SafetensorsWriter(std::string path, std::vector<Entry> tensors, Dtype dtype,
                                     const std::map<std::string, std::string>& metadata)
    : path_(std::move(path)), temporary_(path_ + ".tmp-" + std::to_string(::getpid())), dtype_(dtype) {
  for (const Entry& t : tensors) {
    uint64_t count = 1;
    for (int64_t d : t.shape) count *= uint64_t(d);
    expected_ += count;
  }
  fd_ = ::open(temporary_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) throw SafetensorsError(path_ + ": cannot create " + temporary_ + " (" + SystemError(errno) + ")");
  const std::string header = HeaderText(tensors, dtype, metadata);
  buffer_.assign(header.begin(), header.end());
}

SafetensorsWriter::~SafetensorsWriter() {
  if (fd_ >= 0) {
    ::close(fd_);
    ::unlink(temporary_.c_str());
  }
}

void SafetensorsWriter::Flush() {
  const char* at = buffer_.data();
  size_t left = buffer_.size();
  while (left > 0) {
    const ssize_t n = ::write(fd_, at, left);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw SafetensorsError(path_ + ": cannot write " + temporary_ + " (" + SystemError(errno) + ")");
    at += n, left -= size_t(n);
  }
  buffer_.clear();
}

void SafetensorsWriter::Append(const float* values, int64_t count) {
  if (written_ + uint64_t(count) > expected_) throw std::logic_error("SafetensorsWriter: more values than the header holds");
  const int element = DtypeBytes(dtype_);
  for (int64_t i = 0; i < count; ++i) {
    uint32_t bits = 0;
    if (dtype_ == Dtype::kF32) bits = std::bit_cast<uint32_t>(values[i]);
    else if (dtype_ == Dtype::kBF16) bits = runtime::bf16::FromFloat(values[i]);
    else bits = ToHalf(values[i]);
    for (int b = 0; b < element; ++b) buffer_.push_back(char((bits >> (8 * b)) & 0xFF));
    if (buffer_.size() >= (size_t(1) << 22)) Flush();
  }
  written_ += uint64_t(count);
}

void SafetensorsWriter::Finish() {
  if (written_ != expected_) {
    throw std::logic_error("SafetensorsWriter: " + std::to_string(written_) + " of " + std::to_string(expected_) +
                           " values written");
  }
  Flush();
  if (::fsync(fd_) != 0 || ::close(fd_) != 0) {
    const int err = errno;
    fd_ = -1;
    ::unlink(temporary_.c_str());
    throw SafetensorsError(path_ + ": cannot write " + temporary_ + " (" + SystemError(err) + ")");
  }
  fd_ = -1;
  if (::rename(temporary_.c_str(), path_.c_str()) != 0) {
    const int err = errno;
    ::unlink(temporary_.c_str());
    throw SafetensorsError(path_ + ": cannot rename " + temporary_ + " into place (" + SystemError(err) + ")");
  }
}

void WriteSafetensors(const std::string& path, const std::map<std::string, Tensor>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  std::vector<SafetensorsWriter::Entry> entries;
  for (const auto& [name, t] : tensors) entries.push_back({name, t.shape});
  SafetensorsWriter writer(path, entries, Dtype::kF32, metadata);
  for (const auto& [name, t] : tensors) writer.Append(t.values.data(), int64_t(t.values.size()));
  writer.Finish();
}

}  // namespace meshtrain::train
