// The safetensors file format (Hugging Face): an 8-byte little-endian header length N, N
// bytes of JSON {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__":
// {string: string}}, then the tensors' little-endian bytes, offsets relative to the end of
// the header. Read here as fp32 (from F32, F16 or BF16); written as F32.
// Thread-safety: plain functions.

#pragma once

#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

namespace meshtrain::train {

// A file that is not valid safetensors, or lacks what the caller needs: the message names
// the file and, where there is one, the tensor.
class SafetensorsError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct Tensor {
  std::vector<int64_t> shape;
  std::vector<float> values;  // row-major, product(shape) elements
};

// Every tensor of the file at `path`, converted to fp32.
std::map<std::string, Tensor> ReadSafetensors(const std::string& path);

// Writes `tensors` (in name order, as the format sorts nothing itself) as F32, with
// `metadata` in the header, through a temporary file renamed over `path` (a file already
// there is replaced whole or not at all); throws SafetensorsError naming the path and the
// system's reason if it cannot.
void WriteSafetensors(const std::string& path, const std::map<std::string, Tensor>& tensors,
                      const std::map<std::string, std::string>& metadata = {});

}  // namespace meshtrain::train
