// FieldError: one problem with a manifest, located by its field path.
//
// Paths follow the Kubernetes convention: `spec.parallelism.tensorParallelDegree`,
// `spec.template.tolerations[2].effect`. Messages are written for the person who
// will fix the manifest: what is wrong, what was expected, what was given.

#pragma once

#include <functional>
#include <set>
#include <string>
#include <vector>

namespace meshtrain::api {

// Which stage found the problem. Undecodable values (wrong type, out of range,
// conflicting aliases) leave their field at its default, so semantic validation
// is only meaningful once there are none; unknown fields change no value.
enum class FieldErrorType { kInvalid, kUndecodable, kUnknownField };

struct FieldError {
  std::string path;
  std::string message;
  FieldErrorType type = FieldErrorType::kInvalid;

  // "path: message"
  std::string ToString() const { return path.empty() ? message : path + ": " + message; }
  bool operator==(const FieldError&) const = default;
};

using FieldErrors = std::vector<FieldError>;

// A set of field paths, such as the fields a manifest wrote.
using FieldPaths = std::set<std::string, std::less<>>;

}  // namespace meshtrain::api
