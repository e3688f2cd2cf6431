#include "tests/support/kube/schema_validation.h"

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
  if (value.is_string() && schema.contains("minLength") && value.get<std::string>().size() < schema["minLength"].get<size_t>())
    error("Invalid value: " + Shown(value) + ": should be at least " + schema["minLength"].dump() + " chars long");
  if (value.is_array()) {
    if (schema.contains("minItems") && value.size() < schema["minItems"].get<size_t>())
      error("Invalid value: " + Shown(value) + ": should have at least " + schema["minItems"].dump() + " items");
    if (schema.contains("items")) {
      for (size_t i = 0; i < value.size(); ++i)
        Validate(schema["items"], value[i], path + "[" + std::to_string(i) + "]", strict, errors);
    }
  }
  if (value.is_object()) {
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
