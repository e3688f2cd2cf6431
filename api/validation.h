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

}  // namespace meshtrain::api
