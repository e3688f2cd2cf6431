// libFuzzer target for the manifest path: parse, decode, default, validate, lay out.
//
// Beyond "no crash", it checks two properties on every input:
//   - only ManifestError escapes parsing; every other failure is a FieldError;
//   - a valid job survives ToJson -> Decode unchanged, and its layout can be built.

#include <cstdint>
#include <cstdlib>
#include <cstdio>
#include <string_view>

#include "api/json_codec.h"
#include "api/layout.h"
#include "api/manifest.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace meshtrain::api;
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  std::vector<ManifestDocument> documents;
  try {
    documents = ParseManifestText(text, "fuzz.yaml");
  } catch (const ManifestError&) {
    return 0;
  }
  for (const ManifestDocument& doc : documents) {
    const CheckedJob checked = CheckTrainingJob(doc.object, "fuzz.yaml", doc.index);
    for (const FieldError& e : checked.errors) (void)e.ToString();
    if (!checked.ok()) continue;
    FieldErrors errors;
    const TrainingJob again = DecodeTrainingJob(ToJson(checked.job), &errors);
    if (!errors.empty() || !(again == checked.job)) {
      std::fprintf(stderr, "round trip changed a valid job: %s\n", ToJson(checked.job).dump().c_str());
      std::abort();
    }
    (void)ParallelLayout::ForSpec(checked.job.spec);
  }
  return 0;
}
