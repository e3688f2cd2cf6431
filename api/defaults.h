// Defaults for a TrainingJob.
//
// The static defaults are the member initialisers in training_job.h. ApplyDefaults()
// fills in the rest, which depend on other fields: the model shape from its preset,
// resources.gpu from gpusPerNode, the topology levels and required level, and the
// values below, derived only where the user wrote nothing so that they always fit what
// was written (only what the user wrote can be rejected):
//
//   warmupSteps        a tenth of steps, at most the usual 100
//   globalBatchTokens  the multiple of microBatchSize x seqLen x data-parallel ranks
//                      nearest the usual 524288 (at least one micro-step)
//   microBatchSize     with globalBatchTokens written: the largest micro-batch up to the
//                      usual 8 that divides it into whole micro-steps
//   activationCheckpointing  on when activationOffloading is: SMP v2 configs turn
//                      checkpointing on in the training script, not in the config

#pragma once

#include <vector>

#include "api/field_error.h"
#include "api/training_job.h"

namespace meshtrain::api {

// `written` holds the fields the manifest wrote (WrittenFields in json_codec.h).
// Returns the values it derived, with the reason for each, in a fixed order.
// Idempotent. Leaves fields it cannot derive (an unknown preset, an invalid layout)
// for validation to report.
std::vector<DerivedDefault> ApplyDefaults(TrainingJob* job, const FieldPaths& written);

}  // namespace meshtrain::api
