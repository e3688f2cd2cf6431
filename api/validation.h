// Semantic validation of a defaulted TrainingJob.
//
// Returns every problem at once, each with its field path and a reason a person
// can act on, e.g.
//   spec.parallelism.tensorParallelDegree: must divide spec.gpusPerNode (8), got 3
// Type errors and unknown fields are found earlier, by the decoder (json_codec.h).

#pragma once

#include "api/field_error.h"
#include "api/training_job.h"

namespace meshtrain::api {

// REQUIRES: ApplyDefaults(&job) has run.
FieldErrors ValidateTrainingJob(const TrainingJob& job);

}  // namespace meshtrain::api
