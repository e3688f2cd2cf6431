// tokenizer.json's normalizers: NFC, NFKC, NFD, NFKD (utf8proc), Prepend, Replace (a
// string or a regular expression), and Sequence of them, applied in order to each stretch
// of text between added tokens. Internal to worker/text.
//
// Parse throws TokenizerError naming the file and the JSON path of a value it cannot use,
// and of a normalizer type that is not implemented. Normalize throws TokenizerError where
// utf8proc fails, or where a Replace pattern fails on the text (past PCRE2's match limit).
//
// Thread-safety: immutable after Parse; Normalize may run on several threads, each with
// its own Matchers.

#pragma once

#include <memory>
#include <string>
#include <vector>

#include "worker/text/hf_json.h"
#include "worker/text/hf_regex.h"

namespace meshtrain::text::hf {

class Normalizers {
 public:
  // Appends the normalizer `j` (tokenizer.json's "normalizer", at `path`; null is none).
  void Parse(const Json& j, const std::string& source, const std::string& path);

  // Normalizes valid UTF-8 `text` in place.
  void Normalize(std::string& text, Matchers& matchers) const;

 private:
  struct Step {
    enum Kind { kNfc, kNfkc, kNfd, kNfkd, kPrepend, kReplace } kind;
    std::string text;                     // Prepend's prefix; Replace's literal pattern
    std::string content;                  // Replace's replacement
    std::shared_ptr<const Regex> regex;   // Replace's regular expression
  };
  std::vector<Step> steps_;
};

}  // namespace meshtrain::text::hf
