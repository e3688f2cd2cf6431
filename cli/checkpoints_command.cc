// `meshtrain checkpoints PATH`: every checkpoint under a job's spec.checkpoint.path, newest
// first, with its step, layout and size, and whether it verifies (every shard file present,
// of the right size, its checksum matching). `meshtrain export`: one of them as a Hugging
// Face GPT-2.

#include <cstdio>

#include "cli/commands.h"
#include "worker/runtime/memory.h"
#include "worker/train/checkpoint.h"
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

int ExportCommand(const std::string& checkpoint, const std::string& format, const std::string& output,
                  std::ostream& out) {
  if (format != "safetensors") {
    out << "meshtrain export: --format " << format << ": only safetensors is written\n";
    return kExitUnreadable;
  }
  try {
    const api::ModelShape shape = train::CheckpointModel(checkpoint);
    const train::LoadedCheckpoint loaded = train::LoadCheckpoint(checkpoint, shape);
    train::SaveHuggingFaceGpt2(output, loaded.state.master, shape);
    out << output << ": GPT-2 (" << shape.layers << " layers, hidden " << shape.hidden << ", vocab "
        << shape.vocab_size << ") of step " << loaded.position.step << ", in Hugging Face's safetensors layout\n";
    return kExitOk;
  } catch (const std::exception& e) {
    out << "meshtrain export: " << e.what() << "\n";
    return kExitUnreadable;
  }
}

}  // namespace meshtrain::cli
