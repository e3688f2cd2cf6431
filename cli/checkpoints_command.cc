// `meshtrain checkpoints PATH`: every checkpoint under a job's spec.checkpoint.path, newest
// first, with its step, layout and size, and whether it verifies (every shard file present,
// of the right size, its checksum matching). `meshtrain export`: one of them as a Hugging
// Face model directory, or as one safetensors file where its family has a one-file form
// (GPT-2's).

#include <cstdio>

#include "api/model_family.h"
#include "cli/commands.h"
#include "worker/runtime/memory.h"
#include "worker/train/checkpoint.h"
#include "worker/train/checkpoint_reader.h"
#include "worker/train/huggingface.h"

namespace meshtrain::cli {

int CheckpointsCommand(const std::string& path, std::ostream& out) {
  const std::vector<train::CheckpointListing> all = train::ListCheckpoints(path);
  if (all.empty()) {
    out << path << ": no checkpoints\n";
    return kExitUnreadable;
  }
  bool all_verify = true;
  for (const train::CheckpointListing& c : all) {
    char line[160];
    std::snprintf(line, sizeof line, "step %8lld  %-32s %10s  %s", static_cast<long long>(c.step),
                  c.layout.empty() ? "?" : c.layout.c_str(), runtime::FormatBytes(size_t(c.bytes)).c_str(),
                  c.problem.empty() ? "verified" : "DAMAGED");
    out << line << (c.latest ? "  (latest)" : "") << "  " << c.directory << "\n";
    if (!c.problem.empty()) out << "  " << c.problem << "\n";
    all_verify = all_verify && c.problem.empty();
  }
  return all_verify ? kExitOk : kExitInvalid;
}

namespace {

// "5GB", "500MB", "1GiB", "1048576": a size in bytes; throws std::invalid_argument.
uint64_t ParseSize(const std::string& text) {
  size_t used = 0;
  double number = 0;
  try {
    number = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  const std::string unit = text.substr(used);
  const std::pair<const char*, double> units[] = {{"", 1},        {"B", 1},      {"KB", 1e3},  {"MB", 1e6},
                                                  {"GB", 1e9},    {"KiB", 1024}, {"MiB", 1048576.0},
                                                  {"GiB", 1073741824.0}};
  for (const auto& [name, scale] : units) {
    // At least a byte, and at most 2^60: beyond, no file is that large, and the cast would overflow.
    if (used > 0 && unit == name && number * scale >= 1 && number * scale <= 0x1p60) return uint64_t(number * scale);
  }
  throw std::invalid_argument("--max-shard-size " + text + ": a size such as 5GB, 500MB or 1GiB expected");
}

}  // namespace

int ExportCommand(const ExportOptions& o, std::ostream& out) {
  if (o.format != "safetensors") {
    out << "meshtrain export: --format " << o.format << ": only safetensors is written\n";
    return kExitUnreadable;
  }
  train::Dtype dtype;
  uint64_t max_shard = 0;
  try {
    dtype = train::DtypeNamed(o.dtype);
    max_shard = ParseSize(o.max_shard_size);
  } catch (const std::invalid_argument& e) {
    out << "meshtrain export: " << e.what() << "\n";
    return kExitUnreadable;
  }
  const bool single_file = o.output.ends_with(".safetensors");
  try {
    const api::ModelShape shape = train::CheckpointModel(o.checkpoint);
    if (single_file) {
      const api::ModelFamily& family = shape.Family();
      if (!family.HasSingleFileForm() || dtype != train::Dtype::kF32 || !o.like.empty()) {
        out << "meshtrain export: " << o.output << ": a single .safetensors file is "
            << (family.HasSingleFileForm() ? "the F32 one-file form of " + std::string(family.title()) + ", without --like"
                                           : "a one-file form, which " + std::string(family.title()) + " has none of")
            << "; give a directory for a Hugging Face model directory\n";
        return kExitUnreadable;
      }
      const train::LoadedCheckpoint loaded = train::LoadCheckpoint(o.checkpoint, shape);
      train::SaveSingleFile(o.output, loaded.state.master, shape);
      out << o.output << ": " << family.title() << " (" << shape.layers << " layers, hidden " << shape.hidden << ", vocab "
          << shape.vocab_size << ") of step " << loaded.position.step << ", in Hugging Face's safetensors layout\n";
      return kExitOk;
    }
    // A tensor at a time, straight from the shard files: the whole model never exists here.
    train::CheckpointReader reader(o.checkpoint, shape);
    std::vector<int64_t> at;
    const std::vector<std::string> files = train::ExportHuggingFace(
        o.output, shape, {dtype, max_shard, o.like}, [&](int unit, int64_t first, int64_t count, float* values) {
          at.resize(size_t(count));
          for (int64_t i = 0; i < count; ++i) at[size_t(i)] = first + i;
          reader.ReadUnit(unit, at, values, nullptr, nullptr);
        });
    out << o.output << ": " << api::DescribeShape(shape) << " of step " << reader.position().step
        << ", a Hugging Face model directory: config.json and " << files.size() << " safetensors file"
        << (files.size() == 1 ? "" : "s") << " in " << train::DtypeName(dtype)
        << (o.like.empty() ? "" : ", with " + o.like + "'s token ids and tokenizer") << "\n";
    return kExitOk;
  } catch (const std::exception& e) {
    out << "meshtrain export: " << e.what() << "\n";
    return kExitUnreadable;
  }
}

}  // namespace meshtrain::cli
