// What a tokenizer implementation gives the Tokenizer facade (tokenizer.h): encoding
// sessions, encoding a long text on several threads, decoding, and what its own files say
// about BOS and EOS. Internal to worker/text. Thread-safety: engines are immutable; a
// Session is one thread's.

#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace meshtrain::text {

using ProgressFn = std::function<void(size_t done_bytes)>;

class TokenizerEngine {
 public:
  virtual ~TokenizerEngine() = default;

  class Session {
   public:
    virtual ~Session() = default;
    // Appends the ids of `text`, which is valid UTF-8.
    virtual void Encode(std::string_view text, std::vector<uint32_t>& ids) = 0;
  };
  virtual std::unique_ptr<Session> NewSession() const = 0;

  // The ids of valid UTF-8 `text`, equal to one Session's, computed on `threads` threads.
  virtual void EncodeParallel(std::string_view text, int threads, std::vector<uint32_t>& ids,
                              const ProgressFn& progress) const = 0;

  virtual std::string Decode(std::span<const uint32_t> ids) const = 0;
  virtual uint32_t vocab_size() const = 0;
  // The id of a token spelled `content` (an added token's content, or a vocabulary entry).
  virtual std::optional<uint32_t> IdOf(std::string_view content) const = 0;

  // What the files say beside tokenizer_config.json: the post-processor's template (ids
  // before and after a single sequence), or SentencePiece's own BOS and EOS.
  struct Specials {
    bool has_template = false;
    std::vector<uint32_t> template_before, template_after;
    std::optional<uint32_t> bos, eos;
  };
  virtual Specials specials() const = 0;
  virtual std::string kind() const = 0;
};

std::shared_ptr<const TokenizerEngine> MakeHuggingFaceEngine(std::string_view tokenizer_json, const std::string& source);
std::shared_ptr<const TokenizerEngine> MakeOpenAiEngine(std::string_view encoder_json, std::string_view vocab_bpe,
                                                        const std::string& source);
std::shared_ptr<const TokenizerEngine> MakeSentencePieceEngine(std::string_view model, const std::string& source);

// Runs task(i, worker) for every i in [0, n) on `threads` threads (worker in [0, threads)),
// calling `progress` from the calling thread about once a second with the sum of
// bytes(i) over the tasks done. Rethrows the first exception a task threw.
void RunTasks(size_t n, int threads, const std::function<void(size_t task, int worker)>& task,
              const std::function<size_t(size_t task)>& bytes, const ProgressFn& progress);

}  // namespace meshtrain::text
