// Which failures as a rank starts to train are configuration errors (exit 78, no restart).

#include "worker/train/configuration_error.h"

#include <gtest/gtest.h>

#include <stdexcept>
#include <string>

#include "worker/runtime/memory.h"
#include "worker/train/token_file.h"

namespace meshtrain::train {
namespace {

// What RethrowConfigurationErrors made of `thrown`: its message, or "passed: " and the original's.
template <class E>
std::string Classify(const E& thrown) {
  try {
    RethrowConfigurationErrors("job.yaml", [&] { throw thrown; });
  } catch (const ConfigurationError& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("passed: ") + e.what();
  }
  return "nothing thrown";
}

TEST(ConfigurationErrors, BadFilesAndAModelTooLargeAreConfigurationErrors) {
  EXPECT_EQ(Classify(TokenFileError("data/train.bin: is truncated")), "data/train.bin: is truncated");
  // The Trainer names the field of an init.from file it cannot use.
  EXPECT_EQ(Classify(std::invalid_argument("spec.model.init.from: model.safetensors: missing or unreadable")),
            "job.yaml: spec.model.init.from: model.safetensors: missing or unreadable");
  EXPECT_EQ(Classify(runtime::OutOfMemory("out of host memory: 2 TiB for activations")),
            "job.yaml: the job does not fit this rank: out of host memory: 2 TiB for activations");
  EXPECT_EQ(Classify(std::invalid_argument("spec.training.microBatchSize: too large")),
            "job.yaml: spec.training.microBatchSize: too large");
}

TEST(ConfigurationErrors, OtherFailuresPassThroughForARestart) {
  EXPECT_EQ(Classify(std::runtime_error("device fault")), "passed: device fault");
  std::string called;
  RethrowConfigurationErrors("job.yaml", [&] { called = "yes"; });
  EXPECT_EQ(called, "yes");
}

}  // namespace
}  // namespace meshtrain::train
