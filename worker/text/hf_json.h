// Reading tokenizer.json's values, for its components (hf_*.h). Internal to worker/text.
//
// Every function here that reads a value throws TokenizerError naming the file (`source`)
// and the value's JSON path (`path`, then the key) when the value is missing where one is
// required or is of another type. Thread-safety: plain functions.

#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "worker/text/hf_regex.h"

namespace meshtrain::text::hf {

using Json = nlohmann::json;

// Metaspace's replacement (pre-tokenizer and decoder) where the file gives none: U+2581.
inline constexpr const char* kMetaspace = "\xe2\x96\x81";

// Throws TokenizerError("SOURCE: PATH: WHAT").
[[noreturn]] void Fail(const std::string& source, const std::string& path, const std::string& what);

std::string StringField(const Json& j, const char* key, const std::string& source, const std::string& path);

// A count that defaults to 0 (Strip's start and stop).
size_t CountField(const Json& j, const char* key, const std::string& source, const std::string& path);

// `fallback` where the key is missing or null.
bool BoolField(const Json& j, const char* key, bool fallback, const std::string& source, const std::string& path);

// The "type" of a component, which must be an object.
std::string TypeOf(const Json& j, const std::string& source, const std::string& path);

// A Split's or Replace's pattern: {"String": s} or {"Regex": r}, compiled. Sets `*literal`
// to a String's s.
std::shared_ptr<const Regex> PatternField(const Json& j, const std::string& source, const std::string& path,
                                          std::string* literal = nullptr);

}  // namespace meshtrain::text::hf
