#include "worker/train/configuration_error.h"

#include "worker/runtime/memory.h"
#include "worker/train/token_file.h"

namespace meshtrain::train {

void RethrowConfigurationErrors(const std::string& config, const std::function<void()>& start) {
  try {
    start();
  } catch (const TokenFileError& e) {
    throw ConfigurationError(e.what());
  } catch (const runtime::OutOfMemory& e) {
    // The model's state is allocated as the trainer is built: the same spec on the same
    // kind of machine fails the same way after any restart.
    throw ConfigurationError(config + ": the job does not fit this rank: " + e.what());
  } catch (const std::invalid_argument& e) {
    throw ConfigurationError(config + ": " + e.what());
  }
}

}  // namespace meshtrain::train
