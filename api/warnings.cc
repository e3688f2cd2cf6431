#include "api/warnings.h"

namespace meshtrain::api {

FieldErrors FieldsWithoutEffect(const TrainingJob& job, const FieldPaths& written) {
  FieldErrors warnings;
  auto warn = [&](const char* path, bool set, const std::string& why) {
    if (set) warnings.push_back({path, "has no effect yet: " + why});
  };
  warn("spec.parallelism.activationLoadingHorizon",
       written.contains("spec.parallelism.activationLoadingHorizon") && !job.spec.parallelism.activation_offloading,
       "spec.parallelism.activationOffloading is off, so nothing is loaded back");
  warn("spec.parallelism.tensorParallelSeed",
       written.contains("spec.parallelism.tensorParallelSeed") && job.spec.model.dropout == 0,
       "it keys the dropout masks, and spec.model.dropout is 0");
  for (const char* field : {"spec.checkpoint.interval", "spec.checkpoint.keep", "spec.checkpoint.resume"}) {
    warn(field, written.contains(field) && job.spec.checkpoint.path.empty(),
         "spec.checkpoint.path is empty, so no checkpoint is written or read");
  }
  return warnings;
}

}  // namespace meshtrain::api
