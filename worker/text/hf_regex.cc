#include "worker/text/hf_regex.h"

#include "worker/text/hf_json.h"
#include "worker/text/tokenizer.h"

namespace meshtrain::text::hf {

std::string TranslatePattern(const std::string& pattern, const char* space, const std::string& source,
                             const std::string& path) {
  std::string out;
  bool in_class = false;
  for (size_t i = 0; i < pattern.size(); ++i) {
    const char c = pattern[i];
    if (c == '\\' && i + 1 < pattern.size()) {
      const char e = pattern[++i];
      if (e == 's') {
        out += in_class ? std::string(space) : "[" + std::string(space) + "]";
      } else if (e == 'S') {
        if (in_class) Fail(source, path, "\\S inside a character class is not implemented");
        out += "[^" + std::string(space) + "]";
      } else {
        out += c;
        out += e;
      }
      continue;
    }
    if (c == '[' && !in_class) {
      in_class = true;
      out += c;
      // A ']' first in the class (or after '^') is a literal.
      if (i + 1 < pattern.size() && pattern[i + 1] == '^') out += pattern[++i];
      if (i + 1 < pattern.size() && pattern[i + 1] == ']') out += pattern[++i];
      continue;
    }
    if (c == ']' && in_class) in_class = false;
    out += c;
  }
  return out;
}

std::shared_ptr<const Regex> Compile(const std::string& pattern, bool literal, const std::string& source,
                                     const std::string& path) {
  auto regex = std::make_shared<Regex>();
  regex->where = source + ": " + path;
  int error = 0;
  PCRE2_SIZE offset = 0;
  regex->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                              PCRE2_UTF | (literal ? PCRE2_LITERAL : PCRE2_UCP), &error, &offset, nullptr);
  if (regex->code == nullptr) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(error, message, sizeof message);
    Fail(source, path, "pattern \"" + pattern + "\" does not compile at offset " + std::to_string(offset) + ": " +
                           reinterpret_cast<char*>(message));
  }
  // Without a JIT, matching interprets: slower, the same.
  pcre2_jit_compile(regex->code, PCRE2_JIT_COMPLETE | PCRE2_JIT_PARTIAL_HARD);
  return regex;
}

Matcher::Result Matcher::Find(const Regex& regex, std::string_view subject, size_t length, size_t at, bool partial,
                              size_t* begin, size_t* end) {
  const int rc = pcre2_match(regex.code, reinterpret_cast<PCRE2_SPTR>(subject.data()), length, at,
                             PCRE2_NO_UTF_CHECK | PCRE2_NOTEMPTY | (partial ? PCRE2_PARTIAL_HARD : 0), data_, nullptr);
  if (rc == PCRE2_ERROR_NOMATCH) return kNone;
  const PCRE2_SIZE* range = pcre2_get_ovector_pointer(data_);
  if (rc == PCRE2_ERROR_PARTIAL) {
    *begin = range[0];
    *end = range[1];
    return kPartial;
  }
  if (rc < 0) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(rc, message, sizeof message);
    throw TokenizerError(regex.where + ": pattern failed on the text: " + reinterpret_cast<char*>(message));
  }
  *begin = range[0];
  *end = range[1];
  return kMatch;
}

Matcher& Matchers::Of(const Regex& regex) {
  auto it = matchers_.find(&regex);
  if (it == matchers_.end()) it = matchers_.emplace(&regex, Matcher(regex)).first;
  return it->second;
}

}  // namespace meshtrain::text::hf
