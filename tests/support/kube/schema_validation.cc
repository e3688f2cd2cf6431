#include "tests/support/kube/schema_validation.h"

#include <regex>

namespace meshtrain::testing {
namespace {

using nlohmann::json;

std::string Shown(const json& value) {
  std::string s = value.dump();
  return s.size() > 80 ? s.substr(0, 77) + "..." : s;
}

bool HasType(const json& value, const std::string& type) {
  if (type == "object") return value.is_object();
  if (type == "array") return value.is_array();
  if (type == "string") return value.is_string();
  if (type == "integer") return value.is_number_integer() || (value.is_number_float() && value.get<double>() == static_cast<double>(static_cast<int64_t>(value.get<double>())));
  if (type == "number") return value.is_number();
  if (type == "boolean") return value.is_boolean();
  return true;
}

// minLength, maxLength and pattern (as ECMAScript: the API server's RE2 patterns that it
// cannot read are not checked).
template <typename Error>
void ValidateString(const json& schema, const std::string& value, const Error& error) {
  const json shown = value;
  if (schema.contains("minLength") && value.size() < schema["minLength"].get<size_t>())
    error("Invalid value: " + Shown(shown) + ": should be at least " + schema["minLength"].dump() + " chars long");
  if (schema.contains("maxLength") && value.size() > schema["maxLength"].get<size_t>())
    error("Too long: may not be longer than " + schema["maxLength"].dump());
  if (!schema.contains("pattern")) return;
  const std::string pattern = schema["pattern"];
  bool matches = true;
  try {
    matches = std::regex_search(value, std::regex(pattern));
  } catch (const std::regex_error&) {
  }
  if (!matches) error("Invalid value: " + Shown(shown) + ": should match '" + pattern + "'");
}

void Validate(const json& schema, json& value, const std::string& path, bool strict, std::vector<std::string>& errors) {
  auto error = [&](const std::string& message) {
    errors.push_back((path.empty() ? "<root>" : path) + ": " + message);
  };
  if (value.is_null()) {
    if (!schema.value("nullable", false) && schema.contains("type"))
      error("Invalid value: \"null\": must be of type " + schema["type"].get<std::string>());
    return;
  }
  if (schema.value("x-kubernetes-int-or-string", false)) {
    if (!value.is_string() && !value.is_number_integer())
      error("Invalid value: " + Shown(value) + ": must be an integer or a string");
    if (value.is_string()) ValidateString(schema, value.get<std::string>(), error);
    return;
  }
  if (schema.contains("type")) {
    const std::string type = schema["type"];
    if (!HasType(value, type)) {
      error("Invalid value: " + Shown(value) + ": must be of type " + type);
      return;
    }
  }
  if (schema.contains("enum")) {
    bool found = false;
    for (const auto& allowed : schema["enum"]) found = found || allowed == value;
    if (!found) {
      std::string list;
      for (const auto& allowed : schema["enum"]) list += (list.empty() ? "" : ", ") + allowed.dump();
      error("Unsupported value: " + Shown(value) + ": supported values: " + list);
    }
  }
  if (value.is_number()) {
    if (schema.contains("minimum") && value.get<double>() < schema["minimum"].get<double>())
      error("Invalid value: " + Shown(value) + ": should be greater than or equal to " + schema["minimum"].dump());
    if (schema.contains("maximum") && value.get<double>() > schema["maximum"].get<double>())
      error("Invalid value: " + Shown(value) + ": should be less than or equal to " + schema["maximum"].dump());
  }
  if (value.is_string()) ValidateString(schema, value.get<std::string>(), error);
  if (value.is_array()) {
    if (schema.contains("minItems") && value.size() < schema["minItems"].get<size_t>())
      error("Invalid value: " + Shown(value) + ": should have at least " + schema["minItems"].dump() + " items");
    if (schema.contains("maxItems") && value.size() > schema["maxItems"].get<size_t>())
      error("Too many: " + std::to_string(value.size()) + ": must have at most " + schema["maxItems"].dump() + " items");
    if (schema.contains("items")) {
      for (size_t i = 0; i < value.size(); ++i)
        Validate(schema["items"], value[i], path + "[" + std::to_string(i) + "]", strict, errors);
    }
  }
  if (value.is_object()) {
    if (schema.contains("minProperties") && value.size() < schema["minProperties"].get<size_t>())
      error("Invalid value: should have at least " + schema["minProperties"].dump() + " properties");
    if (schema.contains("maxProperties") && value.size() > schema["maxProperties"].get<size_t>())
      error("Too many: " + std::to_string(value.size()) + ": must have at most " + schema["maxProperties"].dump() +
            " properties");
    const bool preserve = schema.value("x-kubernetes-preserve-unknown-fields", false);
    const json properties = schema.value("properties", json::object());
    if (schema.contains("required")) {
      for (const auto& name : schema["required"]) {
        if (!value.contains(name.get<std::string>()))
          errors.push_back((path.empty() ? "" : path + ".") + name.get<std::string>() + ": Required value");
      }
    }
    std::vector<std::string> unknown;
    for (auto it = value.begin(); it != value.end(); ++it) {
      const std::string child = path.empty() ? it.key() : path + "." + it.key();
      if (properties.contains(it.key())) {
        Validate(properties[it.key()], it.value(), child, strict, errors);
      } else if (schema.contains("additionalProperties")) {
        const json& extra = schema["additionalProperties"];
        if (extra.is_object()) Validate(extra, it.value(), child, strict, errors);
        else if (extra == false) unknown.push_back(it.key());
      } else if (!preserve && (schema.contains("properties") || schema.value("type", "") == "object")) {
        unknown.push_back(it.key());
      }
    }
    for (const auto& key : unknown) {
      if (strict) {
        errors.push_back((path.empty() ? "" : path + ".") + key + ": unknown field \"" + (path.empty() ? "" : path + ".") + key + "\"");
      } else {
        value.erase(key);
      }
    }
  }
}

}  // namespace

std::vector<std::string> ValidateAgainstSchema(const json& schema, json& value, bool strict) {
  std::vector<std::string> errors;
  // metadata, apiVersion and kind belong to the API server, whatever the schema says.
  json checked = value;
  json metadata = checked.contains("metadata") ? checked["metadata"] : json();
  checked.erase("metadata");
  json root_schema = schema;
  if (root_schema.contains("properties")) {
    root_schema["properties"].erase("metadata");
    root_schema["properties"]["apiVersion"] = {{"type", "string"}};
    root_schema["properties"]["kind"] = {{"type", "string"}};
  }
  Validate(root_schema, checked, "", strict, errors);
  if (!metadata.is_null()) checked["metadata"] = metadata;
  value = std::move(checked);
  return errors;
}

}  // namespace meshtrain::testing
