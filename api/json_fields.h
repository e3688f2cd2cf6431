// The field-table JSON codec behind json_codec.h, for any record type.
//
// A record type T gets one table, found by argument-dependent lookup:
//
//   template <Is<T> S, class V> void Fields(S& s, V& v) { v("jsonName", s.member); ... }
//
// The same table drives ObjectDecoder (strict reading: wrong types and unknown
// fields become FieldErrors with their paths) and ObjectEncoder (writing, with
// empty optional values, strings and lists left out). Decode<T>() and Encode()
// are the entry points. Members may be int64_t, double, bool, std::string,
// nlohmann::json (an opaque object), std::map<string, string>, std::vector,
// std::optional, or other records.

#pragma once

#include <concepts>
#include <cstdint>
#include <initializer_list>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "api/field_error.h"

namespace meshtrain::api {

// A short description of a JSON value for error messages: `string "abc"`, `a list`.
std::string DescribeJson(const nlohmann::json& value);

namespace json_fields {

using Json = nlohmann::json;

template <class S, class T>
concept Is = std::same_as<std::remove_const_t<S>, T>;

// dump() for messages: never throws, whatever bytes the strings hold.
std::string Dump(const Json& value);

// Reading.

class ObjectDecoder;

// True for records whose objects carry fields owned by someone else (ObjectMeta):
// their unknown fields are ignored instead of reported.
template <class T>
inline constexpr bool kIgnoresUnknownFields = false;

template <class T>
concept Record = requires(T& t, ObjectDecoder& d) { Fields(t, d); };

void AddError(FieldErrors* errors, std::string path, std::string message);
void Read(const Json& j, const std::string& path, FieldErrors* errors, int64_t& out);
void Read(const Json& j, const std::string& path, FieldErrors* errors, double& out);
void Read(const Json& j, const std::string& path, FieldErrors* errors, bool& out);
void Read(const Json& j, const std::string& path, FieldErrors* errors, std::string& out);
// Opaque Kubernetes objects (volumes) are kept as they are; the API server checks them.
void Read(const Json& j, const std::string& path, FieldErrors* errors, Json& out);
void Read(const Json& j, const std::string& path, FieldErrors* errors, std::map<std::string, std::string>& out);

template <class T>
void Read(const Json& j, const std::string& path, FieldErrors* errors, std::vector<T>& out);
template <class T>
void Read(const Json& j, const std::string& path, FieldErrors* errors, std::optional<T>& out);
template <Record T>
void Read(const Json& j, const std::string& path, FieldErrors* errors, T& out);

// Walks one JSON object for a Fields() table. Keys that no field claims are
// reported as unknown when the decoder goes out of scope, so a table can never
// forget to check for them.
class ObjectDecoder {
 public:
  // Lenient decoders skip the unknown-field check (see kIgnoresUnknownFields).
  ObjectDecoder(const Json& j, std::string path, FieldErrors* errors, bool lenient = false)
      : path_(std::move(path)), errors_(errors), lenient_(lenient) {
    if (j.is_object()) {
      object_ = &j;
    } else {
      AddError(errors_, path_, "must be an object, got " + DescribeJson(j));
    }
  }

  ~ObjectDecoder() {
    if (object_ == nullptr || lenient_) return;
    for (const auto& [key, value] : object_->items()) {
      if (!claimed_.contains(key)) errors_->push_back({Child(key), "unknown field", FieldErrorType::kUnknownField});
    }
  }

  ObjectDecoder(const ObjectDecoder&) = delete;
  ObjectDecoder& operator=(const ObjectDecoder&) = delete;

  bool ok() const { return object_ != nullptr; }

  template <class T>
  void operator()(std::string_view key, T& out, std::initializer_list<std::string_view> aliases = {}) {
    const Json* found = Claim(key);
    std::string found_key(key);
    for (std::string_view alias : aliases) {
      const Json* other = Claim(alias);
      if (other == nullptr) continue;
      if (found != nullptr && *found != *other) {
        AddError(errors_, Child(alias),
                 "conflicts with " + Child(found_key) + " (" + Dump(*other) + " vs " + Dump(*found) + ")");
      } else if (found == nullptr) {
        found = other;
        found_key = alias;
      }
    }
    if (found != nullptr) Read(*found, Child(found_key), errors_, out);
  }

  // A boolean switch that is accepted but changes nothing.
  void IgnoredFlag(std::string_view key) {
    const Json* value = Claim(key);
    if (value != nullptr && !value->is_boolean()) {
      AddError(errors_, Child(key), "must be true or false, got " + DescribeJson(*value));
    }
  }

  // A key for a feature meshtrain lacks: accepted only at its neutral value.
  void OnlyValue(std::string_view key, int64_t allowed) {
    const Json* value = Claim(key);
    if (value != nullptr && !(value->is_number_integer() && value->get<int64_t>() == allowed)) {
      AddError(errors_, Child(key),
               "is not supported by meshtrain; only " + std::to_string(allowed) + " is accepted, got " +
                   DescribeJson(*value));
    }
  }

 private:
  const Json* Claim(std::string_view key) {
    if (object_ == nullptr) return nullptr;
    auto it = object_->find(key);
    if (it == object_->end()) return nullptr;
    claimed_.emplace(key);
    return &*it;
  }

