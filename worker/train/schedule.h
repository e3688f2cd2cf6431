// The learning-rate schedule: linear warmup to training.learningRate over
// warmupSteps, then cosine decay to a tenth of it at the last step, or constant.

#pragma once

#include <cstdint>

#include "api/training_job.h"

namespace meshtrain::train {

// The rate for step `step` (0-based) of `training.steps`.
double LearningRate(const api::TrainingSpec& training, int64_t step);

}  // namespace meshtrain::train
