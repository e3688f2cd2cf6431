// Defaults for a TrainingJob.
//
// The static defaults are the member initialisers in training_job.h. ApplyDefaults()
// fills in the rest, which depend on other fields: the model shape from its preset,
// resources.gpu from gpusPerNode, and the topology levels and required level.

#pragma once

#include "api/training_job.h"

namespace meshtrain::api {

// Idempotent. Leaves fields it cannot derive (an unknown preset) for validation to report.
void ApplyDefaults(TrainingJob* job);

}  // namespace meshtrain::api
