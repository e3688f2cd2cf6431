#include "worker/train/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <stdexcept>

#include "worker/train/token_file.h"

namespace meshtrain::train {

std::vector<uint32_t> SampleTokens(parallel::Engine& engine, std::span<const uint32_t> prompt, int tokens, int seq,
                                   int vocab_size, const SamplingOptions& options) {
  if (prompt.empty()) throw std::invalid_argument("the prompt has no tokens");
  if (!(options.temperature > 0)) throw std::invalid_argument("the temperature must be positive");
  const int V = options.vocabulary > 0 ? std::min(vocab_size, int(options.vocabulary)) : vocab_size;
  std::mt19937_64 rng(options.seed);
  std::vector<uint32_t> text(prompt.begin(), prompt.end());
  std::vector<int32_t> window;
  std::vector<double> weight(size_t(V), 0.0);
  std::vector<int> order(static_cast<size_t>(V));
  for (int i = 0; i < tokens; ++i) {
    const size_t n = std::min(text.size(), size_t(seq));
    window.assign(text.end() - long(n), text.end());
    const std::vector<float> probs = engine.NextTokenProbabilities(window.data(), int(n));
    // p^(1/temperature) over the allowed ids, then only the top k of them.
    for (int v = 0; v < V; ++v) weight[size_t(v)] = std::pow(double(probs[size_t(v)]), 1.0 / options.temperature);
    if (options.top_k > 0 && options.top_k < V) {
      std::iota(order.begin(), order.end(), 0);
      std::nth_element(order.begin(), order.begin() + options.top_k, order.end(),
                       [&](int a, int b) { return weight[size_t(a)] > weight[size_t(b)]; });
      for (auto it = order.begin() + options.top_k; it != order.end(); ++it) weight[size_t(*it)] = 0;
    }
    const double total = std::accumulate(weight.begin(), weight.end(), 0.0);
    const double u = std::uniform_real_distribution<double>(0.0, 1.0)(rng) * total;
    double cdf = 0;
    int next = V - 1;
    for (int v = 0; v < V; ++v) {
      cdf += weight[size_t(v)];
      if (u < cdf) {
        next = v;
        break;
      }
    }
    if (std::find(options.stop.begin(), options.stop.end(), uint32_t(next)) != options.stop.end()) break;
    text.push_back(uint32_t(next));
  }
  return std::vector<uint32_t>(text.begin() + long(prompt.size()), text.end());
}

TextCodec::TextCodec(const api::ModelSpec& model)
    : TextCodec(model.tokenizer, model.vocab_size.value_or(0), "spec.model.tokenizer") {}

TextCodec::TextCodec(const std::string& tokenizer_dir, int64_t vocab_size, const std::string& field)
    : vocab_size_(vocab_size) {
  if (tokenizer_dir.empty()) return;
  try {
    tokenizer_ = std::make_shared<const text::Tokenizer>(text::Tokenizer::Load(tokenizer_dir));
  } catch (const text::TokenizerError& e) {
    throw std::invalid_argument(field + ": " + e.what());
  }
  if (int64_t(tokenizer_->vocab_size()) > vocab_size) {
    throw std::invalid_argument(field + ": the tokenizer has " + std::to_string(tokenizer_->vocab_size()) +
                                " tokens, more than the model's vocabulary of " + std::to_string(vocab_size) +
                                " (spec.model.vocabSize)");
  }
}

std::string TextCodec::Decode(std::span<const uint32_t> ids) const {
  if (!tokenizer_) return TokensToText(ids, vocab_size_);
  const auto eos = std::find(ids.begin(), ids.end(), tokenizer_->eos());
  return tokenizer_->Decode(ids.first(size_t(eos - ids.begin())));
}

std::vector<uint32_t> TextCodec::Encode(const std::string& text) const {
  if (tokenizer_) return tokenizer_->Encode(text);
  if (vocab_size_ != 256) {
    throw std::invalid_argument("a model of " + std::to_string(vocab_size_) +
                                " tokens needs its tokenizer to read a prompt (spec.model.tokenizer, --tokenizer)");
  }
  return ByteTokens(text);
}

std::vector<uint32_t> TextCodec::Prompt(const std::string& text) const {
  std::vector<uint32_t> ids = tokenizer_ ? tokenizer_->frame().before : std::vector<uint32_t>{};
  const std::vector<uint32_t> encoded = Encode(text);
  ids.insert(ids.end(), encoded.begin(), encoded.end());
  return ids;
}

std::vector<uint32_t> TextCodec::Start() const {
  if (!tokenizer_) return {'\n'};
  if (!tokenizer_->frame().before.empty()) return tokenizer_->frame().before;
  return {tokenizer_->eos()};
}

std::vector<uint32_t> TextCodec::Stop() const {
  return tokenizer_ ? std::vector<uint32_t>{tokenizer_->eos()} : std::vector<uint32_t>{};
}

text::DocumentFrame TextCodec::frame() const { return tokenizer_ ? tokenizer_->frame() : text::DocumentFrame{}; }

uint32_t TextCodec::vocabulary() const { return tokenizer_ ? tokenizer_->vocab_size() : uint32_t(vocab_size_); }

}  // namespace meshtrain::train
