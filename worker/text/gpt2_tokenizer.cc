#include "worker/text/gpt2_tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <array>
#include <fstream>
#include <iterator>
#include <limits>
#include <queue>
#include <sstream>

#include <nlohmann/json.hpp>

#include "worker/text/utf8.h"

namespace meshtrain::text {
namespace {

using Json = nlohmann::json;

// ECMAScript's \s (WhiteSpace and LineTerminator), for a character class.
constexpr const char* kSpace = "\\t\\n\\x0b\\f\\r \\x{a0}\\x{1680}\\x{2000}-\\x{200a}\\x{2028}\\x{2029}\\x{202f}"
                               "\\x{205f}\\x{3000}\\x{feff}";

std::string Gpt2Pattern() {
  const std::string s = kSpace;
  return "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^" + s + "\\p{L}\\p{N}]+|[" + s + "]+(?![^" + s + "])|[" +
         s + "]+";
}

// Pre-tokens longer than this are encoded without the cache, which would only grow.
constexpr size_t kLongestCached = 64;
constexpr size_t kCacheEntries = size_t(1) << 20;
constexpr uint32_t kNone = std::numeric_limits<uint32_t>::max();

const std::array<uint32_t, 256>& ByteCodePoints() {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    uint32_t next = 256;
    for (uint32_t b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      t[b] = printable ? b : next++;
    }
    return t;
  }();
  return table;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw TokenizerError(path + ": cannot open");
  std::string data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) throw TokenizerError(path + ": read error");
  return data;
}

bool Exists(const std::string& path) { return std::ifstream(path).good(); }

Json ParseJson(std::string_view text, const std::string& source) {
  try {
    return Json::parse(text);
  } catch (const Json::exception& e) {
    throw TokenizerError(source + ": not valid JSON: " + e.what());
  }
}

}  // namespace

uint32_t Gpt2ByteCodePoint(uint8_t byte) { return ByteCodePoints()[byte]; }

struct Gpt2Tokenizer::Pattern {
  pcre2_code* code = nullptr;
  ~Pattern() { pcre2_code_free(code); }
};

struct Gpt2Tokenizer::Session::MatchData {
  pcre2_match_data* data = nullptr;
  ~MatchData() { pcre2_match_data_free(data); }
};

Gpt2Tokenizer::Gpt2Tokenizer(Gpt2Tokenizer&&) noexcept = default;
Gpt2Tokenizer& Gpt2Tokenizer::operator=(Gpt2Tokenizer&&) noexcept = default;
Gpt2Tokenizer::~Gpt2Tokenizer() = default;

namespace {

// Vocabulary entries as the files spell them (byte-mapped code points) to their bytes.
std::string TokenBytes(const std::string& spelled, const std::string& source) {
  static const std::unordered_map<uint32_t, uint8_t> byte_of = [] {
    std::unordered_map<uint32_t, uint8_t> m;
    for (int b = 0; b < 256; ++b) m[ByteCodePoints()[b]] = uint8_t(b);
    return m;
  }();
  std::string bytes;
  size_t pos = 0;
  while (pos < spelled.size()) {
    const uint32_t cp = NextCodePoint(spelled, &pos);
    const auto it = byte_of.find(cp);
    if (it == byte_of.end()) {
      throw TokenizerError(source + ": token \"" + spelled + "\" has a character outside GPT-2's byte alphabet");
    }
    bytes += char(it->second);
  }
  return bytes;
}

// The vocabulary object (spelled token -> id) as id -> spelled token, checked dense.
std::vector<std::string> VocabularyById(const Json& vocab, const std::string& source) {
  if (!vocab.is_object() || vocab.empty()) throw TokenizerError(source + ": the vocabulary is not a non-empty object");
  std::vector<std::string> spelled(vocab.size());
  std::vector<bool> seen(vocab.size());
  for (const auto& [token, id] : vocab.items()) {
    if (!id.is_number_unsigned() || id.get<uint64_t>() >= vocab.size()) {
      throw TokenizerError(source + ": token \"" + token + "\" has id " + id.dump() + "; ids must be 0.." +
                           std::to_string(vocab.size() - 1));
    }
    const size_t i = id.get<size_t>();
    if (seen[i]) throw TokenizerError(source + ": id " + std::to_string(i) + " is given to two tokens");
    seen[i] = true;
    spelled[i] = token;
  }
  return spelled;
}

}  // namespace

