// The BPE model of Hugging Face tokenizers (model.type "BPE"), and of GPT-2's OpenAI files:
// a pre-token's symbols are merged pairwise by rank until no adjacent pair has a merge.
//
// Symbols: in byte mode (a ByteLevel pre-tokenizer ran before the model), each byte of the
// pre-token is one symbol, the vocabulary spelling bytes as GPT-2's byte-to-unicode map does
// (Gpt2ByteCodePoint); otherwise each character is one, spelled as itself. A symbol the
// vocabulary lacks becomes the byte tokens <0xNN> of its UTF-8 (byte_fallback, when all
// exist), else unk_token (consecutive ones fused into one with fuse_unk), else nothing, as
// Hugging Face's BPE does. continuing_subword_prefix and end_of_word_suffix spell a
// pre-token's inner and last symbols. ignore_merges: a whole pre-token that is a token is
// that token.
//
// Merging takes the pair of lowest rank, leftmost first among equals, from a min-heap over a
// linked list: O(n log n), so a pre-token of a million spaces costs no more than it should.
// A pre-token longer than a cache entry is first cut between two symbols that no token of
// the vocabulary holds side by side: no merge can join them, so the parts merge alone to the
// same ids (this is also where a long text may be cut for several threads: CanCut).
//
// Thread-safety: a BpeModel is immutable after Build; a Scratch is one thread's.

#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace meshtrain::text {

class BpeModel {
 public:
  struct Options {
    bool byte_level = false;
    bool byte_fallback = false;
    bool fuse_unk = false;
    bool ignore_merges = false;
    std::optional<std::string> unk_token;
    std::string continuing_subword_prefix, end_of_word_suffix;
  };

  // `vocab`: each token as the vocabulary spells it, with its id (ids need not be dense:
  // added tokens fill the rest); `merges`: pairs of spelled tokens, in rank order. Throws
  // TokenizerError naming `source` and the merge or token at fault.
  static BpeModel Build(const std::vector<std::pair<std::string, uint32_t>>& vocab,
                        const std::vector<std::pair<std::string, std::string>>& merges, const Options& options,
                        const std::string& source);

  // A thread's scratch: the merge loop's arrays and a cache of pre-tokens' ids.
  class Scratch {
   public:
    Scratch() = default;

   private:
    friend class BpeModel;
    std::unordered_map<std::string, std::vector<uint32_t>> cache_;
    std::vector<uint32_t> symbol_, next_, prev_;
    std::vector<uint32_t> initial_;
  };

  // Appends the ids of one pre-token (UTF-8; bytes in byte mode). `whole`: the pre-token is
  // whole (false for a part of one cut for several threads: ignore_merges does not apply).
  void Tokenize(std::string_view piece, bool whole, Scratch& scratch, std::vector<uint32_t>& ids) const;

  // Whether a pre-token may be cut at `pos` (a character boundary strictly inside it): no
  // merge joins the symbols either side. Always false where prefixes or suffixes spell
  // symbols by their place in the pre-token.
  bool CanCut(std::string_view piece, size_t pos) const;
  bool cuttable() const { return cuttable_; }

  std::optional<uint32_t> IdOf(std::string_view spelled) const;
  bool byte_level() const { return options_.byte_level; }

 private:
  BpeModel() = default;
  void Merge(std::string_view piece, Scratch& scratch, std::vector<uint32_t>& ids) const;
  void Symbols(std::string_view piece, Scratch& scratch) const;
  bool Joinable(uint32_t left_cp, uint32_t right_cp) const;

  struct MergeRule {
    uint32_t rank, result;
  };
  static uint64_t PairKey(uint32_t left, uint32_t right) { return uint64_t(left) << 32 | right; }

  Options options_;
  std::unordered_map<std::string, uint32_t> id_of_;  // spelled token -> id
  // The same keyed by the token's bytes, in byte mode (ignore_merges looks up raw bytes).
  std::unordered_map<std::string, uint32_t> id_of_bytes_;
  std::unordered_map<uint64_t, MergeRule> merges_;
  uint32_t byte_symbol_[256] = {};                      // byte mode: byte -> id, or kNone
  std::unordered_map<uint32_t, uint32_t> char_symbol_;  // character mode: code point -> id
  uint32_t byte_fallback_[256] = {};                    // <0xNN> -> id, or kNone
  bool all_byte_fallbacks_ = false;
  std::optional<uint32_t> unk_id_;
  // Pairs of symbols (bytes, or code points) side by side in some token.
  std::vector<bool> joinable_bytes_;
  std::unordered_set<uint64_t> joinable_chars_;
  bool cuttable_ = false;
};

}  // namespace meshtrain::text
