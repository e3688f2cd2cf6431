#include "worker/text/hf_json.h"

#include "worker/text/tokenizer.h"

namespace meshtrain::text::hf {

void Fail(const std::string& source, const std::string& path, const std::string& what) {
  throw TokenizerError(source + ": " + path + ": " + what);
}

std::string StringField(const Json& j, const char* key, const std::string& source, const std::string& path) {
  if (!j.contains(key) || !j[key].is_string()) Fail(source, path + "." + key, "expected a string");
  return j[key].get<std::string>();
}

size_t CountField(const Json& j, const char* key, const std::string& source, const std::string& path) {
  if (!j.contains(key) || j[key].is_null()) return 0;
  if (!j[key].is_number_unsigned()) Fail(source, path + "." + key, "expected a count, got " + j[key].dump());
  return j[key].get<size_t>();
}

bool BoolField(const Json& j, const char* key, bool fallback, const std::string& source, const std::string& path) {
  if (!j.contains(key) || j[key].is_null()) return fallback;
  if (!j[key].is_boolean()) Fail(source, path + "." + key, "expected true or false, got " + j[key].dump());
  return j[key].get<bool>();
}

std::string TypeOf(const Json& j, const std::string& source, const std::string& path) {
  if (!j.is_object()) Fail(source, path, "expected an object, got " + j.dump().substr(0, 80));
  return StringField(j, "type", source, path);
}

std::shared_ptr<const Regex> PatternField(const Json& j, const std::string& source, const std::string& path,
                                          std::string* literal) {
  const Json* p = j.contains("pattern") ? &j["pattern"] : nullptr;
  if (p != nullptr && p->is_object() && p->contains("String") && (*p)["String"].is_string()) {
    const std::string s = (*p)["String"].get<std::string>();
    if (s.empty()) Fail(source, path + ".pattern.String", "is empty");
    if (literal != nullptr) *literal = s;
    return Compile(s, true, source, path + ".pattern.String");
  }
  if (p != nullptr && p->is_object() && p->contains("Regex") && (*p)["Regex"].is_string()) {
    return Compile(TranslatePattern((*p)["Regex"].get<std::string>(), kUnicodeSpace, source, path + ".pattern.Regex"),
                   false, source, path + ".pattern.Regex");
  }
  Fail(source, path + ".pattern", "expected {\"String\": ...} or {\"Regex\": ...}");
}

}  // namespace meshtrain::text::hf