Gpt2Tokenizer Gpt2Tokenizer::Load(const std::string& dir) {
  const std::string encoder = dir + "/encoder.json", merges = dir + "/vocab.bpe", hf = dir + "/tokenizer.json";
  if (Exists(encoder) && Exists(merges)) {
    return FromOpenAiFiles(ReadFile(encoder), ReadFile(merges), dir + "/{encoder.json,vocab.bpe}");
  }
  if (Exists(hf)) return FromHuggingFaceFile(ReadFile(hf), hf);
  throw TokenizerError(dir + ": no GPT-2 tokenizer here: expected encoder.json and vocab.bpe, or tokenizer.json");
}

namespace {

// Merges as (left, right) spelled pairs, in rank order, from vocab.bpe's lines.
std::vector<std::pair<std::string, std::string>> ParseMergeLines(std::string_view text, const std::string& source) {
  std::vector<std::pair<std::string, std::string>> merges;
  std::istringstream lines{std::string(text)};
  std::string line;
  for (int number = 1; std::getline(lines, line); ++number) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (number == 1 && line.rfind("#version", 0) == 0) continue;
    if (line.empty()) continue;
    std::istringstream parts(line);
    std::string left, right, extra;
    if (!(parts >> left >> right) || (parts >> extra)) {
      throw TokenizerError(source + ": line " + std::to_string(number) + " is not a merge of two tokens: \"" + line + "\"");
    }
    merges.emplace_back(left, right);
  }
  return merges;
}

}  // namespace

Gpt2Tokenizer Gpt2Tokenizer::FromOpenAiFiles(std::string_view encoder_json, std::string_view vocab_bpe,
                                             const std::string& source) {
  const Json vocab = ParseJson(encoder_json, source + " (encoder.json)");
  const std::vector<std::string> spelled = VocabularyById(vocab, source + " (encoder.json)");
  Gpt2Tokenizer t;
  std::unordered_map<std::string, uint32_t> id_of;
  for (size_t i = 0; i < spelled.size(); ++i) {
    t.token_bytes_.push_back(TokenBytes(spelled[i], source));
    id_of[spelled[i]] = uint32_t(i);
  }
  const auto eot = id_of.find("<|endoftext|>");
  if (eot == id_of.end()) throw TokenizerError(source + ": encoder.json has no \"<|endoftext|>\" token");
  t.end_of_text_ = eot->second;

  uint32_t rank = 0;
  for (const auto& [left, right] : ParseMergeLines(vocab_bpe, source + " (vocab.bpe)")) {
    const auto l = id_of.find(left), r = id_of.find(right), m = id_of.find(left + right);
    if (l == id_of.end() || r == id_of.end() || m == id_of.end()) {
      throw TokenizerError(source + ": merge " + std::to_string(rank + 1) + " \"" + left + " " + right +
                           "\" names a token the vocabulary lacks");
    }
    if (!t.merges_.emplace(PairKey(l->second, r->second), Merge{rank, m->second}).second) {
      throw TokenizerError(source + ": merge \"" + left + " " + right + "\" is listed twice");
    }
    ++rank;
  }
  t.Finish(source);
  return t;
}

