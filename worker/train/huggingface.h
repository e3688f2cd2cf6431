// Hugging Face weights in and out, for every family (api/model_family.h names each
// tensor as transformers does and says which it stores transposed: GPT-2's Conv1D).
//
// In: a model directory, with config.json and either model.safetensors or
// model.safetensors.index.json and the shards it names, in F32, BF16 or F16; or a
// family's one-file form (api::ModelFamily::ShapeOfSingleFile: GPT-2's, its names with or
// without GPT2LMHeadModel's body prefix). Every tensor is checked by name, shape and dtype when the files are opened,
// and its values as they are read: each rank reads only the elements it holds, one unit
// at a time, straight from the files.
//
// Out: a directory that transformers' from_pretrained loads: config.json, and safetensors
// of at most a given size (model.safetensors, or model-0000k-of-0000n.safetensors with
// model.safetensors.index.json), names, shapes and the [out, in] layout as transformers
// writes them, the model's own vocabulary, a tied head once; or, for GPT-2, one file.
// Thread-safety: a reader may be used from one thread at a time; plain functions.

#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "api/model_shape.h"
#include "worker/model/parameters.h"
#include "worker/train/safetensors.h"

namespace meshtrain::train {

class HuggingFaceWeights {
 public:
  // Opens the files at `path` (a directory or one file) for a model of `shape`. Throws
  // SafetensorsError naming the file and the tensor: a shard the index names that is
  // missing, a tensor missing, of another shape, of a dtype meshtrain does not read, or
  // not part of the family's model.
  HuggingFaceWeights(const std::string& path, const api::ModelShape& shape);
  ~HuggingFaceWeights();

  // master[i] = the weight at whole_indices[i] of unit `unit` (single-rank indices,
  // parameters.h; -1: 0), read from the files. Throws SafetensorsError naming the tensor
  // and the element for a value that is NaN or infinite.
  void ReadUnit(int unit, const std::vector<int64_t>& whole_indices, float* master) const;
  // The whole model in single-rank order (for tests and one-rank tools).
  std::vector<float> ReadAll() const;
  // Bytes read from the files so far.
  int64_t bytes_read() const { return bytes_read_; }

 private:
  struct Source;
  const Source& SourceOf(const model::ParamTensor& t) const;

  std::string path_;
  model::ParameterLayout whole_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::vector<Source> sources_;  // one per tensor of whole_
  mutable int64_t bytes_read_ = 0;
};

// The shape of the model at `path`: a directory's from its config.json, with seqLen its
// maximum (api::HuggingFaceConfig); a one-file form's from its tensors' names and sizes, by
// its family (api::ShapeOfSingleFile), with heads of `head_dim` channels, which such files
// do not record. Throws SafetensorsError or
// api::HuggingFaceConfigError naming the file.
api::ModelShape HuggingFaceShape(const std::string& path, int64_t head_dim = 64);

// The weights of a model of `shape`, in single-rank order, from `path` (HuggingFaceWeights).
std::vector<float> LoadHuggingFace(const std::string& path, const api::ModelShape& shape);

// What an export reads the weights from: values[i] = the master weight at single-rank
// index first + i of unit `unit`, for i < count.
using WeightReader = std::function<void(int unit, int64_t first, int64_t count, float* values)>;

// What an export writes besides the weights.
struct ExportOptions {
  Dtype dtype = Dtype::kF32;
  uint64_t max_shard_bytes = 5'000'000'000;
  // A model directory of the same model (the one training started from): the keys of its
  // config.json that the shape does not set (token ids, ...) go into the export's, and its
  // tokenizer and generation files are copied. Empty: none.
  std::string like;
};

// The files of a model directory an export copies from ExportOptions::like.
inline constexpr const char* kCompanionFiles[] = {
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "generation_config.json", "vocab.json", "merges.txt"};

// Writes a Hugging Face model directory of `shape` at `directory` (which must not exist):
// config.json and safetensors in options.dtype, none larger than options.max_shard_bytes;
// a tensor's values are read through `read` a part at a time. Built in a temporary
// directory beside it and renamed into place: a failure leaves nothing. Returns the
// safetensors files' names. Throws SafetensorsError naming the path, also for a `like`
// directory of another model.
std::vector<std::string> ExportHuggingFace(const std::string& directory, const api::ModelShape& shape,
                                           const ExportOptions& options, const WeightReader& read);

// Writes `weights` (single-rank order) as one F32 safetensors file at `path`, without
// config.json: the one-file form of a family that has one (api::ModelFamily::
// HasSingleFileForm), which HuggingFaceShape and LoadHuggingFace read back.
void SaveSingleFile(const std::string& path, const std::vector<float>& weights, const api::ModelShape& shape);

}  // namespace meshtrain::train
