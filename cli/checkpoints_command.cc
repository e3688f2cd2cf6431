// `meshtrain checkpoints PATH`: every checkpoint under a job's spec.checkpoint.path, newest
// first, with its step, layout and size, and whether it verifies (every shard file present,
// of the right size, its checksum matching).

#include <cstdio>

#include "cli/commands.h"
#include "worker/runtime/memory.h"
#include "worker/train/checkpoint.h"

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

}  // namespace meshtrain::cli
