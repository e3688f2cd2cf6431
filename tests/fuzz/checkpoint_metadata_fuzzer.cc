// libFuzzer target for the checkpoint metadata parser (worker/train/checkpoint_metadata.h).
//
// Beyond "no crash", on every input: only CheckpointError escapes, and metadata that
// parses names only shard files of this directory, inside a layout of positive sizes.

#include <cstdint>
#include <cstdlib>
#include <string>

#include "worker/train/checkpoint_metadata.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace meshtrain;
  // The model of the corpus's seeds.
  const api::ModelShape shape{2, 4, 16, 250, 16};
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    const nlohmann::json meta = train::ParseCheckpointMetadata(text, "fuzz/metadata.json", shape);
    for (const auto& f : meta.at("files")) {
      const std::string name = f.at("name").get<std::string>();
      if (name.find('/') != std::string::npos || !name.starts_with("rank-")) std::abort();
    }
    for (const char* size_name : {"tp", "shard", "replicas"}) {
      if (meta.at("layout").at(size_name).get<int>() < 1) std::abort();
    }
  } catch (const train::CheckpointError&) {
  }
  return 0;
}
