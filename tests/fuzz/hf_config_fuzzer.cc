// libFuzzer target for Hugging Face's config.json (api/hf_config.h), down the path of
// `meshtrain model-spec DIR`: parsed, merged into an empty spec.model, its shape
// resolved, described and written back as a spec.
//
// Beyond "no crash", it checks on every input:
//   - only HuggingFaceConfigError escapes parsing, its message naming the file;
//   - a config that merges without an error gives a shape whose config.json, as an export
//     writes it (HuggingFaceConfigJson), reads back as the same shape.

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "api/hf_config.h"
#include "api/json_codec.h"
#include "api/model_shape.h"

namespace {

using namespace meshtrain::api;

[[noreturn]] void Fail(const char* what, const std::string& detail) {
  std::fprintf(stderr, "%s: %s\n", what, detail.c_str());
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  const std::string file = "fuzz/config.json";
  HuggingFaceConfig config;
  try {
    config = ParseHuggingFaceConfig(text, file);
  } catch (const HuggingFaceConfigError& e) {
    if (!std::string_view(e.what()).starts_with(file + ": ")) Fail("an error that does not name its file", e.what());
    return 0;
  }
  ModelSpec model;
  const FieldErrors errors = MergeHuggingFaceConfig(config, &model);
  for (const FieldError& e : errors) (void)e.ToString();
  if (!errors.empty()) return 0;
  const ModelShape shape = ShapeOf(model);
  (void)DescribeShape(shape);
  (void)ToJson(SpecOfShape(shape)).dump();

  // What an export writes reads back as the same model.
  const std::string written = HuggingFaceConfigJson(shape, "float32").dump();
  ModelSpec again;
  again.seq_len = shape.seq_len;
  try {
    const FieldErrors back = MergeHuggingFaceConfig(ParseHuggingFaceConfig(written, "exported/config.json"), &again);
    if (!back.empty()) Fail("the exported config does not merge back", back.front().ToString() + "\n" + written);
  } catch (const HuggingFaceConfigError& e) {
    Fail("the exported config does not read back", std::string(e.what()) + "\n" + written);
  }
  if (!(ShapeOf(again) == shape)) {
    Fail("the exported config reads back as another shape",
         DescribeShape(shape) + " became " + DescribeShape(ShapeOf(again)));
  }
  return 0;
}
