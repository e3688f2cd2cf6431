// Tokenizers from a model directory (meshtrain prepare-data --tokenizer DIR,
// spec.model.tokenizer, meshtrain sample --tokenizer), our own implementations except
// SentencePiece's:
//
//   tokenizer.json        Hugging Face tokenizers, model BPE (Llama 3, Qwen2/2.5/3, Llama 2,
//                         Mistral, TinyLlama, GPT-2): normalizers NFC, NFKC, NFD, NFKD,
//                         Prepend, Replace, Sequence; pre-tokenizers Split, ByteLevel,
//                         Metaspace, Sequence; added tokens, matched in the text before the
//                         rest runs; post-processors ByteLevel, TemplateProcessing, Sequence;
//                         decoders ByteLevel, Replace, ByteFallback, Fuse, Strip, Metaspace,
//                         Sequence (hf_tokenizer.cc). A component that would change the ids and
//                         is not implemented is an error naming its type and JSON path; an
//                         unknown decoder makes Decode, not loading, fail.
//   tokenizer.model       SentencePiece, through Debian's libsentencepiece, where there is no
//                         tokenizer.json (sentencepiece_tokenizer.cc).
//   encoder.json + vocab.bpe   OpenAI's GPT-2 files. There "<|endoftext|>" in text is plain
//                         text, and \s in GPT-2's pattern is ECMAScript's, so that ids equal
//                         the npm gpt-3-encoder's. In tokenizer.json patterns \s is Unicode's
//                         White_Space (with U+0085, without U+FEFF), as in transformers'
//                         Rust tokenizers.
//   tokenizer_config.json (beside either) bos_token, eos_token, add_bos_token.
//
// The files come from the internet: their JSON is read by api::ParseModelJson (nesting
// bounded, api/hf_config.h), ids are 0..n-1 without gaps and checked before a table grows,
// and a pattern that fails on a text (past PCRE2's match limit) is a TokenizerError naming
// the file and the pattern's JSON path.
//
// Regular expressions run on PCRE2 (JIT). Text that is not valid UTF-8 has each maximal
// invalid subsequence replaced by U+FFFD first, as a browser's TextDecoder does; Encode says
// how many. Decode(Encode(text)) == text wherever the tokenizer is lossless (not where a
// normalizer changes the text, nor for characters that become unk_token).
//
// Documents (frame()): the BOS goes before each document where tokenizer_config.json's
// add_bos_token, or the post-processor's template, adds one; the EOS after each. A
// tokenizer whose BOS and EOS are one token (GPT-2's <|endoftext|>, also when only its
// vocabulary names it) puts it once before each document, as llm.c writes GPT-2's shards.
//
// Thread-safety: a Tokenizer is immutable after loading and may be shared; encoding needs a
// Session (caches, match data), one per thread. EncodeParallel makes its own.

#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace meshtrain::text {

// A tokenizer directory or file that is missing or malformed; what() names the file (and
// the JSON path).
class TokenizerError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The ids a document gets around its own (prepare-data, and a sample's start and stop).
struct DocumentFrame {
  std::vector<uint32_t> before, after;
};

class TokenizerEngine;

class Tokenizer {
 public:
  // From a directory: tokenizer.json, else tokenizer.model, else encoder.json and vocab.bpe;
  // with tokenizer_config.json where there is one. Throws TokenizerError.
  static Tokenizer Load(const std::string& dir);
  // From files' contents; `source` names them in errors, and an empty config is none.
  static Tokenizer FromOpenAiFiles(std::string_view encoder_json, std::string_view vocab_bpe, const std::string& source);
  static Tokenizer FromHuggingFaceFile(std::string_view tokenizer_json, const std::string& source,
                                       std::string_view config_json = {}, const std::string& config_source = {});
  static Tokenizer FromSentencePieceModel(std::string_view model, const std::string& source,
                                          std::string_view config_json = {}, const std::string& config_source = {});

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  // Per-thread encoding state. Holds a reference to its tokenizer, which must outlive it.
  class Session {
   public:
    explicit Session(const Tokenizer& tokenizer);
    Session(Session&&) noexcept;
    ~Session();

    // Appends the ids of `text` (no BOS or EOS: see frame()). Returns how many invalid
    // UTF-8 sequences were replaced by U+FFFD (0 for valid text).
    size_t Encode(std::string_view text, std::vector<uint32_t>& ids);

    struct State;

   private:
    std::unique_ptr<State> state_;
  };

  // One-off encoding with a fresh Session.
  std::vector<uint32_t> Encode(std::string_view text) const;

  // Encodes one long text on `threads` threads, cutting it only where the pre-tokenizer (or
  // the model) splits anyway; the ids equal Encode(text)'s whatever the cuts. Calls
  // `progress` with the bytes done so far, from the calling thread. Returns the U+FFFD count.
  size_t EncodeParallel(std::string_view text, int threads, std::vector<uint32_t>& ids,
                        const std::function<void(size_t done_bytes)>& progress = nullptr) const;

  // The text of `ids`, through the decoder. Throws std::out_of_range naming an id past the
  // vocabulary, and TokenizerError for a decoder that is not implemented.
  std::string Decode(std::span<const uint32_t> ids) const;

  // One past the largest id.
  uint32_t vocab_size() const;
  std::optional<uint32_t> bos() const { return bos_; }
  uint32_t eos() const { return eos_; }
  const DocumentFrame& frame() const { return frame_; }
  // What was loaded, for messages: "tokenizer.json (BPE)", "tokenizer.model
  // (SentencePiece)", "GPT-2's encoder.json and vocab.bpe".
  const std::string& kind() const { return kind_; }

 private:
  Tokenizer() = default;
  // Reads BOS and EOS from `config_json` (empty: none) and the engine, and sets the frame.
  // Errors name `config_source`, or without a config the tokenizer's own `source`.
  void Configure(std::string_view config_json, const std::string& config_source, const std::string& source);

  std::shared_ptr<const TokenizerEngine> engine_;
  std::optional<uint32_t> bos_;
  uint32_t eos_ = 0;
  DocumentFrame frame_;
  std::string kind_;
};

// The byte-to-unicode map of GPT-2's vocabulary files (and of every ByteLevel vocabulary):
// printable Latin-1 bytes stand for themselves, the other 68 become U+0100.. in byte order.
// Returns the code point of `byte`.
uint32_t Gpt2ByteCodePoint(uint8_t byte);

}  // namespace meshtrain::text
