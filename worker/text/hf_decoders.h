// tokenizer.json's decoders: ByteLevel, Replace (of a string), ByteFallback, Fuse, Strip,
// Metaspace, and Sequence of them, applied in order to the tokens' spellings, which are
// then joined. Internal to worker/text.
//
// Parse throws TokenizerError naming the file and the JSON path of a value it cannot use;
// a decoder that is not implemented (another type, a Replace of a regular expression) is
// no error there, but makes Decode throw TokenizerError naming it.
//
// Thread-safety: immutable after Parse or UseByteLevel; Decode may run on several threads.

#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "worker/text/hf_json.h"

namespace meshtrain::text::hf {

class Decoders {
 public:
  // Appends the decoder `j` (tokenizer.json's "decoder", at `path`; null is none).
  void Parse(const Json& j, const std::string& source, const std::string& path);
  // Appends ByteLevel (GPT-2's).
  void UseByteLevel();

  // The text of `tokens`, each spelled as the vocabulary does.
  std::string Decode(std::vector<std::string> tokens, const std::string& source) const;

 private:
  struct Step {
    enum Kind { kByteLevel, kReplace, kByteFallback, kFuse, kStrip, kMetaspace } kind;
    std::string pattern, content;
    size_t start = 0, stop = 0;
    bool strip_first = false;  // Metaspace: the first token's leading space goes
  };
  std::vector<Step> steps_;
  std::string unsupported_;  // what Decode names when it cannot decode
};

}  // namespace meshtrain::text::hf