Gpt2Tokenizer Gpt2Tokenizer::FromHuggingFaceFile(std::string_view tokenizer_json, const std::string& source) {
  const Json doc = ParseJson(tokenizer_json, source);
  const Json* model = doc.contains("model") ? &doc["model"] : nullptr;
  if (model == nullptr || model->value("type", "") != "BPE") {
    throw TokenizerError(source + ": model.type is not \"BPE\"; only GPT-2's byte-level BPE is supported");
  }
  const Json& pre = doc.value("pre_tokenizer", Json());
  if (!pre.is_object() || pre.value("type", "") != "ByteLevel") {
    throw TokenizerError(source + ": pre_tokenizer is not \"ByteLevel\"; only GPT-2's byte-level BPE is supported");
  }
  // Written as vocab.bpe lines, the merges go through the same checks as OpenAI's files.
  std::string lines;
  for (const Json& m : model->value("merges", Json::array())) {
    if (m.is_string()) {
      lines += m.get<std::string>();
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      lines += m[0].get<std::string>() + " " + m[1].get<std::string>();
    } else {
      throw TokenizerError(source + ": model.merges holds " + m.dump() + ", not a merge");
    }
    lines += '\n';
  }
  Json vocab = model->value("vocab", Json());
  for (const Json& added : doc.value("added_tokens", Json::array())) {
    if (added.is_object() && added.contains("content") && added.contains("id")) vocab[added["content"].get<std::string>()] = added["id"];
  }
  return FromOpenAiFiles(vocab.dump(), lines, source);
}

void Gpt2Tokenizer::Finish(const std::string& source) {
  std::unordered_map<std::string, uint32_t> single;
  for (size_t i = 0; i < token_bytes_.size(); ++i) {
    if (token_bytes_[i].size() == 1) single.emplace(token_bytes_[i], uint32_t(i));
  }
  for (int b = 0; b < 256; ++b) {
    const auto it = single.find(std::string(1, char(b)));
    if (it == single.end()) throw TokenizerError(source + ": the vocabulary lacks the token of byte " + std::to_string(b));
    byte_token_[b] = it->second;
  }
  // The merge loop takes pairs lowest rank first from a heap, which equals GPT-2's
  // round-by-round merging only if no merge uses a token that a later merge makes.
  std::vector<uint32_t> made_at(token_bytes_.size(), kNone);
  for (uint32_t b : byte_token_) made_at[b] = 0;
  std::vector<std::pair<uint32_t, uint64_t>> by_rank;
  for (const auto& [key, merge] : merges_) by_rank.emplace_back(merge.rank, key);
  std::sort(by_rank.begin(), by_rank.end());
  for (const auto& [rank, key] : by_rank) {
    const uint32_t left = uint32_t(key >> 32), right = uint32_t(key);
    if (made_at[left] == kNone || made_at[right] == kNone || made_at[left] > rank || made_at[right] > rank) {
      throw TokenizerError(source + ": merge " + std::to_string(rank + 1) +
                           " uses a token that no earlier merge makes; not a GPT-2 merge list");
    }
    const uint32_t result = merges_.at(key).result;
    if (made_at[result] == kNone) made_at[result] = rank + 1;
  }

  pattern_ = std::make_unique<Pattern>();
  const std::string pattern = Gpt2Pattern();
  int error = 0;
  PCRE2_SIZE offset = 0;
  pattern_->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), PCRE2_UTF, &error,
                                 &offset, nullptr);
  if (pattern_->code == nullptr) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(error, message, sizeof message);
    throw std::logic_error(std::string("GPT-2's pattern does not compile: ") + reinterpret_cast<char*>(message));
  }
  pcre2_jit_compile(pattern_->code, PCRE2_JIT_COMPLETE);  // without a JIT, matching interprets
}

Gpt2Tokenizer::Session::Session(const Gpt2Tokenizer& tokenizer)
    : tokenizer_(&tokenizer), match_(std::make_unique<MatchData>()) {
  match_->data = pcre2_match_data_create_from_pattern(tokenizer.pattern_->code, nullptr);
}

Gpt2Tokenizer::Session::Session(Session&&) noexcept = default;
Gpt2Tokenizer::Session::~Session() = default;

