// tokenizer.json's added tokens, and how they cut a text: found leftmost-longest in the
// raw text (normalized: false) or in each normalized stretch (normalized: true), with
// single_word, lstrip and rstrip as tokenizers' AddedVocabulary applies them; the text
// between them goes on to the pre-tokenizers. Internal to worker/text.
//
// Parse throws TokenizerError naming the file and the JSON path of a token it cannot use.
//
// Thread-safety: immutable after Parse; Split may run on several threads.

#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "worker/text/hf_json.h"

namespace meshtrain::text::hf {

struct AddedToken {
  std::string content;
  uint32_t id = 0;
  bool special = false, single_word = false, lstrip = false, rstrip = false, normalized = false;
};

class AddedTokens {
 public:
  AddedTokens() = default;
  AddedTokens(const AddedTokens&) = delete;  // the matchers point into tokens_
  AddedTokens& operator=(const AddedTokens&) = delete;

  // Reads tokenizer.json's "added_tokens" (an array). Ids are below 2^31, not yet checked
  // against the vocabulary's.
  void Parse(const Json& added, const std::string& source);

  const std::vector<AddedToken>& tokens() const { return tokens_; }

  // Cuts `text` at the added tokens whose `normalized` is the one given, calling, in
  // order, `stretch` with each non-empty stretch between them (and whether it starts at
  // the document's start, given `at_origin` for `text`'s) and `token` with each token's id.
  void Split(std::string_view text, bool at_origin, bool normalized,
             const std::function<void(std::string_view stretch, bool at_origin)>& stretch,
             const std::function<void(uint32_t id)>& token) const;

 private:
  // Added tokens found leftmost-longest, as an Aho-Corasick automaton of that kind does.
  class AddedMatcher {
   public:
    void Add(const AddedToken* token);
    bool empty() const { return empty_; }
    // The longest token starting at `at`, or null.
    const AddedToken* LongestAt(std::string_view text, size_t at, size_t* end) const;

   private:
    struct Node {
      std::map<uint8_t, int> children;
      const AddedToken* token = nullptr;
    };
    std::vector<Node> nodes_ = {Node{}};
    bool first_[256] = {};
    bool empty_ = true;
  };

  std::vector<AddedToken> tokens_;
  AddedMatcher raw_, normalized_;
};

}  // namespace meshtrain::text::hf
