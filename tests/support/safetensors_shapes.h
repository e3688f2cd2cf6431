// Every tensor of a model directory's safetensors files, by name: its shape. For tests
// that check what an export wrote.
//
// Thread-safety: a pure function of the files.

#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "worker/train/safetensors.h"

namespace meshtrain::testing {

inline std::map<std::string, std::vector<int64_t>> TensorShapesIn(const std::filesystem::path& model) {
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const auto& entry : std::filesystem::directory_iterator(model)) {
    if (entry.path().extension() != ".safetensors") continue;
    for (const auto& [name, t] : train::ReadSafetensors(entry.path().string())) shapes[name] = t.shape;
  }
  return shapes;
}

}  // namespace meshtrain::testing
