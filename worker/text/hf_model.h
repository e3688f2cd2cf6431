// The model of tokenizer.json (model.type "BPE", the one implemented) and the merges of
// GPT-2's vocab.bpe, read into a BpeModel (bpe_model.h). Internal to worker/text.
//
// Each function throws TokenizerError naming the file, and for tokenizer.json the JSON
// path, of what it cannot use: another model type, BPE dropout, a malformed vocabulary or
// merge. Thread-safety: plain functions.

#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "worker/text/bpe_model.h"
#include "worker/text/hf_json.h"

namespace meshtrain::text::hf {

// Checks that `model` (tokenizer.json's "model") is a BPE model without dropout.
void CheckModelType(const Json& model, const std::string& source);

// The BPE model of `model`, whose pre-tokens are bytes with `byte_level` (a ByteLevel
// pre-tokenizer runs last). Sets `vocab` to its tokens as the vocabulary spells them, with
// their ids, which are below 2^31 and not yet checked against the added tokens.
BpeModel ParseBpeModel(const Json& model, bool byte_level, const std::string& source,
                       std::vector<std::pair<std::string, uint32_t>>& vocab);

// GPT-2's vocab.bpe lines as merges.
std::vector<std::pair<std::string, std::string>> ParseMergeLines(std::string_view text, const std::string& source);

}  // namespace meshtrain::text::hf
