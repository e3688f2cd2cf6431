// Manifest files: YAML (one or more `---` documents, as kubectl takes them) or JSON,
// turned into JSON objects, and then into checked TrainingJobs.
//
// YAML scalars are typed as kubectl types them (YAML 1.1 booleans such as `yes`,
// integers, floats, null); quoted scalars are always strings. A `kind: List`
// object is expanded into its items. Input size, nesting depth and alias
// expansion are bounded, so hostile input gets an error, never a crash or hang.

#pragma once

#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "api/field_error.h"
#include "api/training_job.h"

namespace meshtrain::api {

// A file that cannot be read or parsed. what() names the source and, for
// syntax errors, the 1-based line and column: "job.yaml:7:3: ...".
class ManifestError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct ManifestDocument {
  int index = 0;  // 0-based position among the documents of the source
  int line = 0;   // 1-based line where the document's content starts (0 if unknown)
  nlohmann::json object;
};

inline constexpr size_t kMaxManifestBytes = 16 << 20;

// Parses YAML or JSON text (JSON when it starts with `{` or `[`). Empty YAML
// documents are skipped. Throws ManifestError.
std::vector<ManifestDocument> ParseManifestText(std::string_view text, std::string_view source);

// How messages name the manifest at `path`: "<stdin>" for "-", else the path.
std::string ManifestSourceName(const std::string& path);

// Reads and parses a file, a pipe (`<(helm template ...)`) or, for "-", standard input.
// Throws ManifestError naming the file, also for a directory. A FIFO that no process
// holds open for writing reads as empty rather than waiting for a writer.
std::vector<ManifestDocument> ReadManifestFile(const std::string& path);

// One TrainingJob from a manifest, decoded, defaulted and validated.
struct CheckedJob {
  std::string source;  // file name
  int document = 0;    // 0-based document index in the file
  nlohmann::json written;  // the object as the manifest wrote it, before defaults
  TrainingJob job;
  FieldErrors errors;  // decoding and validation errors together; empty means valid
  std::vector<DerivedDefault> defaults;  // values derived for fields the manifest left out (defaults.h)
  FieldErrors warnings;  // of a valid job: fields set that have no effect yet (warnings.h)

  bool ok() const { return errors.empty(); }
  // "job.yaml (document 2, TrainingJob "x")": where to look, for error messages.
  std::string Where() const;
};

// What CheckTrainingJob does with a spec.model.init.from that names a Hugging Face model
// directory (api/hf_config.h): its config.json gives the family and the shape, and a
// shape field the job wrote must agree with it.
enum class ModelDirectory {
  kNotRead,    // the operator, which cannot reach the pods' volumes: the job carries the shape
  kIfPresent,  // the CLI: read where it is on this machine; elsewhere the job's shape stands
  kRequired,   // a worker, at start: read and checked (a path that is missing is the
               // weights reader's to name, spec.model.init.from, before the rendezvous)
};

// Decodes, defaults and validates one object, and warns about fields without effect.
// Unknown fields and validation
// errors are reported together; a value that cannot be decoded (a wrong type)
// is reported alone, since checks against its placeholder would mislead.
CheckedJob CheckTrainingJob(const nlohmann::json& object, std::string source, int document,
                            ModelDirectory directory = ModelDirectory::kNotRead);

// Every document of a file as a CheckedJob, named `name` (default:
// ManifestSourceName(path)). Documents of other kinds are reported as errors at `kind`.
// Throws ManifestError if the file is unreadable.
std::vector<CheckedJob> LoadTrainingJobs(const std::string& path, const std::string& name = "",
                                         ModelDirectory directory = ModelDirectory::kNotRead);

}  // namespace meshtrain::api
