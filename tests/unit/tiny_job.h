// The job of the operator's unit tests: the tiny GPT-2 on a gang of 2 nodes x 8 GPUs.

#pragma once

#include <string>

#include <nlohmann/json.hpp>

namespace meshtrain::controller::test {

// A TrainingJob named `name`, as a user would create it.
inline nlohmann::json TinyJob(const std::string& name) {
  return {{"apiVersion", "meshtrain.dev/v1alpha1"},
          {"kind", "TrainingJob"},
          {"metadata", {{"name", name}}},
          {"spec",
           {{"image", "meshtrain:test"},
            {"nodes", 2},
            {"gpusPerNode", 8},
            {"model", {{"preset", "gpt2-tiny"}}},
            {"data", {{"train", "/data/train.bin"}}},
            {"training", {{"steps", 10}, {"globalBatchTokens", 16384}, {"microBatchSize", 1}, {"warmupSteps", 1}}}}}};
}

}  // namespace meshtrain::controller::test
