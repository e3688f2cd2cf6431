// tokenizer.json's post-processor: TemplateProcessing's "single" template (the ids before
// and after one sequence), ByteLevel (offsets only: no ids), and Sequence of them.
// Internal to worker/text.
//
// Each function throws TokenizerError naming the file, and the JSON path of a value it
// cannot use or of a post-processor type that is not implemented. Thread-safety: plain
// functions.

#pragma once

#include <cstddef>
#include <string>

#include "worker/text/hf_json.h"
#include "worker/text/tokenizer_engine.h"

namespace meshtrain::text::hf {

// Reads the post-processor `j` (tokenizer.json's "post_processor", at `path`; null is
// none) into `specials`' template.
void ParsePostProcessor(const Json& j, const std::string& source, const std::string& path,
                        TokenizerEngine::Specials& specials);

// Checks that the template's ids are below `vocab_size`.
void CheckTemplateIds(const TokenizerEngine::Specials& specials, size_t vocab_size, const std::string& source);

}  // namespace meshtrain::text::hf
