// ConfigKeys: reads the keys of one config.json object for a model family's description
// (api/model_family.h), each error a HuggingFaceConfigError naming the file and the key.
// Thread-safety: reads a JSON value it does not own; one thread at a time.

#pragma once

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "api/hf_config.h"

namespace meshtrain::api {

// Sizes in config.json are below this: products of two of them fit int64.
inline constexpr int64_t kConfigIntegerLimit = int64_t(1) << 31;

class ConfigKeys {
 public:
  ConfigKeys(const nlohmann::json& j, const std::string& file) : j_(j), file_(file) {}

  const std::string& file() const { return file_; }
  [[noreturn]] void Fail(const std::string& message) const { throw HuggingFaceConfigError(file_ + ": " + message); }

  bool Has(const char* key) const { return j_.contains(key) && !j_.at(key).is_null(); }

  int64_t Int(const char* key) const {
    if (!Has(key)) Fail(std::string("has no ") + key);
    return OptionalInt(key).value();
  }
  std::optional<int64_t> OptionalInt(const char* key) const {
    if (!Has(key)) return std::nullopt;
    const nlohmann::json& v = j_.at(key);
    // An unsigned value past int64's range reads as a negative one here.
    if (!v.is_number_integer() || v.get<int64_t>() < 1 || v.get<int64_t>() >= kConfigIntegerLimit) {
      Fail(std::string(key) + " must be a positive integer below 2^31, got " + v.dump());
    }
    return v.get<int64_t>();
  }
  std::optional<double> Number(const char* key) const {
    if (!Has(key)) return std::nullopt;
    const nlohmann::json& v = j_.at(key);
    if (!v.is_number() || !std::isfinite(v.get<double>())) Fail(std::string(key) + " must be a number, got " + v.dump());
    return v.get<double>();
  }
  std::optional<bool> Bool(const char* key) const {
    if (!Has(key)) return std::nullopt;
    const nlohmann::json& v = j_.at(key);
    if (!v.is_boolean()) Fail(std::string(key) + " must be true or false, got " + v.dump());
    return v.get<bool>();
  }
  std::optional<std::string> String(const char* key) const {
    if (!Has(key)) return std::nullopt;
    const nlohmann::json& v = j_.at(key);
    if (!v.is_string()) Fail(std::string(key) + " must be a string, got " + v.dump());
    return v.get<std::string>();
  }
  // A key whose value would change the math: only `expected` (or its absence) is taken.
  template <class T>
  void Require(const char* key, const std::optional<T>& value, const T& expected, const std::string& why) const {
    if (value && *value != expected) Fail(std::string(key) + " " + Show(*value) + " is not implemented: " + why);
  }

 private:
  static std::string Show(bool b) { return b ? "true" : "false"; }
  static std::string Show(double d) { return nlohmann::json(d).dump(); }
  static std::string Show(const std::string& s) { return nlohmann::json(s).dump(); }

  const nlohmann::json& j_;
  const std::string& file_;
};

// RoPE's scaling of a Llama-class config.json, from rope_scaling (transformers 4) or
// rope_parameters (transformers 5, which also holds rope_theta): where both are given they
// must agree, as must rope_parameters' rope_theta with the top-level one. Sets
// c->model.rope_scaling and, from rope_parameters, c->model.rope_theta.
void ReadRopeConfig(const nlohmann::json& j, const std::string& file, HuggingFaceConfig* c);

}  // namespace meshtrain::api
