// tokenizer.json's pre-tokenizers: Split (a string or a regular expression, with each
// split behavior and invert), ByteLevel (with or without GPT-2's pattern), Metaspace, and
// Sequence of them. Each runs on every piece the previous one left; the pieces the last
// one leaves are the pre-tokens, which go to the model in order. A pre-tokenizer first
// transforms its piece (Transform: ByteLevel's prefix space, Metaspace's replacement) and
// then splits it (Split). Internal to worker/text.
//
// Parse throws TokenizerError naming the file and the JSON path of a value it cannot use,
// of a pre-tokenizer type that is not implemented, and of one after ByteLevel. Apply and
// Split throw TokenizerError where a pattern fails on the text (past PCRE2's match limit).
//
// Thread-safety: immutable after Parse or UseGpt2; Apply and Split may run on several
// threads, each with its own Matchers.

#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "worker/text/hf_json.h"
#include "worker/text/hf_regex.h"

namespace meshtrain::text::hf {

enum class Behavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };
enum class Prepend { kAlways, kFirst, kNever };

struct PreStep {
  enum Kind { kSplit, kByteLevel, kMetaspace } kind;
  std::shared_ptr<const Regex> regex;  // Split's; ByteLevel's with use_regex
  Behavior behavior = Behavior::kIsolated;
  bool invert = false;
  bool add_prefix_space = false;  // ByteLevel
  std::string replacement;        // Metaspace
  Prepend prepend = Prepend::kAlways;
  bool split = true;  // Metaspace
};

// What receives the pre-tokens, in order: the model.
class PreTokenSink {
 public:
  virtual ~PreTokenSink() = default;
  virtual void Add(std::string_view pre_token) = 0;
};

class PreTokenizers {
 public:
  // Appends the pre-tokenizer `j` (tokenizer.json's "pre_tokenizer", at `path`; null is none).
  void Parse(const Json& j, const std::string& source, const std::string& path);
  // Appends GPT-2's: ByteLevel, its pattern's \s being ECMAScript's (as gpt-3-encoder's).
  void UseGpt2(const std::string& source);

  const std::vector<PreStep>& steps() const { return steps_; }
  // Whether the last pre-tokenizer is ByteLevel: the model then reads bytes.
  bool byte_level() const { return !steps_.empty() && steps_.back().kind == PreStep::kByteLevel; }

  // What pre-tokenizer `step` does to one piece before it splits it.
  std::string Transform(size_t step, std::string_view piece, bool at_origin) const;
  // Pre-tokenizer `step` and those after it, on one piece of the previous one (or, for
  // step 0, a stretch of text); `at_origin`: the piece starts the document.
  void Apply(size_t step, std::string_view piece, bool at_origin, Matchers& matchers, PreTokenSink& sink) const;
  // The splitting half of pre-tokenizer `step` on an already transformed piece, then those after it.
  void Split(size_t step, std::string_view piece, bool at_origin, Matchers& matchers, PreTokenSink& sink) const;

 private:
  std::vector<PreStep> steps_;
};

}  // namespace meshtrain::text::hf
