// Hugging Face's tokenizer.json with a BPE model, and GPT-2's OpenAI files as the same
// pipeline (tokenizer.h says what is implemented): this file reads the files and wires the
// components of hf_*.h. Encoding follows tokenizers (Rust):
//   1. added tokens with normalized: false are found in the raw text (leftmost, longest),
//      each other stretch normalized on its own, then the normalized added tokens found
//      (hf_added_tokens.h, hf_normalizers.h);
//   2. each remaining stretch goes through the pre-tokenizers, in order, each applied to
//      every piece the previous one left (hf_pre_tokenizers.h);
//   3. the BPE model encodes each final piece (hf_model.h, bpe_model.h).
// Long stretches are encoded on several threads (hf_parallel.h). The post-processor's
// template gives the ids around a document (hf_post_processor.h), and the decoders turn
// ids back into text (hf_decoders.h).

#include <algorithm>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "api/hf_config.h"
#include "worker/text/bpe_model.h"
#include "worker/text/hf_added_tokens.h"
#include "worker/text/hf_decoders.h"
#include "worker/text/hf_json.h"
#include "worker/text/hf_model.h"
#include "worker/text/hf_normalizers.h"
#include "worker/text/hf_parallel.h"
#include "worker/text/hf_post_processor.h"
#include "worker/text/hf_pre_tokenizers.h"
#include "worker/text/tokenizer.h"
#include "worker/text/tokenizer_engine.h"

namespace meshtrain::text {
namespace {

using Json = nlohmann::json;

class HuggingFaceEngine;

class HfSession : public TokenizerEngine::Session {
 public:
  explicit HfSession(const HuggingFaceEngine& engine);
  void Encode(std::string_view text, std::vector<uint32_t>& ids) override;

 private:
  const HuggingFaceEngine& engine_;
  hf::PartEncoder encoder_;
};

class HuggingFaceEngine : public TokenizerEngine {
 public:
  // Builds from tokenizer.json's contents.
  HuggingFaceEngine(const Json& doc, const std::string& source);
  // GPT-2's OpenAI files.
  HuggingFaceEngine(std::vector<std::pair<std::string, uint32_t>> vocab,
                    const std::vector<std::pair<std::string, std::string>>& merges, const std::string& source);

  std::unique_ptr<Session> NewSession() const override { return std::make_unique<HfSession>(*this); }
  void EncodeParallel(std::string_view text, int threads, std::vector<uint32_t>& ids,
                      const ProgressFn& progress) const override;
  std::string Decode(std::span<const uint32_t> ids) const override;
  uint32_t vocab_size() const override { return uint32_t(spelled_.size()); }
  std::optional<uint32_t> IdOf(std::string_view content) const override {
    for (const hf::AddedToken& t : added_.tokens()) {
      if (t.content == content) return t.id;
    }
    return model_->IdOf(content);
  }
  Specials specials() const override { return specials_; }
  std::string kind() const override { return kind_; }

  // The added tokens and stretches of `text`, each stretch normalized and transformed by
  // the first pre-tokenizer.
  void Items(std::string_view text, hf::Matchers& matchers, std::vector<hf::Item>& items) const;

 private:
  friend class HfSession;
  void Finish();

