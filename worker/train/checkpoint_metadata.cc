#include "worker/train/checkpoint_metadata.h"

#include <cstdint>
#include <cstdio>
#include <filesystem>

namespace meshtrain::train {

using Json = nlohmann::json;

namespace {

// The path of the first number in `value` that is not an integer ("" if none). Metadata
// holds only integers, and casting a fraction or a number past 2^64 (which JSON parsing
// makes a double) to an integer would be undefined.
std::string FirstNonInteger(const Json& value, const std::string& path) {
  if (value.is_number_float()) return path.empty() ? "/" : path;
  if (value.is_object()) {
    for (const auto& [key, item] : value.items())
      if (std::string found = FirstNonInteger(item, path + "/" + key); !found.empty()) return found;
  } else if (value.is_array()) {
    for (size_t i = 0; i < value.size(); ++i)
      if (std::string found = FirstNonInteger(value[i], path + "/" + std::to_string(i)); !found.empty()) return found;
  }
  return "";
}

}  // namespace

std::string CheckpointRankFile(int rank) {
  char name[32];
  std::snprintf(name, sizeof name, "rank-%05d.bin", rank);
  return name;
}

Json CheckpointShapeJson(const api::ModelShape& s) {
  return {{"layers", s.layers}, {"heads", s.heads}, {"hidden", s.hidden}, {"vocabSize", s.vocab_size},
          {"seqLen", s.seq_len}};
}

Json ParseCheckpointMetadata(const std::string& text, const std::string& file_name, const api::ModelShape& shape) {
  const std::filesystem::path file(file_name);
  Json meta;
  try {
    meta = Json::parse(text);
  } catch (const Json::exception& e) {
    throw CheckpointError(file.string() + ": not valid JSON: " + e.what());
  }
  if (const std::string path = FirstNonInteger(meta, ""); !path.empty())
    throw CheckpointError(file.string() + ": malformed metadata: " + path + " is not an integer in range");
  try {
    if (meta.at("format") != kCheckpointFormat || meta.at("version").get<int>() < 1 || meta.at("version").get<int>() > kCheckpointVersion) {
      throw CheckpointError(file.string() + ": not a meshtrain checkpoint of format version 1 to " +
                            std::to_string(kCheckpointVersion));
    }
    if (meta.value("vocabMultiple", 1) < 1) throw CheckpointError(file.string() + ": vocabMultiple must be positive");
    if (meta.at("model") != CheckpointShapeJson(shape)) {
      throw CheckpointError(file.string() + ": a checkpoint of another model (" + meta.at("model").dump() +
                            "), not of " + CheckpointShapeJson(shape).dump());
    }
    // A checkpoint is written after a step, so of step 1 or later; a step past 2^63 or a
    // negative position would wrap in the casts below.
    if (const Json& step = meta.at("step"); !step.is_number_unsigned() || step.get<uint64_t>() < 1 ||
                                            step.get<uint64_t>() > uint64_t(INT64_MAX)) {
      throw CheckpointError(file.string() + ": step " + step.dump() + " is not a step a checkpoint is written at (1 or later)");
    }
    if (const Json& position = meta.at("dataPosition"); !position.is_number_unsigned()) {
      throw CheckpointError(file.string() + ": dataPosition " + position.dump() + " is not a position in the data (0 or more)");
    }
    const Json& layout = meta.at("layout");
    const int tp = layout.at("tp"), shard = layout.at("shard"), replicas = layout.at("replicas");
    if (tp < 1 || shard < 1 || replicas < 1) throw CheckpointError(file.string() + ": layout sizes must be positive");
    for (const Json& f : meta.at("files")) {
      const std::string name = f.at("name").get<std::string>();
      // Only this directory's own shard files: a name cannot lead elsewhere.
      if (name != CheckpointRankFile(f.at("rank").get<int>())) {
        throw CheckpointError(file.string() + ": file name \"" + name + "\" is not the shard file of rank " +
                              std::to_string(f.at("rank").get<int>()));
      }
      if (f.at("bytes").get<int64_t>() < 0) throw CheckpointError(file.string() + ": " + name + " has a negative size");
      if (meta.at("version").get<int>() >= 3) {
        if (f.at("chunkElements").get<int64_t>() < 1) {
          throw CheckpointError(file.string() + ": " + name + " has chunks of no elements");
        }
        f.at("chunkCrc32c").get<std::vector<uint32_t>>();
      } else {
        f.at("crc32c").get<uint32_t>();
      }
      const int t = f.at("tp"), s = f.at("shard");
      if (t < 0 || t >= tp || s < 0 || s >= shard) {
        throw CheckpointError(file.string() + ": file " + name + " sits outside the layout");
      }
    }
  } catch (const Json::exception& e) {
    throw CheckpointError(file.string() + ": malformed metadata: " + e.what());
  }
  return meta;
}

}  // namespace meshtrain::train
