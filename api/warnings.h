// Warnings for a valid TrainingJob: fields the user set that the engine does not act
// on yet. A field the code ignores is never accepted silently (docs/trainingjob.md,
// "Warnings"); each entry goes in the change that implements its field.
//
// Each warning names the field and says it has no effect yet, e.g.
//   spec.checkpoint: has no effect yet: no checkpoint is written, and a restarted job starts from step 0

#pragma once

#include "api/field_error.h"
#include "api/training_job.h"

namespace meshtrain::api {

// `written` holds the fields the manifest wrote (WrittenFields in json_codec.h).
// REQUIRES: ApplyDefaults has run and the job is valid.
FieldErrors FieldsWithoutEffect(const TrainingJob& job, const FieldPaths& written);

}  // namespace meshtrain::api