  std::string source_, kind_;
  hf::Normalizers normalizers_;
  hf::PreTokenizers pre_;
  hf::Decoders decoders_;
  std::optional<BpeModel> model_;
  hf::AddedTokens added_;
  std::vector<std::string> spelled_;  // id -> token as the vocabulary spells it
  std::vector<bool> is_added_;
  Specials specials_;
  hf::Chunking chunking_ = hf::Chunking::kWhole;
};

// ---- Reading the files ----------------------------------------------------------------

HuggingFaceEngine::HuggingFaceEngine(const Json& doc, const std::string& source) : source_(source) {
  kind_ = "tokenizer.json (BPE)";
  if (!doc.is_object()) hf::Fail(source, "(top)", "expected a JSON object");
  const Json& model = doc.value("model", Json());
  hf::CheckModelType(model, source);
  normalizers_.Parse(doc.value("normalizer", Json()), source_, "normalizer");
  pre_.Parse(doc.value("pre_tokenizer", Json()), source_, "pre_tokenizer");
  hf::ParsePostProcessor(doc.value("post_processor", Json()), source_, "post_processor", specials_);
  decoders_.Parse(doc.value("decoder", Json()), source_, "decoder");

  std::vector<std::pair<std::string, uint32_t>> tokens;
  model_.emplace(hf::ParseBpeModel(model, pre_.byte_level(), source, tokens));
  added_.Parse(doc.value("added_tokens", Json::array()), source);
  const std::vector<hf::AddedToken>& added = added_.tokens();
  // Ids are 0..n-1 without gaps (Finish), so none reaches the number of tokens given: an
  // id sizes the tables below, and is checked before it does.
  const size_t given = tokens.size() + added.size();
  auto past = [&](uint32_t id) { return "has id " + std::to_string(id) + "; the " + std::to_string(given) +
                                        " tokens of model.vocab and added_tokens have ids 0.." +
                                        std::to_string(given - 1) + " without gaps"; };
  for (const auto& [token, id] : tokens) {
    if (id >= given) hf::Fail(source, "model.vocab", "token \"" + token + "\" " + past(id));
  }
  for (size_t i = 0; i < added.size(); ++i) {
    if (added[i].id >= given) {
      hf::Fail(source, "added_tokens[" + std::to_string(i) + "]", "\"" + added[i].content + "\" " + past(added[i].id));
    }
  }
  for (const auto& [token, id] : tokens) {
    if (spelled_.size() <= id) spelled_.resize(size_t(id) + 1);
    spelled_[id] = token;
  }
  Finish();
}

HuggingFaceEngine::HuggingFaceEngine(std::vector<std::pair<std::string, uint32_t>> vocab,
                                     const std::vector<std::pair<std::string, std::string>>& merges,
                                     const std::string& source)
    : source_(source) {
  kind_ = "GPT-2's encoder.json and vocab.bpe";
  pre_.UseGpt2(source);
  decoders_.UseByteLevel();
  BpeModel::Options options;
  options.byte_level = true;
  model_.emplace(BpeModel::Build(vocab, merges, options, source));
  for (const auto& [token, id] : vocab) {
    if (spelled_.size() <= id) spelled_.resize(size_t(id) + 1);
    spelled_[id] = token;
  }
  Finish();
}

void HuggingFaceEngine::Finish() {
  is_added_.assign(spelled_.size(), false);
  for (const hf::AddedToken& t : added_.tokens()) {
    if (spelled_.size() <= t.id) {
      spelled_.resize(size_t(t.id) + 1);
      is_added_.resize(size_t(t.id) + 1, false);
    }
    spelled_[t.id] = t.content;
    is_added_[t.id] = true;
  }
  for (size_t id = 0; id < spelled_.size(); ++id) {
    if (spelled_[id].empty()) {
      throw TokenizerError(source_ + ": id " + std::to_string(id) + " has no token (ids must be 0.." +
                           std::to_string(spelled_.size() - 1) + " without gaps)");
    }
  }
  hf::CheckTemplateIds(specials_, spelled_.size(), source_);
  chunking_ = hf::ChunkingOf(pre_, *model_);
}

// ---- Encoding -------------------------------------------------------------------------

HfSession::HfSession(const HuggingFaceEngine& engine)
    : engine_(engine), encoder_(engine.pre_, *engine.model_, engine.chunking_) {}

void HuggingFaceEngine::Items(std::string_view text, hf::Matchers& matchers, std::vector<hf::Item>& items) const {
  items.clear();
  const auto token = [&](uint32_t id) {
    hf::Item item;
    item.token = id;
    items.push_back(std::move(item));
  };
  const auto stretch = [&](std::string_view s, bool at_origin) {
    hf::Item item;
    item.subject = pre_.steps().empty() ? std::string(s) : pre_.Transform(0, s, at_origin);
    item.at_origin = at_origin;
    items.push_back(std::move(item));
  };
  const auto raw_stretch = [&](std::string_view s, bool at_origin) {
    std::string normalized(s);
    normalizers_.Normalize(normalized, matchers);
    added_.Split(normalized, at_origin, true, stretch, token);
  };
  added_.Split(text, true, false, raw_stretch, token);
}

void HfSession::Encode(std::string_view text, std::vector<uint32_t>& ids) {
  std::vector<hf::Item> items;
  engine_.Items(text, encoder_.matchers(), items);
  for (const hf::Item& item : items) {
    if (item.token != hf::kNoToken) {
      ids.push_back(item.token);
      continue;
    }
    hf::Part part;
    part.to = item.subject.size();
    part.last = true;
    encoder_.EncodePart(item, part);
    ids.insert(ids.end(), part.ids.begin(), part.ids.end());
  }
}

void HuggingFaceEngine::EncodeParallel(std::string_view text, int threads, std::vector<uint32_t>& ids,
                                       const ProgressFn& progress) const {
  threads = std::max(1, threads);
  std::vector<hf::PartEncoder> encoders;
  for (int t = 0; t < threads; ++t) encoders.emplace_back(pre_, *model_, chunking_);
  std::vector<hf::Item> items;
  Items(text, encoders[0].matchers(), items);
  hf::EncodeInParts(items, text.size(), *model_, chunking_, encoders, ids, progress);
}

// ---- Decoding -------------------------------------------------------------------------

std::string HuggingFaceEngine::Decode(std::span<const uint32_t> ids) const {
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (uint32_t id : ids) {
    if (id >= spelled_.size()) {
      throw std::out_of_range("token id " + std::to_string(id) + " is past the tokenizer's vocabulary of " +
                              std::to_string(spelled_.size()));
    }
    tokens.push_back(spelled_[id]);
  }
  return decoders_.Decode(std::move(tokens), source_);
}

Json ParseJson(std::string_view text, const std::string& source) {
  try {
    return api::ParseModelJson(text, source);
  } catch (const api::ModelJsonError& e) {
    throw TokenizerError(e.what());
  }
}

}  // namespace

std::shared_ptr<const TokenizerEngine> MakeHuggingFaceEngine(std::string_view tokenizer_json, const std::string& source) {
  const Json doc = ParseJson(tokenizer_json, source);
  try {
    return std::make_shared<HuggingFaceEngine>(doc, source);
  } catch (const Json::exception& e) {  // a value of a type no check above expected
    throw TokenizerError(source + ": " + e.what());
  }
}

std::shared_ptr<const TokenizerEngine> MakeOpenAiEngine(std::string_view encoder_json, std::string_view vocab_bpe,
                                                        const std::string& source) {
  const std::string encoder_source = source + " (encoder.json)";
  const Json encoder = ParseJson(encoder_json, encoder_source);
  if (!encoder.is_object() || encoder.empty()) throw TokenizerError(encoder_source + ": the vocabulary is not a non-empty object");
  std::vector<std::pair<std::string, uint32_t>> vocab;
  std::vector<bool> seen(encoder.size());
  for (const auto& [token, id] : encoder.items()) {
    if (!id.is_number_unsigned() || id.get<uint64_t>() >= encoder.size()) {
      throw TokenizerError(encoder_source + ": token \"" + token + "\" has id " + id.dump() + "; ids must be 0.." +
                           std::to_string(encoder.size() - 1));
    }
    if (seen[id.get<size_t>()]) throw TokenizerError(encoder_source + ": id " + id.dump() + " is given to two tokens");
    seen[id.get<size_t>()] = true;
    vocab.emplace_back(token, id.get<uint32_t>());
  }
  return std::make_shared<HuggingFaceEngine>(std::move(vocab), hf::ParseMergeLines(vocab_bpe, source + " (vocab.bpe)"),
                                             source);
}

}  // namespace meshtrain::text
