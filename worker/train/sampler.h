// Text from a model: continue a prompt one token at a time from the engine's next-token
// distribution (temperature, top-k), and show the tokens as text.
// Thread-safety: plain functions; the engine is used as its own contract says.

#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "api/training_job.h"
#include "worker/parallel/engine.h"
#include "worker/text/tokenizer.h"

namespace meshtrain::train {

struct SamplingOptions {
  uint64_t seed = 1;
  double temperature = 1.0;  // > 0; below 1 sharpens the distribution
  int top_k = 0;             // 0: every token; else only the k most likely
  uint32_t vocabulary = 0;   // draw only ids below it (a tokenizer's size); 0: the model's
  std::vector<uint32_t> stop;  // ids that end the sample (TextCodec::Stop: the EOS), not returned
};

// Up to `tokens` ids sampled after `prompt` (the last `seq` tokens are the context), from a
// model of vocabulary `vocab_size`, ending before the first id of `options.stop`.
// Collective as Engine::NextTokenProbabilities: every rank of a sharded engine calls it,
// with the same seed, and gets the same ids (and so stops at the same one).
std::vector<uint32_t> SampleTokens(parallel::Engine& engine, std::span<const uint32_t> prompt, int tokens, int seq,
                                   int vocab_size, const SamplingOptions& options);

// How a job's tokens become text: the tokenizer of spec.model.tokenizer (any of
// text/tokenizer.h's), or bytes for a 256-token vocabulary, or else the ids themselves.
// Immutable after construction.
class TextCodec {
 public:
  // Throws std::invalid_argument naming spec.model.tokenizer when it cannot be loaded or
  // has more tokens than the model.
  explicit TextCodec(const api::ModelSpec& model);
  // From a tokenizer directory (empty: none) for a model of `vocab_size`.
  TextCodec(const std::string& tokenizer_dir, int64_t vocab_size, const std::string& field);

  // The text of `ids`; with a tokenizer, it ends before the first EOS (a sample's end).
  std::string Decode(std::span<const uint32_t> ids) const;
  // The ids of `text` (bytes without a tokenizer; throws std::invalid_argument when the
  // model's vocabulary is neither bytes nor a tokenizer's).
  std::vector<uint32_t> Encode(const std::string& text) const;
  // A prompt as the model saw documents start: the tokenizer's frame before it (the BOS, or
  // GPT-2's <|endoftext|>), then its ids.
  std::vector<uint32_t> Prompt(const std::string& text) const;
  // What an unprompted sample starts from: a document's start (the BOS, or else the EOS
  // that ends the one before) with a tokenizer, else a newline.
  std::vector<uint32_t> Start() const;
  // The ids that end a sample (SamplingOptions::stop): the tokenizer's EOS; none for bytes.
  std::vector<uint32_t> Stop() const;
  // The ids samples may use (SamplingOptions::vocabulary).
  uint32_t vocabulary() const;
  // What the tokenizer puts before and after each document (text::DocumentFrame); none
  // without a tokenizer.
  text::DocumentFrame frame() const;

 private:
  std::shared_ptr<const text::Tokenizer> tokenizer_;
  int64_t vocab_size_;
};

}  // namespace meshtrain::train
