#include "worker/train/checkpoint_metadata.h"

#include <cstdint>
#include <cstdio>
#include <filesystem>

#include "api/json_codec.h"
#include "api/model_family.h"

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

Json CheckpointShapeJson(const api::ModelShape& shape) {
  Json j = api::ToJson(api::SpecOfShape(shape));
  for (const char* choice : {"dropout", "init", "preset", "tokenizer"}) j.erase(choice);  // not the model's shape
  if (j.contains("ropeScaling")) {  // every field, as meshtrain has always written it
    const api::RopeScaling& r = shape.Resolved().rope_scaling;
    j["ropeScaling"]["lowFreqFactor"] = r.low_freq_factor;
    j["ropeScaling"]["highFreqFactor"] = r.high_freq_factor;
    j["ropeScaling"]["originalMaxPositions"] = r.original_max_positions;
  }
  return j;
}

api::ModelShape ShapeOfCheckpointJson(const Json& m, const std::string& file) {
  api::FieldErrors errors;
  api::ModelSpec spec = api::DecodeModelSpec(m, "model", &errors);
  std::erase_if(errors, [](const api::FieldError& e) { return e.type == api::FieldErrorType::kUnknownField; });
  if (!errors.empty()) throw CheckpointError(file + ": malformed metadata: " + errors.front().ToString());
  if (spec.family.empty()) spec.family = api::kDefaultFamily;
  const api::ModelFamily* family = api::FindFamily(spec.family);
  if (family == nullptr) throw CheckpointError(file + ": malformed metadata: unknown model family \"" + spec.family + "\"");
  if (spec.rope_scaling && spec.rope_scaling->type != "llama3") {  // metadata writes llama3's fields for every type
    spec.rope_scaling->low_freq_factor.reset();
    spec.rope_scaling->high_freq_factor.reset();
    spec.rope_scaling->original_max_positions.reset();
  }
  api::FieldChecker checked;  // the fields the family requires, as a job's
  family->Check(spec, checked);
  if (!checked.errors.empty()) {
    throw CheckpointError(file + ": malformed metadata: " + checked.errors.front().ToString());
  }
  if (!spec.max_positions) spec.max_positions = spec.seq_len;
  family->Default(&spec);
  if (!spec.layers || !spec.heads || !spec.hidden || !spec.vocab_size || !spec.seq_len) {
    throw CheckpointError(file + ": malformed metadata: model: layers, heads, hidden, vocabSize and seqLen are required");
  }
  return api::ShapeOf(spec);
}

Json ParseCheckpointMetadata(const std::string& text, const std::string& file_name, const api::ModelShape& shape) {
  const std::filesystem::path file(file_name);
  Json meta;
  try {
    meta = Json::parse(text);
  } catch (const Json::exception& e) {
    throw CheckpointError(file.string() + ": not valid JSON: " + e.what());
  }
  // Every number but the model's (its norm's epsilon, RoPE's theta) is an integer.
  Json integers = meta;
  if (integers.is_object()) integers.erase("model");
  if (const std::string path = FirstNonInteger(integers, ""); !path.empty())
    throw CheckpointError(file.string() + ": malformed metadata: " + path + " is not an integer in range");
  try {
    if (meta.at("format") != kCheckpointFormat || meta.at("version").get<int>() < 1 || meta.at("version").get<int>() > kCheckpointVersion) {
      throw CheckpointError(file.string() + ": not a meshtrain checkpoint of format version 1 to " +
                            std::to_string(kCheckpointVersion));
    }
    if (meta.value("vocabMultiple", 1) < 1) throw CheckpointError(file.string() + ": vocabMultiple must be positive");
    if (!ShapeOfCheckpointJson(meta.at("model"), file.string()).SameWeights(shape)) {
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
    // dataPosition counts windows of the data loader's seeded order, the only order there is.
    if (meta.value("dataOrder", Json()) != "windows") {
      throw CheckpointError(file.string() + ": dataOrder " + meta.value("dataOrder", Json()).dump() +
                            " is not \"windows\", the order dataPosition counts in");
    }
    const Json& layout = meta.at("layout");
    const int tp = layout.at("tp"), shard = layout.at("shard"), replicas = layout.at("replicas");
    const int stages = layout.value("pipeline", 1), experts = layout.value("expert", 1);
    if (tp < 1 || shard < 1 || replicas < 1 || stages < 1 || experts < 1) {
      throw CheckpointError(file.string() + ": layout sizes must be positive");
    }
    if (shard % experts != 0) {
      throw CheckpointError(file.string() + ": the layout splits the experts " + std::to_string(experts) +
                            " ways, which does not divide its " + std::to_string(shard) + " shards");
    }
    const int units = 2 + int(shape.layers);  // at most: the embedding's, the blocks', an untied head's
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
      const int t = f.at("tp"), s = f.at("shard"), stage = f.value("stage", 0);
      if (t < 0 || t >= tp || s < 0 || s >= shard || stage < 0 || stage >= stages) {
        throw CheckpointError(file.string() + ": file " + name + " sits outside the layout");
      }
      // A shard's experts are its place in its expert group (api::ParallelLayout::ExpertRankOf).
      if (const int expert = f.value("expert", s % experts); expert != s % experts) {
        throw CheckpointError(file.string() + ": file " + name + " of shard " + std::to_string(s) +
                              " names expert rank " + std::to_string(expert) + ", not " + std::to_string(s % experts));
      }
      if (f.contains("units")) {
        const std::vector<int> held = f.at("units").get<std::vector<int>>();
        for (size_t i = 0; i < held.size(); ++i) {
          if (held[i] < 0 || held[i] >= units || (i > 0 && held[i] <= held[i - 1])) {
            throw CheckpointError(file.string() + ": file " + name + " lists units that are not the model's in order");
          }
        }
      }
    }
  } catch (const Json::exception& e) {
    throw CheckpointError(file.string() + ": malformed metadata: " + e.what());
  }
  return meta;
}

}  // namespace meshtrain::train