size_t Gpt2Tokenizer::Session::Encode(std::string_view input, std::vector<uint32_t>& ids) {
  size_t replaced = 0;
  const std::string text = ScrubUtf8(input, &replaced);
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t at = 0;
  while (at < text.size()) {
    const int rc = pcre2_match(tokenizer_->pattern_->code, subject, text.size(), at, PCRE2_NO_UTF_CHECK, match_->data,
                               nullptr);
    const PCRE2_SIZE* range = pcre2_get_ovector_pointer(match_->data);
    // Every character is a letter, a number, a space or other, so a match always starts
    // at `at`; were it not so, the unmatched bytes would still be kept as their own piece.
    const size_t start = rc >= 0 ? range[0] : text.size(), end = rc >= 0 ? range[1] : text.size();
    if (start > at) EncodePreToken(std::string_view(text).substr(at, start - at), ids);
    if (end > start) EncodePreToken(std::string_view(text).substr(start, end - start), ids);
    at = end;
  }
  return replaced;
}

void Gpt2Tokenizer::Session::EncodePreToken(std::string_view bytes, std::vector<uint32_t>& ids) {
  const Gpt2Tokenizer& t = *tokenizer_;
  const bool cacheable = bytes.size() <= kLongestCached;
  if (cacheable) {
    const auto hit = cache_.find(std::string(bytes));
    if (hit != cache_.end()) {
      ids.insert(ids.end(), hit->second.begin(), hit->second.end());
      return;
    }
  }
  const auto n = uint32_t(bytes.size());
  symbol_.resize(n);
  next_.resize(n);
  prev_.resize(n);
  for (uint32_t i = 0; i < n; ++i) {
    symbol_[i] = t.byte_token_[uint8_t(bytes[i])];
    next_[i] = i + 1 < n ? i + 1 : kNone;
    prev_[i] = i > 0 ? i - 1 : kNone;
  }
  // Candidates (rank, left position, left id, right id), lowest rank then leftmost first.
  // Stale ones are recognised by the symbols no longer being there.
  struct Candidate {
    uint32_t rank, pos, left, right;
    bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> heap;
  auto consider = [&](uint32_t pos) {
    if (pos == kNone || next_[pos] == kNone) return;
    const auto m = t.merges_.find(PairKey(symbol_[pos], symbol_[next_[pos]]));
    if (m != t.merges_.end()) heap.push({m->second.rank, pos, symbol_[pos], symbol_[next_[pos]]});
  };
  for (uint32_t i = 0; i + 1 < n; ++i) consider(i);
  while (!heap.empty()) {
    const Candidate c = heap.top();
    heap.pop();
    const uint32_t right = next_[c.pos];
    if (symbol_[c.pos] != c.left || right == kNone || symbol_[right] != c.right) continue;
    symbol_[c.pos] = t.merges_.at(PairKey(c.left, c.right)).result;
    symbol_[right] = kNone;
    next_[c.pos] = next_[right];
    if (next_[right] != kNone) prev_[next_[right]] = c.pos;
    consider(prev_[c.pos]);
    consider(c.pos);
  }
  const size_t first = ids.size();
  for (uint32_t i = 0; i != kNone; i = next_[i]) ids.push_back(symbol_[i]);
  if (cacheable) {
    if (cache_.size() >= kCacheEntries) cache_.clear();
    cache_.emplace(std::string(bytes), std::vector<uint32_t>(ids.begin() + long(first), ids.end()));
  }
}

std::vector<uint32_t> Gpt2Tokenizer::Encode(std::string_view text) const {
  std::vector<uint32_t> ids;
  Session(*this).Encode(text, ids);
  return ids;
}

std::string Gpt2Tokenizer::Decode(std::span<const uint32_t> ids) const {
  std::string text;
  for (uint32_t id : ids) {
    if (id >= token_bytes_.size()) {
      throw std::out_of_range("token id " + std::to_string(id) + " is past the tokenizer's vocabulary of " +
                              std::to_string(token_bytes_.size()));
    }
    text += token_bytes_[id];
  }
  return text;
}

}  // namespace meshtrain::text
