// GPT-2's byte-level BPE tokenizer (Radford et al. 2019), our own implementation.
//
// Encoding, as GPT-2 does it:
//   1. the text is split into pre-tokens by GPT-2's pattern
//        's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
//      (PCRE2, JIT-compiled). \s is ECMAScript's whitespace, spelled out, so that ids equal
//      those of the JavaScript encoder (npm gpt-3-encoder); PCRE2's own \s would add U+0085
//      and U+180E and drop U+FEFF. \p{L} and \p{N} come from PCRE2 10.42's Unicode 14 tables:
//      letters assigned later split like punctuation here;
//   2. each pre-token's UTF-8 bytes start as one symbol each (GPT-2's byte-to-unicode map
//      names them in the vocabulary files);
//   3. adjacent symbols are merged by rank, the lowest first, leftmost first among equals,
//      until no adjacent pair has a merge. A min-heap over a linked list makes this
//      O(n log n), so a pre-token of a million spaces costs no more than it should.
// Text that is not valid UTF-8 has each maximal invalid subsequence replaced by U+FFFD
// first, as a browser's TextDecoder does; Encode says how many.
//
// Decode(Encode(text)) == text for valid UTF-8. "<|endoftext|>" in text is plain text:
// the end-of-text token is only ever inserted by the caller (between documents).
//
// Thread-safety: a Gpt2Tokenizer is immutable after Load and may be shared. Encoding
// needs a Session (a pre-token cache and PCRE2 match data), one per thread.

#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace meshtrain::text {

// A tokenizer directory or file that is missing or malformed; what() names the file.
class TokenizerError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class Gpt2Tokenizer {
 public:
  // Reads `dir`/encoder.json and `dir`/vocab.bpe (OpenAI's files), or else
  // `dir`/tokenizer.json (Hugging Face's file of the same model). Throws TokenizerError.
  static Gpt2Tokenizer Load(const std::string& dir);

  // From the contents of encoder.json and vocab.bpe; `source` names them in errors.
  static Gpt2Tokenizer FromOpenAiFiles(std::string_view encoder_json, std::string_view vocab_bpe,
                                       const std::string& source);
  // From the contents of a Hugging Face tokenizer.json.
  static Gpt2Tokenizer FromHuggingFaceFile(std::string_view tokenizer_json, const std::string& source);

  Gpt2Tokenizer(Gpt2Tokenizer&&) noexcept;
  Gpt2Tokenizer& operator=(Gpt2Tokenizer&&) noexcept;
  ~Gpt2Tokenizer();

  // Per-thread encoding state. Holds a reference to its tokenizer, which must outlive it.
  class Session {
   public:
    explicit Session(const Gpt2Tokenizer& tokenizer);
    Session(Session&&) noexcept;
    ~Session();

    // Appends the ids of `text` to `ids`. Returns how many invalid UTF-8 sequences were
    // replaced by U+FFFD (0 for valid text).
    size_t Encode(std::string_view text, std::vector<uint32_t>& ids);

   private:
    void EncodePreToken(std::string_view bytes, std::vector<uint32_t>& ids);

    const Gpt2Tokenizer* tokenizer_;
    struct MatchData;
    std::unique_ptr<MatchData> match_;
    std::unordered_map<std::string, std::vector<uint32_t>> cache_;  // pre-token -> ids
    // Scratch of the merge loop, kept to avoid allocating per pre-token.
    std::vector<uint32_t> symbol_, next_, prev_;
  };

  // One-off encoding with a fresh Session.
  std::vector<uint32_t> Encode(std::string_view text) const;

  // The bytes of `ids` joined. Ids past the vocabulary throw std::out_of_range naming the id.
  std::string Decode(std::span<const uint32_t> ids) const;

  uint32_t vocab_size() const { return uint32_t(token_bytes_.size()); }
  uint32_t end_of_text() const { return end_of_text_; }

 private:
  Gpt2Tokenizer() = default;
  // Checks the tables and compiles the pattern; `source` names the files in errors.
  void Finish(const std::string& source);

  struct Merge {
    uint32_t rank, result;
  };
  static uint64_t PairKey(uint32_t left, uint32_t right) { return uint64_t(left) << 32 | right; }

  std::vector<std::string> token_bytes_;       // id -> the bytes it stands for
  uint32_t byte_token_[256] = {};              // byte -> its single-byte id
  std::unordered_map<uint64_t, Merge> merges_;  // (left id, right id) -> rank and merged id
  uint32_t end_of_text_ = 0;
  struct Pattern;
  std::unique_ptr<Pattern> pattern_;
};

// The byte-to-unicode map of GPT-2's vocabulary files: printable Latin-1 bytes stand for
// themselves, the other 68 become U+0100.. in byte order. Returns the code point of `byte`.
uint32_t Gpt2ByteCodePoint(uint8_t byte);

}  // namespace meshtrain::text