  std::string Child(std::string_view key) const {
    return path_.empty() ? std::string(key) : path_ + "." + std::string(key);
  }

  const Json* object_ = nullptr;
  std::string path_;
  FieldErrors* errors_;
  bool lenient_;
  std::set<std::string, std::less<>> claimed_;
};

template <class T>
void Read(const Json& j, const std::string& path, FieldErrors* errors, std::vector<T>& out) {
  out.clear();
  if constexpr (std::is_same_v<T, std::string>) {
    if (j.is_string()) {  // `train: data/*.bin` means a list of one
      out.push_back(j.get<std::string>());
      return;
    }
  }
  if (!j.is_array()) {
    AddError(errors, path, "must be a list, got " + DescribeJson(j));
    return;
  }
  out.resize(j.size());
  for (size_t i = 0; i < j.size(); ++i) {
    Read(j[i], path + "[" + std::to_string(i) + "]", errors, out[i]);
  }
}

template <class T>
void Read(const Json& j, const std::string& path, FieldErrors* errors, std::optional<T>& out) {
  if (j.is_null()) {
    out.reset();
    return;
  }
  T value{};
  const size_t before = errors->size();
  Read(j, path, errors, value);
  if (errors->size() == before) out = std::move(value);
}

template <Record T>
void Read(const Json& j, const std::string& path, FieldErrors* errors, T& out) {
  ObjectDecoder decoder(j, path, errors, kIgnoresUnknownFields<T>);
  if (decoder.ok()) Fields(out, decoder);
}

// Which fields an object writes.

// Walks one JSON object for a Fields() table and adds the canonical path of every
// field it writes, under an alias or not, and of the fields of records inside it. Type
// errors are not its business (ObjectDecoder reports them): a record written as a
// non-object counts as written, with nothing inside.
class WrittenFieldsVisitor {
 public:
  WrittenFieldsVisitor(const Json& j, std::string path, FieldPaths* written)
      : object_(j.is_object() ? &j : nullptr), path_(std::move(path)), written_(written) {}

  template <class T>
  void operator()(std::string_view key, T& member, std::initializer_list<std::string_view> aliases = {}) {
    if (object_ == nullptr) return;
    const Json* found = Find(key);
    for (std::string_view alias : aliases) {
      if (found == nullptr) found = Find(alias);
    }
    if (found == nullptr) return;
    const std::string path = path_.empty() ? std::string(key) : path_ + "." + std::string(key);
    written_->insert(path);
    if constexpr (Record<T>) {
      WrittenFieldsVisitor nested(*found, path, written_);
      Fields(member, nested);
    }
  }
  void IgnoredFlag(std::string_view) {}
  void OnlyValue(std::string_view, int64_t) {}

 private:
  const Json* Find(std::string_view key) const {
    auto it = object_->find(key);
    return it == object_->end() ? nullptr : &*it;
  }

  const Json* object_;
  std::string path_;
  FieldPaths* written_;
};

// The canonical paths of the fields `j` writes for a record of type T: "spec",
// "spec.training", "spec.training.warmupSteps", ... (list items are not entered).
template <Record T>
FieldPaths WrittenFields(const Json& j) {
  FieldPaths written;
  T scratch{};
  WrittenFieldsVisitor visitor(j, "", &written);
  Fields(scratch, visitor);
  return written;
}

// Writing.

class ObjectEncoder;

template <class T>
concept EncodableRecord = requires(const T& t, ObjectEncoder& e) { Fields(t, e); };

template <class T>
bool IsEmpty(const T& value) {
  if constexpr (requires { value.has_value(); }) {
    return !value.has_value();
  } else if constexpr (requires { value.empty(); } && !std::is_same_v<T, Json>) {
    return value.empty();
  } else {
    return false;
  }
}

template <class T>
Json Write(const T& value);

class ObjectEncoder {
 public:
  explicit ObjectEncoder(Json& out) : out_(out) { out_ = Json::object(); }

  template <class T>
  void operator()(std::string_view key, const T& value, std::initializer_list<std::string_view> = {}) {
    if (!IsEmpty(value)) out_[std::string(key)] = Write(value);
  }
  void IgnoredFlag(std::string_view) {}
  void OnlyValue(std::string_view, int64_t) {}

 private:
  Json& out_;
};

template <class T>
Json Write(const T& value) {
  if constexpr (EncodableRecord<T>) {
    Json out;
    ObjectEncoder encoder(out);
    Fields(value, encoder);
    return out;
  } else if constexpr (requires { value.has_value(); }) {
    return Write(*value);
  } else if constexpr (requires { typename T::value_type; } && !std::is_same_v<T, std::string> &&
                       !std::is_same_v<T, Json> &&
                       !requires { typename T::mapped_type; }) {
    Json out = Json::array();
    for (const auto& item : value) out.push_back(Write(item));
    return out;
  } else {
    return Json(value);
  }
}

template <class T>
T Decode(const Json& j, const std::string& path, FieldErrors* errors) {
  T out{};
  Read(j, path, errors, out);
  return out;
}

template <class T>
Json Encode(const T& value) {
  return Write(value);
}

}  // namespace json_fields
}  // namespace meshtrain::api
