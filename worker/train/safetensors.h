// The safetensors file format (Hugging Face): an 8-byte little-endian header length N, N
// bytes of JSON {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__":
// {string: string}}, then the tensors' little-endian bytes, offsets relative to the end of
// the header. Read as fp32 from F32, F16 or BF16, any range of a tensor's elements at a
// time, so that a rank reads only the rows it holds of a model no host could hold whole;
// written from fp32 as F32, BF16 (rounded to nearest even) or F16, a tensor at a time.
// Thread-safety: a SafetensorsFile may be read from several threads at once (pread); a
// writer is used by one thread.

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

// An open safetensors file: its header read and checked, its data read on demand.
class SafetensorsFile {
 public:
  // Throws SafetensorsError naming `path`: not a regular file, unreadable, a header that is
  // not safetensors', a dtype other than F32, F16 and BF16, or data past the file's end.
  explicit SafetensorsFile(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const std::map<std::string, TensorEntry>& tensors() const { return tensors_; }
  // values[i] = element first + i of `t` (one of tensors()) as fp32, for i < count.
  // Throws SafetensorsError naming the file and `name` if the read fails.
  void Read(const std::string& name, const TensorEntry& t, int64_t first, int64_t count, float* values) const;

 private:
  std::string path_;
  int fd_ = -1;
  std::map<std::string, TensorEntry> tensors_;
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
