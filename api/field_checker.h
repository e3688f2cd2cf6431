// FieldChecker: collects the errors of one manifest, each check reading as "path: rule"
// (api/field_error.h). Validation (api/validation.h) and each model family's own checks
// (api/model_family.h) write into one.
// Thread-safety: a value type; one thread at a time.

#pragma once

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "api/field_error.h"

namespace meshtrain::api {

class FieldChecker {
 public:
  FieldErrors errors;

  void Fail(std::string path, std::string message) { errors.push_back({std::move(path), std::move(message)}); }

  // min <= value <= max
  bool Range(const std::string& path, int64_t value, int64_t min, int64_t max) {
    if (value >= min && value <= max) return true;
    if (max == kNoMax) Fail(path, "must be at least " + std::to_string(min) + ", got " + std::to_string(value));
    else Fail(path, "must be between " + std::to_string(min) + " and " + std::to_string(max) + ", got " +
                        std::to_string(value));
    return false;
  }

  void Finite(const std::string& path, double value, double min, bool min_exclusive) {
    if (!std::isfinite(value)) return Fail(path, "must be a finite number, got " + Show(value));
    if (min_exclusive ? value <= min : value < min) {
      Fail(path, std::string(min_exclusive ? "must be greater than " : "must be at least ") + Show(min) +
                     ", got " + Show(value));
    }
  }

  void OneOf(const std::string& path, const std::string& value, std::initializer_list<const char*> allowed) {
    std::string list;
    for (const char* a : allowed) {
      if (value == a) return;
      list += (list.empty() ? "" : ", ") + std::string(a);
    }
    Fail(path, "must be one of " + list + "; got \"" + value + "\"");
  }

  static constexpr int64_t kNoMax = INT64_MAX;

  static std::string Show(double v) {
    std::string s = std::to_string(v);
    s.erase(s.find_last_not_of('0') + 1);
    if (!s.empty() && s.back() == '.') s.pop_back();
    return s;
  }
};

}  // namespace meshtrain::api
