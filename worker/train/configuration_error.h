// What no restart can fix, found as a rank starts to train: a bad spec, data file or
// spec.model.init.from file, or a model too large for the rank's memory. For it a worker
// exits api::worker::kExitPermanent (78) and `meshtrain run` ends at once, whatever the
// number of ranks. Thread-safety: a pure function.

#pragma once

#include <functional>
#include <stdexcept>
#include <string>

namespace meshtrain::train {

class ConfigurationError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Calls `start` (a check of the job, or a Trainer's construction) and rethrows what it
// throws for such a problem as ConfigurationError: a message that names no file is
// prefixed with `config`, the manifest's path. Anything else passes through.
void RethrowConfigurationErrors(const std::string& config, const std::function<void()>& start);

}  // namespace meshtrain::train
