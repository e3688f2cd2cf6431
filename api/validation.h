// Semantic validation of a defaulted TrainingJob.
//
// Returns every problem at once, each with its field path and a reason a person
// can act on, e.g.
//   spec.parallelism.tensorParallelDegree: must divide spec.gpusPerNode (8), got 3
// Type errors and unknown fields are found earlier, by the decoder (json_codec.h).

#pragma once

#include <cstdint>

#include "api/field_error.h"
#include "api/training_job.h"

namespace meshtrain::api {

// Upper bounds validation enforces; they also keep microBatchSize x seqLen x
// data-parallel ranks within int64.
inline constexpr int64_t kMaxMicroBatchSize = 1 << 20;
inline constexpr int64_t kMaxSeqLen = 1 << 20;

// REQUIRES: ApplyDefaults(&job) has run.
FieldErrors ValidateTrainingJob(const TrainingJob& job);

// With spec.parallelism.mode auto, the fields the planner chooses that the manifest
// wrote anyway (`written`, WrittenFields in json_codec.h): one error each.
FieldErrors FieldsThePlannerChooses(const TrainingJob& job, const FieldPaths& written);

// The fields spec.parallelism.mode auto chooses.
inline constexpr const char* kPlannedFields[] = {
    "spec.parallelism.tensorParallelDegree",    "spec.parallelism.hybridShardDegree",
    "spec.parallelism.activationCheckpointing", "spec.parallelism.activationOffloading",
    "spec.parallelism.activationLoadingHorizon", "spec.parallelism.pipelineParallelDegree",
    "spec.parallelism.pipelineSchedule",        "spec.parallelism.pipelineVirtualStages",
    "spec.parallelism.contextParallelDegree",   "spec.parallelism.expertParallelDegree",
    "spec.training.microBatchSize"};

}  // namespace meshtrain::api
