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
  if (job.spec.elastic.min_nodes && *job.spec.elastic.min_nodes >= job.spec.nodes) {
    warnings.push_back({"spec.elastic.minNodes", "has no effect: it equals spec.nodes, so the gang never runs "
                                                 "smaller; set it below spec.nodes to let the job run on fewer"});
  }
  return warnings;
}

}  // namespace meshtrain::api
