#include "api/json_fields.h"

#include <limits>

namespace meshtrain::api {

using json_fields::Dump;
using json_fields::Json;

std::string DescribeJson(const Json& value) {
  switch (value.type()) {
    case Json::value_t::null: return "null (an empty value)";
    case Json::value_t::boolean: return value.get<bool>() ? "boolean true" : "boolean false";
    case Json::value_t::number_integer:
    case Json::value_t::number_unsigned:
    case Json::value_t::number_float: return "number " + Dump(value);
    case Json::value_t::string: {
      std::string s = value.get<std::string>();
      if (s.size() > 40) s = s.substr(0, 40) + "...";
      return "string " + Dump(Json(s));
    }
    case Json::value_t::array: return "a list";
    case Json::value_t::object: return "an object";
    default: return "an unsupported value";
  }
}

namespace json_fields {

std::string Dump(const Json& value) { return value.dump(-1, ' ', false, Json::error_handler_t::replace); }

void AddError(FieldErrors* errors, std::string path, std::string message) {
  errors->push_back({std::move(path), std::move(message), FieldErrorType::kUndecodable});
}

void Read(const Json& j, const std::string& path, FieldErrors* errors, int64_t& out) {
  if (j.is_number_unsigned() && j.get<uint64_t>() > uint64_t(std::numeric_limits<int64_t>::max())) {
    AddError(errors, path, "is out of range, got " + DescribeJson(j));
  } else if (j.is_number_integer()) {
    out = j.get<int64_t>();
  } else {
    AddError(errors, path, "must be an integer, got " + DescribeJson(j));
  }
}

void Read(const Json& j, const std::string& path, FieldErrors* errors, double& out) {
  if (j.is_number()) {
    out = j.get<double>();
  } else {
    AddError(errors, path, "must be a number, got " + DescribeJson(j));
  }
}

void Read(const Json& j, const std::string& path, FieldErrors* errors, bool& out) {
  if (j.is_boolean()) {
    out = j.get<bool>();
  } else {
    AddError(errors, path, "must be true or false, got " + DescribeJson(j));
  }
}

void Read(const Json& j, const std::string& path, FieldErrors* errors, std::string& out) {
  if (j.is_string()) {
    out = j.get<std::string>();
  } else {
    AddError(errors, path, "must be a string, got " + DescribeJson(j));
  }
}

void Read(const Json& j, const std::string& path, FieldErrors* errors, Json& out) {
  if (j.is_object()) {
    out = j;
  } else {
    AddError(errors, path, "must be an object, got " + DescribeJson(j));
  }
}

void Read(const Json& j, const std::string& path, FieldErrors* errors,
          std::map<std::string, std::string>& out) {
  if (!j.is_object()) {
    AddError(errors, path, "must be a map of strings, got " + DescribeJson(j));
    return;
  }
  for (const auto& [key, value] : j.items()) {
    Read(value, path + "." + key, errors, out[key]);
  }
}

}  // namespace json_fields
}  // namespace meshtrain::api
