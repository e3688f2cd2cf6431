// The safetensors file format (Hugging Face): an 8-byte little-endian header length N, N
// bytes of JSON {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__":
// {string: string}}, then the tensors' little-endian bytes, offsets relative to the end of
// the header. Read as fp32 from F32, F16 or BF16, any range of a tensor's elements at a
// time, so that a rank reads only the rows it holds of a model no host could hold whole;
// written from fp32 as F32, BF16 (rounded to nearest even) or F16, a tensor at a time.
//
// Files come from the internet. A header is refused, naming the file and the tensor or
// key, where the format's reference implementation (the safetensors crate) refuses it: a
// name given twice (JSON would keep one of the two), a __metadata__ that is not an object
// of strings, a shape that is not a list of non-negative integers, data_offsets that are
// not two integers holding exactly the tensor's bytes inside the data, or that overlap
// another tensor's; also a dtype other than F32, F16 and BF16, which meshtrain does not
// read, and JSON nested past api::kMaxModelJsonDepth (api/hf_config.h). Gaps between
// tensors' bytes, which the crate also refuses, are read: no tensor's values depend on them.
// A sharded model's model.safetensors.index.json maps each tensor to the file beside it
// that holds it (ParseSafetensorsIndex).
// Thread-safety: a SafetensorsFile may be read from several threads at once (pread); a
// writer is used by one thread; the parsers are pure functions.

#pragma once

#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace meshtrain::train {

// A file that is not valid safetensors, or lacks what the caller needs: the message names
// the file and, where there is one, the tensor.
class SafetensorsError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

enum class Dtype { kF32, kF16, kBF16 };
// "F32", "F16", "BF16"; and back, nullopt-like failure as an exception naming `where`.
std::string_view DtypeName(Dtype dtype);
int DtypeBytes(Dtype dtype);
// The dtype called `name` ("f32", "bf16", "f16" in any case); throws std::invalid_argument.
Dtype DtypeNamed(std::string_view name);

struct TensorEntry {
  Dtype dtype = Dtype::kF32;
  std::vector<int64_t> shape;
  uint64_t offset = 0;  // of its first byte in the file
  int64_t elements() const;
};

// A header's contents.
struct SafetensorsHeader {
  std::map<std::string, TensorEntry> tensors;
  std::map<std::string, std::string> metadata;  // __metadata__, empty without one
};

// The header JSON `text` of the file `path`, whose data of `data_size` bytes starts at
// byte `data_begin` (8 + the header's length; TensorEntry::offset counts from the file's
// start). Throws SafetensorsError naming `path` and the tensor or key: "PATH: tensor B:
// data_offsets [8, 24) overlap tensor A's [0, 16)"; for text that is not JSON, "PATH:
// header is not valid JSON at byte 3 (line 1, column 4): ...", places counted in the header.
SafetensorsHeader ParseSafetensorsHeader(std::string_view text, uint64_t data_begin, uint64_t data_size,
                                         const std::string& path);

// model.safetensors.index.json's weight map {"weight_map": {tensor: file}}: which file
// beside the index holds each tensor. Throws SafetensorsError naming `path` and the tensor
// for text that is not JSON, no weight_map object, or a file that is not a plain name
// (empty, ".", "..", or with a '/').
std::map<std::string, std::string> ParseSafetensorsIndex(std::string_view text, const std::string& path);

// An open safetensors file: its header read and checked, its data read on demand.
class SafetensorsFile {
 public:
  // Throws SafetensorsError naming `path`: not a regular file, unreadable, a header that is
  // not safetensors' (ParseSafetensorsHeader), or data past the file's end.
  explicit SafetensorsFile(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const std::map<std::string, TensorEntry>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // values[i] = element first + i of `t` (one of tensors()) as fp32, for i < count.
  // Throws SafetensorsError naming the file and `name` if the read fails.
  void Read(const std::string& name, const TensorEntry& t, int64_t first, int64_t count, float* values) const;

 private:
  std::string path_;
  int fd_ = -1;
  std::map<std::string, TensorEntry> tensors_;
  std::map<std::string, std::string> metadata_;
};

struct Tensor {
  std::vector<int64_t> shape;
  std::vector<float> values;  // row-major, product(shape) elements
};

// Every tensor of the file at `path`, converted to fp32.
std::map<std::string, Tensor> ReadSafetensors(const std::string& path);

// Writes a safetensors file a tensor at a time: the header names every tensor first, then
// Append gives each one's values in that order. Writes a temporary file beside `path` and
// renames it over `path` in Finish, so a failure (a full disk) leaves no part of a file.
class SafetensorsWriter {
 public:
  struct Entry {
    std::string name;
    std::vector<int64_t> shape;
  };
  SafetensorsWriter(std::string path, std::vector<Entry> tensors, Dtype dtype,
                    const std::map<std::string, std::string>& metadata = {});
  ~SafetensorsWriter();  // removes the temporary file if Finish did not run
  // The next `count` values, converted to the dtype.
  void Append(const float* values, int64_t count);
  // Checks every value came, fsyncs and renames into place.
  void Finish();
  // Bytes the file will hold, with `metadata` in its header.
  static uint64_t Bytes(const std::vector<Entry>& tensors, Dtype dtype,
                        const std::map<std::string, std::string>& metadata = {});

 private:
  void Flush();  // the buffer to the file

  std::string path_, temporary_;
  int fd_ = -1;
  Dtype dtype_;
  uint64_t expected_ = 0, written_ = 0;  // values
  std::vector<char> buffer_;
};

// Writes `tensors` (in name order) as F32 with `metadata`, atomically.
void WriteSafetensors(const std::string& path, const std::map<std::string, Tensor>& tensors,
                      const std::map<std::string, std::string>& metadata = {});

}  // namespace meshtrain::train
