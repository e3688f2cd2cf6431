// Regular expressions of tokenizer.json (Split and ByteLevel pre-tokenizers, the Replace
// normalizer) on PCRE2, JIT-compiled where PCRE2 can. Internal to worker/text.
//
// Compile and TranslatePattern throw TokenizerError naming the file and the JSON path; so
// does Matcher::Find for a pattern that fails on a text (past PCRE2's match limit).
//
// Thread-safety: a Regex is immutable and may be shared; a Matcher, and Matchers, are one
// thread's.

#pragma once

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>

namespace meshtrain::text::hf {

// \s of transformers' Rust tokenizers (Unicode's White_Space), for a character class.
inline constexpr const char* kUnicodeSpace =
    "\\t\\n\\x0b\\f\\r \\x{85}\\x{a0}\\x{1680}\\x{2000}-\\x{200a}\\x{2028}\\x{2029}\\x{202f}\\x{205f}\\x{3000}";

// An Oniguruma pattern (tokenizers' regular expressions) as PCRE2 reads it the same way:
// \s and \S spelled out as `space`. Throws TokenizerError for \S inside a class.
std::string TranslatePattern(const std::string& pattern, const char* space, const std::string& source,
                             const std::string& path);

struct Regex {
  pcre2_code* code = nullptr;
  std::string where;  // "FILE: JSON path", for a match that fails (past PCRE2's match limit)
  ~Regex() { pcre2_code_free(code); }
};

// `pattern` compiled: as a literal, or as a regular expression with Unicode properties.
std::shared_ptr<const Regex> Compile(const std::string& pattern, bool literal, const std::string& source,
                                     const std::string& path);

// Per-thread match data for one pattern.
class Matcher {
 public:
  explicit Matcher(const Regex& regex) : data_(pcre2_match_data_create_from_pattern(regex.code, nullptr)) {}
  Matcher(Matcher&& o) noexcept : data_(std::exchange(o.data_, nullptr)) {}
  ~Matcher() { pcre2_match_data_free(data_); }
  Matcher(const Matcher&) = delete;

  enum Result { kMatch, kPartial, kNone };
  // The first match in subject[at, length), or a partial one with `partial`.
  Result Find(const Regex& regex, std::string_view subject, size_t length, size_t at, bool partial, size_t* begin,
              size_t* end);

 private:
  pcre2_match_data* data_;
};

// One thread's Matcher for each pattern it has used.
class Matchers {
 public:
  Matcher& Of(const Regex& regex);

 private:
  std::unordered_map<const Regex*, Matcher> matchers_;
};

}  // namespace meshtrain::text::hf
