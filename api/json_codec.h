// TrainingJob <-> JSON, with the Kubernetes field names.
//
// Decoding is strict: an unknown field, a value of the wrong type or two aliases
// with different values is an error with its field path. Decoding goes on past
// errors, so one pass reports all of them. Decoding does not apply defaults or
// validate; see defaults.h and validation.h.

#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "api/field_error.h"
#include "api/training_job.h"

namespace meshtrain::api {

// Decodes a whole TrainingJob object (apiVersion, kind, metadata, spec, status).
// Appends problems to *errors; the result holds whatever decoded cleanly.
TrainingJob DecodeTrainingJob(const nlohmann::json& object, FieldErrors* errors);

// The canonical paths of the fields `object` writes ("spec.training.warmupSteps" also
// when written under an SMP alias), and of the blocks that hold them ("spec.training").
// Defaults derived from other fields (defaults.h) apply only where the user wrote nothing.
FieldPaths WrittenFields(const nlohmann::json& object);

// Decodes a status object, as the operator reads it back from the API server.
TrainingJobStatus DecodeTrainingJobStatus(const nlohmann::json& object, FieldErrors* errors);

// Encodes with every spec field written (defaults included) and empty optional
// values left out. DecodeTrainingJob(ToJson(job)) == job.
nlohmann::json ToJson(const TrainingJob& job);
nlohmann::json ToJson(const TrainingJobSpec& spec);
nlohmann::json ToJson(const ModelSpec& model);
// Decodes a spec.model object found at `path` (checkpoint metadata writes the model with
// ToJson, the same keys).
ModelSpec DecodeModelSpec(const nlohmann::json& object, const std::string& path, FieldErrors* errors);
nlohmann::json ToJson(const TrainingJobStatus& status);
// status.progress alone (the operator keeps rank 0's readings in this form).
nlohmann::json ToJson(const ProgressStatus& progress);
ProgressStatus DecodeProgressStatus(const nlohmann::json& object, FieldErrors* errors);

}  // namespace meshtrain::api
