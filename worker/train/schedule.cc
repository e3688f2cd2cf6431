#include "worker/train/schedule.h"

#include <cmath>
#include <numbers>

namespace meshtrain::train {

double LearningRate(const api::TrainingSpec& t, int64_t step) {
  if (step < t.warmup_steps) return t.learning_rate * double(step + 1) / double(t.warmup_steps);
  if (t.schedule == "constant") return t.learning_rate;
  const double min_rate = 0.1 * t.learning_rate;
  const int64_t decay_steps = t.steps - t.warmup_steps;
  const double progress = decay_steps <= 1 ? 1.0 : double(step - t.warmup_steps) / double(decay_steps - 1);
  return min_rate + 0.5 * (t.learning_rate - min_rate) * (1.0 + std::cos(std::numbers::pi * progress));
}

}  // namespace meshtrain::train
