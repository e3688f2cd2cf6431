// `meshtrain model-spec DIR`: the spec.model fields of a Hugging Face model directory, from
// its config.json, for a job the operator runs: the operator cannot read a directory on
// the pods' volumes, so the job carries the shape, and each worker checks it against the
// directory when it starts.

#include <iostream>

#include <nlohmann/json.hpp>

#include "api/hf_config.h"
#include "api/json_codec.h"
#include "cli/commands.h"

namespace meshtrain::cli {

int ModelSpecCommand(const std::string& directory, int64_t seq_len, std::ostream& out) {
  try {
    api::ModelSpec model;
    if (seq_len > 0) model.seq_len = seq_len;
    const api::HuggingFaceConfig config = api::ReadHuggingFaceConfig(directory);
    const api::FieldErrors errors = api::MergeHuggingFaceConfig(config, &model);
    if (!errors.empty()) {
      out << "meshtrain model-spec: " << errors.front().ToString() << "\n";
      return kExitInvalid;
    }
    const api::ModelShape shape = api::ShapeOf(model);
    api::ModelSpec spec = api::SpecOfShape(shape);
    spec.init.from = directory;
    out << "# spec.model of " << directory << " (" << config.file << "): " << api::DescribeShape(shape) << "\n";
    for (const std::string& note : config.notes) out << "# note: " << note << "\n";
    nlohmann::json fields = api::ToJson(spec);
    fields.erase("dropout");  // the job's choice, not the directory's
    out << "model:\n";
    for (const auto& [key, value] : fields.items()) out << "  " << key << ": " << value.dump() << "\n";
    return kExitOk;
  } catch (const std::exception& e) {
    out << "meshtrain model-spec: " << e.what() << "\n";
    return kExitUnreadable;
  }
}

}  // namespace meshtrain::cli
