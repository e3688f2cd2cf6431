#include "worker/train/huggingface.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "api/model_family.h"
#include "api/hf_config.h"
#include "worker/train/atomic_file.h"

namespace meshtrain::train {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

constexpr const char* kIndex = "model.safetensors.index.json";
constexpr const char* kSingle = "model.safetensors";

// Hugging Face's name and storage of each tensor of `layout` (single-rank), in its order.
struct HfTensor {
  std::string name;
  bool transposed = false;
  std::string sizes;  // config.json's keys that size it
};
std::vector<HfTensor> HfTensorsOf(const model::ParameterLayout& layout) {
  const api::FamilyTensors f = api::TensorsOf(layout.shape());
  std::vector<HfTensor> names;
  for (const api::TensorInfo& t : f.embedding) names.push_back({api::HuggingFaceName(t, -1), t.hf_transposed, t.hf_sizes});
  for (int l = 0; l < layout.blocks(); ++l) {
    for (const api::TensorInfo& t : f.Block(layout.shape(), l)) {
      names.push_back({api::HuggingFaceName(t, l), t.hf_transposed, t.hf_sizes});
    }
  }
  for (const api::TensorInfo& t : f.head) names.push_back({api::HuggingFaceName(t, -1), t.hf_transposed, t.hf_sizes});
  return names;
}

std::vector<int64_t> HfShape(const model::ParamTensor& t, bool transposed) {
  return transposed ? std::vector<int64_t>{t.shape[1], t.shape[0]} : t.shape;
}

// out (cols, rows) = in (rows, cols) transposed: between GPT-2's Conv1D (in, out) and ours.
void Transpose(const float* in, int64_t rows, int64_t cols, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) out[c * rows + r] = in[r * cols + c];
  }
}

// The metadata transformers writes in its safetensors files.
const std::map<std::string, std::string> kMetadata = {{"format", "pt"}};

std::string ShapeText(const std::vector<int64_t>& shape) {
  std::string text = "[";
  for (size_t i = 0; i < shape.size(); ++i) text += (i ? ", " : "") + std::to_string(shape[i]);
  return text + "]";
}

