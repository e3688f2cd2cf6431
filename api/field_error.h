// FieldError: one problem with a manifest, located by its field path.
//
// Paths follow the Kubernetes convention: `spec.parallelism.tensorParallelDegree`,
// `spec.template.tolerations[2].effect`. Messages are written for the person who
// will fix the manifest: what is wrong, what was expected, what was given.

#pragma once

#include <string>
#include <vector>

namespace meshtrain::api {

struct FieldError {
  std::string path;
  std::string message;

  // "path: message"
  std::string ToString() const { return path.empty() ? message : path + ": " + message; }
  bool operator==(const FieldError&) const = default;
};

using FieldErrors = std::vector<FieldError>;

}  // namespace meshtrain::api
