// Validation of a value against a CRD's structural OpenAPI v3 schema, as the API server
// does it for custom resources: type, enum, required, properties, additionalProperties,
// items, minimum/maximum, minItems/maxItems, minLength/maxLength, pattern,
// minProperties/maxProperties, nullable, x-kubernetes-preserve-unknown-fields and
// x-kubernetes-int-or-string. Not the CEL rules (x-kubernetes-validations), nor defaults.
// Unknown fields are pruned, or reported when `strict`.
//
// Errors read like the API server's: "spec.nodes: Invalid value: \"two\": must be of type integer".

#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace meshtrain::testing {

// Validates (and, unless strict, prunes) `value` in place. Returns the errors.
std::vector<std::string> ValidateAgainstSchema(const nlohmann::json& schema, nlohmann::json& value, bool strict);

}  // namespace meshtrain::testing