bool IsDirectory(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

bool Exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

std::string ReadText(const std::string& path) {
  if (NotARegularFile(path)) throw SafetensorsError(path + ": is not a regular file");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw SafetensorsError(path + ": missing or unreadable");
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// The safetensors files of `path` and, for an index, which file holds each tensor.
struct Files {
  std::vector<std::string> paths;
  std::map<std::string, std::string> index;  // tensor -> file path; empty without an index
  std::string index_path;
};

Files FilesOf(const std::string& path) {
  Files files;
  if (!IsDirectory(path)) {
    files.paths.push_back(path);
    return files;
  }
  const std::string index = path + "/" + kIndex;
  if (!Exists(index)) {
    if (!Exists(path + "/" + kSingle)) {
      throw SafetensorsError(path + ": holds neither " + std::string(kSingle) + " nor " + kIndex);
    }
    files.paths.push_back(path + "/" + kSingle);
    return files;
  }
  files.index_path = index;
  std::set<std::string> names;
  for (const auto& [tensor, name] : ParseSafetensorsIndex(ReadText(index), index)) {
    files.index[tensor] = path + "/" + name;
    names.insert(name);
  }
  for (const std::string& name : names) {
    const std::string file = path + "/" + name;
    if (!Exists(file)) throw SafetensorsError(index + ": names the shard " + name + ", which is missing");
    files.paths.push_back(file);
  }
  return files;
}

}  // namespace

struct HuggingFaceWeights::Source {
  const SafetensorsFile* file = nullptr;
  std::string name;
  const TensorEntry* entry = nullptr;
  bool transposed = false;
};

HuggingFaceWeights::HuggingFaceWeights(const std::string& path, const api::ModelShape& shape)
    : path_(path), whole_(shape) {
  const Files files = FilesOf(path);
  struct Found {
    const SafetensorsFile* file;
    std::string name;
    const TensorEntry* entry;
  };
  std::map<std::string, Found> found;  // by Hugging Face name, GPT-2's prefix taken off
  const std::string_view prefix = whole_.shape().Family().BodyPrefix();  // GPT-2's "transformer."
  for (const std::string& file_path : files.paths) {
    files_.push_back(std::make_unique<SafetensorsFile>(file_path));
    const SafetensorsFile& file = *files_.back();
    for (const auto& [name, entry] : file.tensors()) {
      if (!files.index.empty()) {
        const auto in_index = files.index.find(name);
        if (in_index == files.index.end() || in_index->second != file_path) continue;  // the index says another file
      }
      std::string ours = name;
      if (!prefix.empty() && ours.starts_with(prefix)) ours = ours.substr(prefix.size());
      found[ours] = {&file, name, &entry};
    }
  }
  for (const auto& [tensor, file_path] : files.index) {
    bool held = false;
    for (const auto& f : files_) held = held || (f->path() == file_path && f->tensors().contains(tensor));
    if (!held) throw SafetensorsError(files.index_path + ": names " + tensor + " in " + file_path + ", which does not hold it");
  }
  const std::vector<HfTensor> names = HfTensorsOf(whole_);
  std::set<std::string> used;
  for (size_t i = 0; i < whole_.tensors().size(); ++i) {
    const model::ParamTensor& t = whole_.tensors()[i];
    const HfTensor& hf = names[i];
    const auto it = found.find(hf.name);
    if (it == found.end()) throw SafetensorsError(path + ": tensor " + hf.name + " is missing");
    const std::vector<int64_t> want = HfShape(t, hf.transposed);
    if (it->second.entry->shape != want) {
      throw SafetensorsError(it->second.file->path() + ": tensor " + it->second.name + " has shape " +
                             ShapeText(it->second.entry->shape) + ", but spec.model needs " + ShapeText(want) +
                             (hf.sizes.empty() ? "" : " (config.json's " + hf.sizes + ")"));
    }
    sources_.push_back({it->second.file, it->second.name, it->second.entry, hf.transposed});
    used.insert(hf.name);
  }
  for (const auto& [name, f] : found) {
    if (!used.contains(name) && !api::IgnoredOnImport(whole_.shape(), f.name)) {
      throw SafetensorsError(f.file->path() + ": tensor " + f.name + " is not part of a " +
                             std::string(whole_.shape().Family().title()) + " of this shape");
    }
  }
}

HuggingFaceWeights::~HuggingFaceWeights() = default;

void HuggingFaceWeights::ReadUnit(int unit, const std::vector<int64_t>& whole_indices, float* master) const {
  const auto [unit_begin, unit_end] = whole_.Unit(unit);
  const auto [first_tensor, last_tensor] = whole_.UnitTensors(unit);
  std::vector<float> transposed;  // a Conv1D tensor read whole, once
  size_t transposed_of = SIZE_MAX;
  for (size_t i = 0; i < whole_indices.size();) {
    const int64_t at = whole_indices[i];
    if (at < 0) {
      master[i++] = 0;
      continue;
    }
    if (at < unit_begin || at >= unit_end) throw std::out_of_range("ReadUnit: an index outside the unit");
    size_t id = first_tensor;
    while (id + 1 < last_tensor && whole_.tensors()[id + 1].offset <= at) ++id;
    const model::ParamTensor& t = whole_.tensors()[id];
    const Source& source = sources_[id];
    // The run of consecutive indices inside this tensor.
    size_t j = i + 1;
    while (j < whole_indices.size() && whole_indices[j] == whole_indices[j - 1] + 1 &&
           whole_indices[j] < t.offset + t.size) {
      ++j;
    }
    const int64_t first = at - t.offset, count = int64_t(j - i);
    if (!source.transposed) {
      source.file->Read(source.name, *source.entry, first, count, master + i);
      bytes_read_ += count * DtypeBytes(source.entry->dtype);
    } else {
      if (transposed_of != id) {
        transposed.resize(size_t(t.size));
        source.file->Read(source.name, *source.entry, 0, t.size, transposed.data());
        bytes_read_ += t.size * DtypeBytes(source.entry->dtype);
        transposed_of = id;
      }
      const int64_t rows = t.shape[0], cols = t.shape[1];  // ours: (out, in); the file's (in, out)
      for (int64_t e = first; e < first + count; ++e) {
        master[i + size_t(e - first)] = transposed[size_t((e % cols) * rows + e / cols)];
      }
    }
    for (int64_t e = 0; e < count; ++e) {
      if (!std::isfinite(master[i + size_t(e)])) {
        const int64_t element = source.transposed ? ((first + e) % t.shape[1]) * t.shape[0] + (first + e) / t.shape[1]
                                                  : first + e;
        throw SafetensorsError(source.file->path() + ": tensor " + source.name + " holds " +
                               std::to_string(master[i + size_t(e)]) + " at element " + std::to_string(element) +
                               ": the weights are not finite");
      }
    }
    i = j;
  }
}

std::vector<float> HuggingFaceWeights::ReadAll() const {
  std::vector<float> weights(size_t(whole_.total()));
  for (int u = 0; u < whole_.units(); ++u) {
    const auto [begin, end] = whole_.Unit(u);
    std::vector<int64_t> at(size_t(end - begin));
    for (size_t i = 0; i < at.size(); ++i) at[i] = begin + int64_t(i);
    ReadUnit(u, at, weights.data() + begin);
  }
  return weights;
}

api::ModelShape HuggingFaceShape(const std::string& path, int64_t head_dim) {
  if (IsDirectory(path)) {
    api::ModelSpec model;
    for (const api::FieldError& e : api::MergeHuggingFaceConfig(api::ReadHuggingFaceConfig(path), &model)) {
      throw SafetensorsError(path + ": " + e.ToString());
    }
    return api::ShapeOf(model);
  }
  const SafetensorsFile file(path);  // the header is enough
  std::map<std::string, std::vector<int64_t>> sizes;
  for (const auto& [name, entry] : file.tensors()) sizes.emplace(name, entry.shape);
  try {
    return api::ShapeOfSingleFile(sizes, head_dim);
  } catch (const std::invalid_argument& e) {
    throw SafetensorsError(path + ": " + e.what());
  }
}

std::vector<float> LoadHuggingFace(const std::string& path, const api::ModelShape& shape) {
  return HuggingFaceWeights(path, shape).ReadAll();
}

std::vector<std::string> ExportHuggingFace(const std::string& directory, const api::ModelShape& shape,
                                           const ExportOptions& options, const WeightReader& read) {
  const Dtype dtype = options.dtype;
  const uint64_t max_shard_bytes = options.max_shard_bytes;
  if (Exists(directory)) throw SafetensorsError(directory + ": exists; an export writes a new directory");
  Json config = api::HuggingFaceConfigJson(
      shape, dtype == Dtype::kF32 ? "float32" : dtype == Dtype::kBF16 ? "bfloat16" : "float16");
  if (!options.like.empty()) {
    // The same model, or its token ids and tokenizer would be another's.
    try {
      api::ModelSpec theirs;
      theirs.seq_len = shape.seq_len;
      const api::HuggingFaceConfig like = api::ReadHuggingFaceConfig(options.like);
      const api::FieldErrors errors = api::MergeHuggingFaceConfig(like, &theirs);
      if (!errors.empty() || !api::ShapeOf(theirs).SameWeights(shape)) {
        throw SafetensorsError(options.like + ": --like names another model (" +
                               (errors.empty() ? api::DescribeShape(api::ShapeOf(theirs)) : errors.front().ToString()) +
                               ") than the checkpoint's (" + api::DescribeShape(shape) + ")");
      }
      const std::string like_config = options.like + "/config.json";
      const Json theirs_text = api::ParseModelJson(ReadText(like_config), like_config);
      for (const auto& [key, value] : theirs_text.items()) {
        if (!config.contains(key)) config[key] = value;
      }
    } catch (const api::HuggingFaceConfigError& e) {
      throw SafetensorsError(std::string("--like: ") + e.what());
    } catch (const api::ModelJsonError& e) {
      throw SafetensorsError(std::string("--like: ") + e.what());
    }
  }
  const model::ParameterLayout whole(shape);
  const std::vector<HfTensor> names = HfTensorsOf(whole);
  // Tensors in the layout's order, in files of at most max_shard_bytes, header included
  // (a larger tensor alone).
  std::vector<std::vector<size_t>> shards(1);
  std::vector<SafetensorsWriter::Entry> candidate;
  for (size_t id = 0; id < whole.tensors().size(); ++id) {
    candidate.push_back({names[id].name, HfShape(whole.tensors()[id], names[id].transposed)});
    if (!shards.back().empty() && SafetensorsWriter::Bytes(candidate, dtype, kMetadata) > max_shard_bytes) {
      shards.emplace_back();
      candidate = {candidate.back()};
    }
    shards.back().push_back(id);
  }
  const std::string temporary = directory + ".tmp-" + std::to_string(::getpid());
  std::error_code error;
  fs::remove_all(temporary, error);
  if (!fs::create_directories(temporary, error) || error) {
    throw SafetensorsError(directory + ": cannot create " + temporary + " (" + error.message() + ")");
  }
  struct Cleanup {
    std::string path;
    bool keep = false;
    ~Cleanup() {
      std::error_code ignored;
      if (!keep) fs::remove_all(path, ignored);
    }
  } cleanup{temporary};

  const std::string config_text = config.dump(2) + "\n";
  if (const std::string e = WriteFileAtomically(temporary + "/config.json", config_text.data(), config_text.size());
      !e.empty()) {
    throw SafetensorsError(directory + "/config.json: " + e);
  }
  for (const char* name : kCompanionFiles) {
    if (options.like.empty() || !Exists(options.like + "/" + name)) continue;
    fs::copy_file(options.like + "/" + name, temporary + "/" + name, error);
    if (error) throw SafetensorsError(directory + "/" + name + ": cannot copy from " + options.like + " (" + error.message() + ")");
  }
  std::vector<std::string> written;
  Json weight_map = Json::object();
  uint64_t total = 0;  // the tensors' data bytes, as transformers' index counts them
  std::vector<float> values, transposed;
  for (size_t k = 0; k < shards.size(); ++k) {
    char name[64];
    if (shards.size() == 1) std::snprintf(name, sizeof name, "%s", kSingle);
    else std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", k + 1, shards.size());
    std::vector<SafetensorsWriter::Entry> entries;
    for (size_t id : shards[k]) {
      entries.push_back({names[id].name, HfShape(whole.tensors()[id], names[id].transposed)});
      weight_map[names[id].name] = name;
    }
    SafetensorsWriter writer(temporary + "/" + name, entries, dtype, kMetadata);
    for (size_t id : shards[k]) {
      const model::ParamTensor& t = whole.tensors()[id];
      int unit = 0;
      while (whole.Unit(unit).second <= t.offset) ++unit;
      if (names[id].transposed) {
        values.resize(size_t(t.size));
        read(unit, t.offset, t.size, values.data());
        transposed.resize(values.size());
        Transpose(values.data(), t.shape[0], t.shape[1], transposed.data());
        writer.Append(transposed.data(), t.size);
        continue;
      }
      constexpr int64_t kPart = int64_t(1) << 22;
      for (int64_t first = 0; first < t.size; first += kPart) {
        const int64_t n = std::min(kPart, t.size - first);
        values.resize(size_t(n));
        read(unit, t.offset + first, n, values.data());
        writer.Append(values.data(), n);
      }
    }
    writer.Finish();
    for (size_t id : shards[k]) total += uint64_t(whole.tensors()[id].size) * uint64_t(DtypeBytes(dtype));
    written.push_back(name);
  }
  if (shards.size() > 1) {
    const std::string index = Json{{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}}.dump(2) + "\n";
    if (const std::string e = WriteFileAtomically(temporary + "/" + kIndex, index.data(), index.size()); !e.empty()) {
      throw SafetensorsError(directory + "/" + kIndex + ": " + e);
    }
  }
  fs::rename(temporary, directory, error);
  if (error) throw SafetensorsError(directory + ": cannot rename " + temporary + " into place (" + error.message() + ")");
  cleanup.keep = true;
  return written;
}

void SaveSingleFile(const std::string& path, const std::vector<float>& weights, const api::ModelShape& shape) {
  if (!shape.Family().HasSingleFileForm()) {
    throw SafetensorsError(path + ": " + std::string(shape.Family().title()) + " has no one-file form");
  }
  const model::ParameterLayout layout(shape);
  const std::vector<HfTensor> names = HfTensorsOf(layout);
  std::map<std::string, Tensor> tensors;
  for (size_t id = 0; id < layout.tensors().size(); ++id) {
    const model::ParamTensor& t = layout.tensors()[id];
    Tensor out{HfShape(t, names[id].transposed), std::vector<float>(size_t(t.size))};
    const float* in = weights.data() + t.offset;
    if (!names[id].transposed) {
      std::copy(in, in + t.size, out.values.begin());
    } else {
      Transpose(in, t.shape[0], t.shape[1], out.values.data());
    }
    tensors.emplace(names[id].name, std::move(out));
  }
  WriteSafetensors(path, tensors, kMetadata);
}

}  // namespace meshtrain::train
