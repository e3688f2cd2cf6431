// Hugging Face's tokenizer.json with a BPE model, and GPT-2's OpenAI files as the same
// pipeline (tokenizer.h says what is implemented). Encoding follows tokenizers (Rust):
//   1. added tokens with normalized: false are found in the raw text (leftmost, longest),
//      each other stretch normalized on its own, then the normalized added tokens found;
//   2. each remaining stretch goes through the pre-tokenizers, in order, each applied to
//      every piece the previous one left (Split, ByteLevel, Metaspace);
//   3. the BPE model encodes each final piece (bpe_model.h).
// Long stretches are encoded on several threads (EncodeParallel): where the first
// pre-tokenizer is a regular expression, each part is scanned from a guessed cut with
// PCRE2's hard partial matching, which stops at the first match that could end otherwise
// with more text; joining the parts, the true scan runs from there until it meets a match
// start that the next part found, from which on both scans are the same. Where there is
// no regular expression, parts are cut only where no merge joins the symbols either side.

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <utf8proc.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <map>
#include <sstream>
#include <unordered_map>

#include <nlohmann/json.hpp>

#include "api/hf_config.h"
#include "worker/text/bpe_model.h"
#include "worker/text/tokenizer.h"
#include "worker/text/tokenizer_engine.h"
#include "worker/text/utf8.h"

namespace meshtrain::text {
namespace {

using Json = nlohmann::json;

// \s of ECMAScript (gpt-3-encoder) and of transformers' Rust tokenizers (Unicode's
// White_Space), for a character class.
constexpr const char* kEcmaSpace =
    "\\t\\n\\x0b\\f\\r \\x{a0}\\x{1680}\\x{2000}-\\x{200a}\\x{2028}\\x{2029}\\x{202f}\\x{205f}\\x{3000}\\x{feff}";
constexpr const char* kUnicodeSpace =
    "\\t\\n\\x0b\\f\\r \\x{85}\\x{a0}\\x{1680}\\x{2000}-\\x{200a}\\x{2028}\\x{2029}\\x{202f}\\x{205f}\\x{3000}";
constexpr const char* kGpt2Pattern = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";
constexpr const char* kMetaspace = "\xe2\x96\x81";  // U+2581
constexpr uint32_t kNoToken = std::numeric_limits<uint32_t>::max();
// Of a part's pre-token starts, those kept for joining it to the previous part.
constexpr size_t kRecordedStarts = 4096;

[[noreturn]] void Fail(const std::string& source, const std::string& path, const std::string& what) {
  throw TokenizerError(source + ": " + path + ": " + what);
}

// An Oniguruma pattern (tokenizers' regular expressions) as PCRE2 reads it the same way:
// \s and \S spelled out as `space`. Throws TokenizerError for \S inside a class.
std::string TranslatePattern(const std::string& pattern, const char* space, const std::string& source,
                             const std::string& path) {
  std::string out;
  bool in_class = false;
  for (size_t i = 0; i < pattern.size(); ++i) {
    const char c = pattern[i];
    if (c == '\\' && i + 1 < pattern.size()) {
      const char e = pattern[++i];
      if (e == 's') {
        out += in_class ? std::string(space) : "[" + std::string(space) + "]";
      } else if (e == 'S') {
        if (in_class) Fail(source, path, "\\S inside a character class is not implemented");
        out += "[^" + std::string(space) + "]";
      } else {
        out += c;
        out += e;
      }
      continue;
    }
    if (c == '[' && !in_class) {
      in_class = true;
      out += c;
      // A ']' first in the class (or after '^') is a literal.
      if (i + 1 < pattern.size() && pattern[i + 1] == '^') out += pattern[++i];
      if (i + 1 < pattern.size() && pattern[i + 1] == ']') out += pattern[++i];
      continue;
    }
    if (c == ']' && in_class) in_class = false;
    out += c;
  }
  return out;
}

struct Regex {
  pcre2_code* code = nullptr;
  std::string where;  // "FILE: JSON path", for a match that fails (past PCRE2's match limit)
  ~Regex() { pcre2_code_free(code); }
};

std::shared_ptr<const Regex> Compile(const std::string& pattern, bool literal, const std::string& source,
                                     const std::string& path) {
  auto regex = std::make_shared<Regex>();
  regex->where = source + ": " + path;
  int error = 0;
  PCRE2_SIZE offset = 0;
  regex->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                              PCRE2_UTF | (literal ? PCRE2_LITERAL : PCRE2_UCP), &error, &offset, nullptr);
  if (regex->code == nullptr) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(error, message, sizeof message);
    Fail(source, path, "pattern \"" + pattern + "\" does not compile at offset " + std::to_string(offset) + ": " +
                           reinterpret_cast<char*>(message));
  }
  // Without a JIT, matching interprets: slower, the same.
  pcre2_jit_compile(regex->code, PCRE2_JIT_COMPLETE | PCRE2_JIT_PARTIAL_HARD);
  return regex;
}

// Per-thread match data for each pattern.
class Matcher {
 public:
  explicit Matcher(const Regex& regex) : data_(pcre2_match_data_create_from_pattern(regex.code, nullptr)) {}
  Matcher(Matcher&& o) noexcept : data_(std::exchange(o.data_, nullptr)) {}
  ~Matcher() { pcre2_match_data_free(data_); }
  Matcher(const Matcher&) = delete;

  enum Result { kMatch, kPartial, kNone };
  // The first match in subject[at, length), or a partial one with `partial`.
  Result Find(const Regex& regex, std::string_view subject, size_t length, size_t at, bool partial, size_t* begin,
              size_t* end) {
    const int rc = pcre2_match(regex.code, reinterpret_cast<PCRE2_SPTR>(subject.data()), length, at,
                               PCRE2_NO_UTF_CHECK | PCRE2_NOTEMPTY | (partial ? PCRE2_PARTIAL_HARD : 0), data_, nullptr);
    if (rc == PCRE2_ERROR_NOMATCH) return kNone;
    const PCRE2_SIZE* range = pcre2_get_ovector_pointer(data_);
    if (rc == PCRE2_ERROR_PARTIAL) {
      *begin = range[0];
      *end = range[1];
      return kPartial;
    }
    if (rc < 0) {
      PCRE2_UCHAR message[256];
      pcre2_get_error_message(rc, message, sizeof message);
      throw TokenizerError(regex.where + ": pattern failed on the text: " + reinterpret_cast<char*>(message));
    }
    *begin = range[0];
    *end = range[1];
    return kMatch;
  }

 private:
  pcre2_match_data* data_;
};

enum class Behavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };
enum class Prepend { kAlways, kFirst, kNever };

struct NormalizerStep {
  enum Kind { kNfc, kNfkc, kNfd, kNfkd, kPrepend, kReplace } kind;
  std::string text;                     // Prepend's prefix; Replace's literal pattern
  std::string content;                  // Replace's replacement
  std::shared_ptr<const Regex> regex;   // Replace's regular expression
};

struct PreStep {
  enum Kind { kSplit, kByteLevel, kMetaspace } kind;
  std::shared_ptr<const Regex> regex;  // Split's; ByteLevel's with use_regex
  Behavior behavior = Behavior::kIsolated;
  bool invert = false;
  bool add_prefix_space = false;  // ByteLevel
  std::string replacement;        // Metaspace
  Prepend prepend = Prepend::kAlways;
  bool split = true;  // Metaspace
};

struct DecoderStep {
  enum Kind { kByteLevel, kReplace, kByteFallback, kFuse, kStrip, kMetaspace } kind;
  std::string pattern, content;
  size_t start = 0, stop = 0;
  bool strip_first = false;  // Metaspace: the first token's leading space goes
};

struct AddedToken {
  std::string content;
  uint32_t id = 0;
  bool special = false, single_word = false, lstrip = false, rstrip = false, normalized = false;
};

// Added tokens found leftmost-longest, as an Aho-Corasick automaton of that kind does.
class AddedMatcher {
 public:
  void Add(const AddedToken* token) {
    int node = 0;
    for (char c : token->content) {
      auto& children = nodes_[size_t(node)].children;
      const auto it = children.find(uint8_t(c));
      if (it != children.end()) {
        node = it->second;
      } else {
        nodes_.push_back({});
        const int next = int(nodes_.size()) - 1;
        nodes_[size_t(node)].children[uint8_t(c)] = next;
        node = next;
      }
    }
    nodes_[size_t(node)].token = token;
    first_[uint8_t(token->content[0])] = true;
    empty_ = false;
  }
  bool empty() const { return empty_; }

  // The longest token starting at `at`, or null.
  const AddedToken* LongestAt(std::string_view text, size_t at, size_t* end) const {
    if (!first_[uint8_t(text[at])]) return nullptr;
    const AddedToken* found = nullptr;
    int node = 0;
    for (size_t i = at; i < text.size(); ++i) {
      const auto& children = nodes_[size_t(node)].children;
      const auto it = children.find(uint8_t(text[i]));
      if (it == children.end()) break;
      node = it->second;
      if (nodes_[size_t(node)].token != nullptr) {
        found = nodes_[size_t(node)].token;
        *end = i + 1;
      }
    }
    return found;
  }

 private:
  struct Node {
    std::map<uint8_t, int> children;
    const AddedToken* token = nullptr;
  };
  std::vector<Node> nodes_ = {Node{}};
  bool first_[256] = {};
  bool empty_ = true;
};

bool IsWhiteSpace(uint32_t cp) {
  return (cp >= 9 && cp <= 13) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F ||
         cp == 0x3000;
}

bool IsWordCharacter(uint32_t cp) {
  if (cp == '_') return true;
  const utf8proc_category_t c = utf8proc_category(utf8proc_int32_t(cp));
  return (c >= UTF8PROC_CATEGORY_LU && c <= UTF8PROC_CATEGORY_LO) || (c >= UTF8PROC_CATEGORY_ND && c <= UTF8PROC_CATEGORY_NO);
}

uint32_t LastCodePoint(std::string_view text) {
  size_t start = text.size() - 1;
  while (start > 0 && (uint8_t(text[start]) & 0xC0) == 0x80) --start;
  return NextCodePoint(text, &start);
}

// A stretch of text between added tokens, as the first pre-tokenizer sees it, or an added
// token (subject empty).
struct Item {
  uint32_t token = kNoToken;
  std::string subject;
  bool at_origin = false;  // at offset 0 of the document (Metaspace's prepend_scheme first)
};

// One part of a stretch encoded by one thread.
struct Part {
  size_t item = 0, from = 0, to = 0;
  bool last = false;  // reaches the stretch's end
  std::vector<uint32_t> ids;
  std::vector<std::pair<size_t, size_t>> starts;  // (pre-token start, ids before it), the first few
  size_t complete_until = 0, complete_count = 0;  // the part is the true scan up to here
};

class HuggingFaceEngine;

class HfSession : public TokenizerEngine::Session {
 public:
  explicit HfSession(const HuggingFaceEngine& engine);
  void Encode(std::string_view text, std::vector<uint32_t>& ids) override;

  void Items(std::string_view text, std::vector<Item>& items);
  // Encodes item[from, to): the true scan when the part starts at a pre-token's start.
  void EncodePart(const Item& item, Part& part);
  // Appends the ids of the next pre-token from `at` of the whole stretch; returns its end.
  size_t EncodeNext(const Item& item, size_t at, std::vector<uint32_t>& ids);

 private:
  friend class HuggingFaceEngine;
  void Normalize(std::string& text);
  void Apply(size_t step, std::string_view piece, bool at_origin, std::vector<uint32_t>& ids);
  void Split(size_t step, std::string_view piece, bool at_origin, std::vector<uint32_t>& ids);
  void Model(std::string_view piece, bool whole, std::vector<uint32_t>& ids);
  std::string Transform(const PreStep& step, std::string_view piece, bool at_origin) const;
  void AddItems(std::string_view text, bool at_origin, const AddedMatcher& matcher, bool normalize,
                std::vector<Item>& items);
  Matcher& MatcherOf(const Regex& regex);
  // The first piece of step 0's Isolated scan from `at`: kMatch (a match or a gap), kPartial
  // (from there on the scan needs more text), kNone (at the end).
  Matcher::Result Piece(const Item& item, size_t length, size_t at, bool partial, size_t* end);

  const HuggingFaceEngine& engine_;
  BpeModel::Scratch scratch_;
  std::unordered_map<const Regex*, Matcher> matchers_;
};

class HuggingFaceEngine : public TokenizerEngine {
 public:
  enum class Chunking { kWhole, kExact, kScan };

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
    for (const AddedToken& t : added_) {
      if (t.content == content) return t.id;
    }
    return model_->IdOf(content);
  }
  Specials specials() const override { return specials_; }
  std::string kind() const override { return kind_; }

 private:
  friend class HfSession;
  void ParseNormalizer(const Json& j, const std::string& path);
  void ParsePreTokenizer(const Json& j, const std::string& path);
  void ParseDecoder(const Json& j, const std::string& path);
  void ParsePostProcessor(const Json& j, const std::string& path);
  void Finish();
  // The next place at or after `from` to cut a long stretch for another thread.
  size_t Cut(const Item& item, size_t from) const;

  std::string source_, kind_;
  std::vector<NormalizerStep> normalizers_;
  std::vector<PreStep> pre_;
  std::vector<DecoderStep> decoders_;
  std::string unsupported_decoder_;  // what Decode names when it cannot decode
  std::optional<BpeModel> model_;
  std::vector<AddedToken> added_;
  AddedMatcher raw_added_, normalized_added_;
  std::vector<std::string> spelled_;  // id -> token as the vocabulary spells it
  std::vector<bool> is_added_;
  Specials specials_;
  Chunking chunking_ = Chunking::kWhole;
};

// ---- Parsing ------------------------------------------------------------------------

std::string StringField(const Json& j, const char* key, const std::string& source, const std::string& path) {
  if (!j.contains(key) || !j[key].is_string()) Fail(source, path + "." + key, "expected a string");
  return j[key].get<std::string>();
}

// A count that defaults to 0 (Strip's start and stop).
size_t CountField(const Json& j, const char* key, const std::string& source, const std::string& path) {
  if (!j.contains(key) || j[key].is_null()) return 0;
  if (!j[key].is_number_unsigned()) Fail(source, path + "." + key, "expected a count, got " + j[key].dump());
  return j[key].get<size_t>();
}

bool BoolField(const Json& j, const char* key, bool fallback, const std::string& source, const std::string& path) {
  if (!j.contains(key) || j[key].is_null()) return fallback;
  if (!j[key].is_boolean()) Fail(source, path + "." + key, "expected true or false, got " + j[key].dump());
  return j[key].get<bool>();
}

std::string TypeOf(const Json& j, const std::string& source, const std::string& path) {
  if (!j.is_object()) Fail(source, path, "expected an object, got " + j.dump().substr(0, 80));
  return StringField(j, "type", source, path);
}

// A Split's or Replace's pattern: {"String": s} or {"Regex": r}.
std::shared_ptr<const Regex> PatternField(const Json& j, const std::string& source, const std::string& path,
                                          std::string* literal = nullptr) {
  const Json* p = j.contains("pattern") ? &j["pattern"] : nullptr;
  if (p != nullptr && p->is_object() && p->contains("String") && (*p)["String"].is_string()) {
    const std::string s = (*p)["String"].get<std::string>();
    if (s.empty()) Fail(source, path + ".pattern.String", "is empty");
    if (literal != nullptr) *literal = s;
    return Compile(s, true, source, path + ".pattern.String");
  }
  if (p != nullptr && p->is_object() && p->contains("Regex") && (*p)["Regex"].is_string()) {
    return Compile(TranslatePattern((*p)["Regex"].get<std::string>(), kUnicodeSpace, source, path + ".pattern.Regex"),
                   false, source, path + ".pattern.Regex");
  }
  Fail(source, path + ".pattern", "expected {\"String\": ...} or {\"Regex\": ...}");
}

void HuggingFaceEngine::ParseNormalizer(const Json& j, const std::string& path) {
  if (j.is_null()) return;
  const std::string type = TypeOf(j, source_, path);
  if (type == "Sequence") {
    const Json& list = j.value("normalizers", Json());
    if (!list.is_array()) Fail(source_, path + ".normalizers", "expected an array");
    for (size_t i = 0; i < list.size(); ++i) ParseNormalizer(list[i], path + ".normalizers[" + std::to_string(i) + "]");
  } else if (type == "NFC" || type == "NFKC" || type == "NFD" || type == "NFKD") {
    normalizers_.push_back({type == "NFC"    ? NormalizerStep::kNfc
                            : type == "NFKC" ? NormalizerStep::kNfkc
                            : type == "NFD"  ? NormalizerStep::kNfd
                                             : NormalizerStep::kNfkd,
                            "", "", nullptr});
  } else if (type == "Prepend") {
    normalizers_.push_back({NormalizerStep::kPrepend, StringField(j, "prepend", source_, path), "", nullptr});
  } else if (type == "Replace") {
    NormalizerStep step{NormalizerStep::kReplace, "", StringField(j, "content", source_, path), nullptr};
    std::string literal;
    step.regex = PatternField(j, source_, path, &literal);
    step.text = literal;
    normalizers_.push_back(std::move(step));
  } else {
    Fail(source_, path, "normalizer type \"" + type + "\" is not implemented");
  }
}

void HuggingFaceEngine::ParsePreTokenizer(const Json& j, const std::string& path) {
  if (j.is_null()) return;
  const std::string type = TypeOf(j, source_, path);
  if (!pre_.empty() && pre_.back().kind == PreStep::kByteLevel) {
    Fail(source_, path, "a pre-tokenizer after ByteLevel is not implemented");
  }
  PreStep step{};
  if (type == "Sequence") {
    const Json& list = j.value("pretokenizers", Json());
    if (!list.is_array()) Fail(source_, path + ".pretokenizers", "expected an array");
    for (size_t i = 0; i < list.size(); ++i) ParsePreTokenizer(list[i], path + ".pretokenizers[" + std::to_string(i) + "]");
    return;
  } else if (type == "Split") {
    step.kind = PreStep::kSplit;
    step.regex = PatternField(j, source_, path);
    static const std::map<std::string, Behavior> behaviors = {{"Removed", Behavior::kRemoved},
                                                              {"Isolated", Behavior::kIsolated},
                                                              {"MergedWithPrevious", Behavior::kMergedWithPrevious},
                                                              {"MergedWithNext", Behavior::kMergedWithNext},
                                                              {"Contiguous", Behavior::kContiguous}};
    const std::string behavior = StringField(j, "behavior", source_, path);
    const auto it = behaviors.find(behavior);
    if (it == behaviors.end()) Fail(source_, path + ".behavior", "\"" + behavior + "\" is not a split behavior");
    step.behavior = it->second;
    step.invert = BoolField(j, "invert", false, source_, path);
  } else if (type == "ByteLevel") {
    step.kind = PreStep::kByteLevel;
    step.add_prefix_space = BoolField(j, "add_prefix_space", true, source_, path);
    if (BoolField(j, "use_regex", true, source_, path)) {
      step.regex = Compile(TranslatePattern(kGpt2Pattern, kUnicodeSpace, source_, path), false, source_, path);
    }
  } else if (type == "Metaspace") {
    step.kind = PreStep::kMetaspace;
    step.replacement = j.contains("replacement") ? StringField(j, "replacement", source_, path) : kMetaspace;
    if (step.replacement.empty()) Fail(source_, path + ".replacement", "is empty");
    size_t end = 0;
    NextCodePoint(step.replacement, &end);
    if (end != step.replacement.size()) Fail(source_, path + ".replacement", "must be one character");
    if (j.contains("prepend_scheme") && !j["prepend_scheme"].is_null()) {
      const std::string scheme = StringField(j, "prepend_scheme", source_, path);
      if (scheme == "always") step.prepend = Prepend::kAlways;
      else if (scheme == "first") step.prepend = Prepend::kFirst;
      else if (scheme == "never") step.prepend = Prepend::kNever;
      else Fail(source_, path + ".prepend_scheme", "\"" + scheme + "\" is not always, first or never");
    } else {
      step.prepend = BoolField(j, "add_prefix_space", true, source_, path) ? Prepend::kAlways : Prepend::kNever;
    }
    step.split = BoolField(j, "split", true, source_, path);
  } else {
    Fail(source_, path, "pre-tokenizer type \"" + type + "\" is not implemented");
  }
  pre_.push_back(std::move(step));
}

void HuggingFaceEngine::ParseDecoder(const Json& j, const std::string& path) {
  if (j.is_null() || !unsupported_decoder_.empty()) return;
  const std::string type = TypeOf(j, source_, path);
  DecoderStep step{};
  if (type == "Sequence") {
    const Json& list = j.value("decoders", Json());
    if (!list.is_array()) Fail(source_, path + ".decoders", "expected an array");
    for (size_t i = 0; i < list.size(); ++i) ParseDecoder(list[i], path + ".decoders[" + std::to_string(i) + "]");
    return;
  } else if (type == "ByteLevel") {
    step.kind = DecoderStep::kByteLevel;
  } else if (type == "Replace") {
    step.kind = DecoderStep::kReplace;
    const Json& p = j.value("pattern", Json());
    if (!p.is_object() || !p.contains("String") || !p["String"].is_string()) {
      unsupported_decoder_ = path + ": a Replace decoder with a regular expression";
      return;
    }
    step.pattern = p["String"].get<std::string>();
    step.content = StringField(j, "content", source_, path);
  } else if (type == "ByteFallback") {
    step.kind = DecoderStep::kByteFallback;
  } else if (type == "Fuse") {
    step.kind = DecoderStep::kFuse;
  } else if (type == "Strip") {
    step.kind = DecoderStep::kStrip;
    step.content = StringField(j, "content", source_, path);
    step.start = CountField(j, "start", source_, path);
    step.stop = CountField(j, "stop", source_, path);
  } else if (type == "Metaspace") {
    step.kind = DecoderStep::kMetaspace;
    step.pattern = j.contains("replacement") ? StringField(j, "replacement", source_, path) : kMetaspace;
    const bool has_scheme = j.contains("prepend_scheme") && !j["prepend_scheme"].is_null();
    const std::string scheme = has_scheme ? StringField(j, "prepend_scheme", source_, path) : "";
    step.strip_first = scheme.empty() ? BoolField(j, "add_prefix_space", true, source_, path) : scheme != "never";
  } else {
    unsupported_decoder_ = path + ": decoder type \"" + type + "\"";
    return;
  }
  decoders_.push_back(std::move(step));
}

void HuggingFaceEngine::ParsePostProcessor(const Json& j, const std::string& path) {
  if (j.is_null()) return;
  const std::string type = TypeOf(j, source_, path);
  if (type == "Sequence") {
    const Json& list = j.value("processors", Json());
    if (!list.is_array()) Fail(source_, path + ".processors", "expected an array");
    for (size_t i = 0; i < list.size(); ++i) ParsePostProcessor(list[i], path + ".processors[" + std::to_string(i) + "]");
  } else if (type == "ByteLevel") {
    // Only offsets: no ids.
  } else if (type == "TemplateProcessing") {
    const Json& single = j.value("single", Json());
    const Json& specials = j.value("special_tokens", Json::object());
    if (!single.is_array()) Fail(source_, path + ".single", "expected an array");
    specials_.has_template = true;
    bool after = false;
    for (size_t i = 0; i < single.size(); ++i) {
      const std::string at = path + ".single[" + std::to_string(i) + "]";
      const Json& piece = single[i];
      if (piece.contains("Sequence")) {
        after = true;
      } else if (piece.contains("SpecialToken") && piece["SpecialToken"].contains("id")) {
        const std::string name = StringField(piece["SpecialToken"], "id", source_, at + ".SpecialToken");
        if (!specials.contains(name) || !specials[name].contains("ids") || !specials[name]["ids"].is_array()) {
          Fail(source_, at, "special token \"" + name + "\" is not in " + path + ".special_tokens");
        }
        for (const Json& id : specials[name]["ids"]) {
          if (!id.is_number_unsigned() || id.get<uint64_t>() > std::numeric_limits<uint32_t>::max()) {
            Fail(source_, path + ".special_tokens." + name + ".ids", "expected ids, got " + id.dump());
          }
          (after ? specials_.template_after : specials_.template_before).push_back(id.get<uint32_t>());
        }
      } else {
        Fail(source_, at, "expected {\"Sequence\": ...} or {\"SpecialToken\": ...}");
      }
    }
  } else {
    Fail(source_, path, "post-processor type \"" + type + "\" is not implemented");
  }
}

HuggingFaceEngine::HuggingFaceEngine(const Json& doc, const std::string& source) : source_(source) {
  kind_ = "tokenizer.json (BPE)";
  if (!doc.is_object()) Fail(source, "(top)", "expected a JSON object");
  const Json& model = doc.value("model", Json());
  const std::string type = model.is_object() && model.contains("type") && model["type"].is_string()
                               ? model["type"].get<std::string>()
                               : "";
  if (type != "BPE") {
    Fail(source, "model.type", "\"" + type + "\" is not implemented; only \"BPE\" (tokenizer.model for SentencePiece)");
  }
  if (model.contains("dropout") && !model["dropout"].is_null() &&
      !(model["dropout"].is_number() && model["dropout"].get<double>() == 0)) {
    Fail(source, "model.dropout", "BPE dropout (random merges) is not implemented; it must be null");
  }
  ParseNormalizer(doc.value("normalizer", Json()), "normalizer");
  ParsePreTokenizer(doc.value("pre_tokenizer", Json()), "pre_tokenizer");
  ParsePostProcessor(doc.value("post_processor", Json()), "post_processor");
  ParseDecoder(doc.value("decoder", Json()), "decoder");

  BpeModel::Options options;
  options.byte_level = !pre_.empty() && pre_.back().kind == PreStep::kByteLevel;
  options.byte_fallback = BoolField(model, "byte_fallback", false, source, "model");
  options.fuse_unk = BoolField(model, "fuse_unk", false, source, "model");
  options.ignore_merges = BoolField(model, "ignore_merges", false, source, "model");
  if (model.contains("unk_token") && !model["unk_token"].is_null()) options.unk_token = StringField(model, "unk_token", source, "model");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    if (model.contains(key) && !model[key].is_null()) {
      (key[0] == 'c' ? options.continuing_subword_prefix : options.end_of_word_suffix) = StringField(model, key, source, "model");
    }
  }
  const Json& vocab = model.value("vocab", Json());
  if (!vocab.is_object() || vocab.empty()) Fail(source, "model.vocab", "expected a non-empty object");
  std::vector<std::pair<std::string, uint32_t>> tokens;
  for (const auto& [token, id] : vocab.items()) {
    if (!id.is_number_unsigned() || id.get<uint64_t>() >= (uint64_t(1) << 31)) {
      Fail(source, "model.vocab", "token \"" + token + "\" has id " + id.dump() + ", not an id");
    }
    tokens.emplace_back(token, id.get<uint32_t>());
  }
  std::vector<std::pair<std::string, std::string>> merges;
  const Json& merge_list = model.value("merges", Json::array());
  if (!merge_list.is_array()) Fail(source, "model.merges", "expected an array");
  for (size_t i = 0; i < merge_list.size(); ++i) {
    const Json& m = merge_list[i];
    if (m.is_string()) {
      const std::string line = m.get<std::string>();
      const size_t space = line.find(' ', 1);
      if (space == std::string::npos || line.find(' ', space + 1) != std::string::npos) {
        Fail(source, "model.merges[" + std::to_string(i) + "]", "\"" + line + "\" is not a merge of two tokens");
      }
      merges.emplace_back(line.substr(0, space), line.substr(space + 1));
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      merges.emplace_back(m[0].get<std::string>(), m[1].get<std::string>());
    } else {
      Fail(source, "model.merges[" + std::to_string(i) + "]", m.dump().substr(0, 80) + " is not a merge");
    }
  }
  model_.emplace(BpeModel::Build(tokens, merges, options, source));
  const Json& added = doc.value("added_tokens", Json::array());
  if (!added.is_array()) Fail(source, "added_tokens", "expected an array");
  for (size_t i = 0; i < added.size(); ++i) {
    const std::string path = "added_tokens[" + std::to_string(i) + "]";
    const Json& a = added[i];
    if (!a.is_object() || !a.contains("id") || !a["id"].is_number_unsigned() || a["id"].get<uint64_t>() >= (uint64_t(1) << 31)) {
      Fail(source, path, "expected an object with an id");
    }
    AddedToken t;
    t.content = StringField(a, "content", source, path);
    if (t.content.empty()) Fail(source, path + ".content", "is empty");
    t.id = a["id"].get<uint32_t>();
    t.special = BoolField(a, "special", false, source, path);
    t.single_word = BoolField(a, "single_word", false, source, path);
    t.lstrip = BoolField(a, "lstrip", false, source, path);
    t.rstrip = BoolField(a, "rstrip", false, source, path);
    t.normalized = BoolField(a, "normalized", !t.special, source, path);
    added_.push_back(std::move(t));
  }
  // Ids are 0..n-1 without gaps (Finish), so none reaches the number of tokens given: an
  // id sizes the tables below, and is checked before it does.
  const size_t given = tokens.size() + added_.size();
  auto past = [&](uint32_t id) { return "has id " + std::to_string(id) + "; the " + std::to_string(given) +
                                        " tokens of model.vocab and added_tokens have ids 0.." +
                                        std::to_string(given - 1) + " without gaps"; };
  for (const auto& [token, id] : tokens) {
    if (id >= given) Fail(source, "model.vocab", "token \"" + token + "\" " + past(id));
  }
  for (size_t i = 0; i < added_.size(); ++i) {
    if (added_[i].id >= given) {
      Fail(source, "added_tokens[" + std::to_string(i) + "]", "\"" + added_[i].content + "\" " + past(added_[i].id));
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
  PreStep step{};
  step.kind = PreStep::kByteLevel;
  step.regex = Compile(TranslatePattern(kGpt2Pattern, kEcmaSpace, source, "GPT-2's pattern"), false, source, "pattern");
  pre_.push_back(std::move(step));
  decoders_.push_back({DecoderStep::kByteLevel, "", "", 0, 0, false});
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
  for (const AddedToken& t : added_) {
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
  for (const AddedToken& t : added_) (t.normalized ? normalized_added_ : raw_added_).Add(&t);
  for (const std::vector<uint32_t>* ids : {&specials_.template_before, &specials_.template_after}) {
    for (uint32_t id : *ids) {
      if (id >= spelled_.size()) {
        throw TokenizerError(source_ + ": post_processor: id " + std::to_string(id) + " is past the vocabulary");
      }
    }
  }
  // Where long stretches may be cut (see the file comment).
  if (pre_.empty() || (pre_.size() == 1 && pre_[0].kind != PreStep::kSplit && !pre_[0].regex)) {
    chunking_ = model_->cuttable() ? Chunking::kExact : Chunking::kWhole;
  } else if (pre_[0].regex && pre_[0].behavior == Behavior::kIsolated && !pre_[0].invert) {
    chunking_ = Chunking::kScan;
  }
}

// ---- Encoding ------------------------------------------------------------------------

HfSession::HfSession(const HuggingFaceEngine& engine) : engine_(engine) {}

Matcher& HfSession::MatcherOf(const Regex& regex) {
  auto it = matchers_.find(&regex);
  if (it == matchers_.end()) it = matchers_.emplace(&regex, Matcher(regex)).first;
  return it->second;
}

std::string UnicodeNormalize(std::string_view text, int options) {
  utf8proc_uint8_t* out = nullptr;
  const utf8proc_ssize_t n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(text.data()),
                                          utf8proc_ssize_t(text.size()), &out, utf8proc_option_t(options));
  if (n < 0) throw TokenizerError(std::string("Unicode normalization failed: ") + utf8proc_errmsg(n));
  std::string result(reinterpret_cast<char*>(out), size_t(n));
  std::free(out);
  return result;
}

void HfSession::Normalize(std::string& text) {
  for (const NormalizerStep& step : engine_.normalizers_) {
    switch (step.kind) {
      case NormalizerStep::kNfc:
      case NormalizerStep::kNfd:
      case NormalizerStep::kNfkc:
      case NormalizerStep::kNfkd: {
        // ASCII is the same in every form; below U+0300 nothing composes or reorders (NFC).
        const bool compat = step.kind == NormalizerStep::kNfkc || step.kind == NormalizerStep::kNfkd;
        const bool compose = step.kind == NormalizerStep::kNfc || step.kind == NormalizerStep::kNfkc;
        const uint8_t stable_below = step.kind == NormalizerStep::kNfc ? 0xCC : 0x80;
        if (std::all_of(text.begin(), text.end(), [&](char c) { return uint8_t(c) < stable_below; })) break;
        text = UnicodeNormalize(text, UTF8PROC_STABLE | (compose ? UTF8PROC_COMPOSE : UTF8PROC_DECOMPOSE) |
                                          (compat ? UTF8PROC_COMPAT : 0));
        break;
      }
      case NormalizerStep::kPrepend:
        if (!text.empty()) text.insert(0, step.text);
        break;
      case NormalizerStep::kReplace: {
        std::string out;
        size_t at = 0, begin = 0, end = 0;
        Matcher& m = MatcherOf(*step.regex);
        while (at < text.size() && m.Find(*step.regex, text, text.size(), at, false, &begin, &end) == Matcher::kMatch) {
          out.append(text, at, begin - at);
          out += step.content;
          at = end;
        }
        if (at == 0) break;
        out.append(text, at, std::string::npos);
        text = std::move(out);
        break;
      }
    }
  }
}

// Adds the stretches of `text` between the tokens `matcher` finds, as tokenizers' AddedVocabulary
// splits them (single_word, lstrip, rstrip); each stretch normalized first when `normalize`.
void HfSession::AddItems(std::string_view text, bool at_origin, const AddedMatcher& matcher, bool normalize,
                         std::vector<Item>& items) {
  auto stretch = [&](std::string_view s, bool origin) {
    if (s.empty()) return;
    if (normalize) {
      std::string n(s);
      Normalize(n);
      AddItems(n, origin, engine_.normalized_added_, false, items);
      return;
    }
    Item item;
    item.subject = engine_.pre_.empty() ? std::string(s) : Transform(engine_.pre_[0], s, origin);
    item.at_origin = origin;
    items.push_back(std::move(item));
  };
  size_t done = 0;  // start of the stretch not yet added
  if (!matcher.empty()) {
    for (size_t at = 0; at < text.size();) {
      size_t end = 0;
      const AddedToken* t = matcher.LongestAt(text, at, &end);
      if (t == nullptr) {
        ++at;
        continue;
      }
      size_t start = at;
      at = end;
      if (t->single_word) {
        const bool before = start == 0 || !IsWordCharacter(LastCodePoint(text.substr(0, start)));
        size_t next = end;
        const bool after = end == text.size() || !IsWordCharacter(NextCodePoint(text, &next));
        if (!before || !after) continue;
      }
      if (t->lstrip) {
        size_t s = start;
        while (s > done && IsWhiteSpace(LastCodePoint(text.substr(0, s)))) {
          --s;
          while (s > 0 && (uint8_t(text[s]) & 0xC0) == 0x80) --s;
        }
        start = s;
      }
      if (t->rstrip) {
        size_t e = end;
        while (e < text.size()) {
          size_t next = e;
          if (!IsWhiteSpace(NextCodePoint(text, &next))) break;
          e = next;
        }
        end = e;
      }
      stretch(text.substr(done, start - done), at_origin && done == 0);
      Item token;
      token.token = t->id;
      items.push_back(std::move(token));
      done = end;
      at = std::max(at, end);
    }
  }
  stretch(text.substr(done), at_origin && done == 0);
}

void HfSession::Items(std::string_view text, std::vector<Item>& items) {
  items.clear();
  AddItems(text, true, engine_.raw_added_, true, items);
}

// What a pre-tokenizer does to one piece before it splits it.
std::string HfSession::Transform(const PreStep& step, std::string_view piece, bool at_origin) const {
  if (step.kind == PreStep::kByteLevel) {
    if (step.add_prefix_space && (piece.empty() || piece[0] != ' ')) return " " + std::string(piece);
    return std::string(piece);
  }
  if (step.kind != PreStep::kMetaspace) return std::string(piece);
  std::string out;
  const bool prepend = step.prepend == Prepend::kAlways || (step.prepend == Prepend::kFirst && at_origin);
  if (prepend && piece.substr(0, step.replacement.size()) != step.replacement) {
    // Hugging Face checks the piece after replacing spaces: a leading space becomes it.
    if (piece.empty() || piece[0] != ' ') out = step.replacement;
  }
  for (char c : piece) {
    if (c == ' ') out += step.replacement;
    else out += c;
  }
  return out;
}

void HfSession::Model(std::string_view piece, bool whole, std::vector<uint32_t>& ids) {
  engine_.model_->Tokenize(piece, whole, scratch_, ids);
}

// Pre-tokenizer `step` and those after it, on one piece of the previous one.
void HfSession::Apply(size_t step, std::string_view piece, bool at_origin, std::vector<uint32_t>& ids) {
  if (step == engine_.pre_.size()) return Model(piece, true, ids);
  const std::string transformed = Transform(engine_.pre_[step], piece, at_origin);
  Split(step, transformed, at_origin, ids);
}

// The splitting half of pre-tokenizer `step` on an already transformed piece.
void HfSession::Split(size_t step, std::string_view piece, bool at_origin, std::vector<uint32_t>& ids) {
  const PreStep& s = engine_.pre_[step];
  if (s.kind == PreStep::kMetaspace) {
    if (!s.split) return Apply(step + 1, piece, at_origin, ids);
    size_t start = 0;
    for (size_t at = s.replacement.size(); at <= piece.size(); ++at) {
      if (at == piece.size() || piece.compare(at, s.replacement.size(), s.replacement) == 0) {
        Apply(step + 1, piece.substr(start, at - start), at_origin && start == 0, ids);
        start = at;
        if (at != piece.size()) at += s.replacement.size() - 1;
      }
    }
    return;
  }
  if (!s.regex) return Apply(step + 1, piece, at_origin, ids);
  // Matches and the gaps between them, then the behavior.
  struct Span {
    size_t begin, end;
    bool match;
  };
  std::vector<Span> spans;
  Matcher& m = MatcherOf(*s.regex);
  for (size_t at = 0; at < piece.size();) {
    size_t begin = 0, end = 0;
    if (m.Find(*s.regex, piece, piece.size(), at, false, &begin, &end) != Matcher::kMatch) {
      spans.push_back({at, piece.size(), false});
      break;
    }
    if (begin > at) spans.push_back({at, begin, false});
    spans.push_back({begin, end, true});
    at = end;
  }
  if (s.invert) {
    for (Span& span : spans) span.match = !span.match;
  }
  std::vector<std::pair<size_t, size_t>> out;
  for (size_t i = 0; i < spans.size(); ++i) {
    const Span& span = spans[i];
    switch (s.behavior) {
      case Behavior::kRemoved:
        if (!span.match) out.emplace_back(span.begin, span.end);
        break;
      case Behavior::kIsolated:
        out.emplace_back(span.begin, span.end);
        break;
      case Behavior::kMergedWithPrevious:
        if (span.match && !out.empty() && i > 0 && !spans[i - 1].match) out.back().second = span.end;
        else out.emplace_back(span.begin, span.end);
        break;
      case Behavior::kMergedWithNext:
        if (!span.match && i > 0 && spans[i - 1].match) out.back().second = span.end;
        else out.emplace_back(span.begin, span.end);
        break;
      case Behavior::kContiguous:
        if (span.match && i > 0 && spans[i - 1].match) out.back().second = span.end;
        else out.emplace_back(span.begin, span.end);
        break;
    }
  }
  for (const auto& [begin, end] : out) Apply(step + 1, piece.substr(begin, end - begin), at_origin && begin == 0, ids);
}

Matcher::Result HfSession::Piece(const Item& item, size_t length, size_t at, bool partial, size_t* end) {
  const Regex& regex = *engine_.pre_[0].regex;
  size_t begin = 0;
  const Matcher::Result r = MatcherOf(regex).Find(regex, item.subject, length, at, partial, &begin, end);
  if (r == Matcher::kNone) {  // the rest is a gap, which more text may lengthen
    *end = length;
    return at == length ? Matcher::kNone : partial ? Matcher::kPartial : Matcher::kMatch;
  }
  if (begin > at) {  // a gap: final, since no match (even a partial one) starts inside it
    *end = begin;
    return Matcher::kMatch;
  }
  return r;
}

size_t HfSession::EncodeNext(const Item& item, size_t at, std::vector<uint32_t>& ids) {
  size_t end = 0;
  Piece(item, item.subject.size(), at, false, &end);
  Apply(1, std::string_view(item.subject).substr(at, end - at), item.at_origin && at == 0, ids);
  return end;
}

void HfSession::EncodePart(const Item& item, Part& part) {
  part.ids.clear();
  part.starts.clear();
  const std::string_view subject = item.subject;
  switch (engine_.chunking_) {
    case HuggingFaceEngine::Chunking::kWhole:
    case HuggingFaceEngine::Chunking::kExact:
      if (engine_.pre_.empty()) {
        Model(subject.substr(part.from, part.to - part.from), part.from == 0 && part.to == subject.size(), part.ids);
      } else {
        Split(0, subject.substr(part.from, part.to - part.from), item.at_origin && part.from == 0, part.ids);
      }
      part.starts = {{part.from, 0}};
      part.complete_until = part.to;
      break;
    case HuggingFaceEngine::Chunking::kScan: {
      size_t at = part.from;
      while (at < part.to) {
        size_t end = 0;
        const Matcher::Result r = Piece(item, part.to, at, !part.last, &end);
        if (r != Matcher::kMatch) break;
        if (part.starts.size() < kRecordedStarts) part.starts.emplace_back(at, part.ids.size());
        Apply(1, subject.substr(at, end - at), item.at_origin && at == 0, part.ids);
        at = end;
      }
      part.complete_until = at;
      break;
    }
  }
  part.complete_count = part.ids.size();
}

void HfSession::Encode(std::string_view text, std::vector<uint32_t>& ids) {
  std::vector<Item> items;
  Items(text, items);
  for (const Item& item : items) {
    if (item.token != kNoToken) {
      ids.push_back(item.token);
      continue;
    }
    Part part;
    part.to = item.subject.size();
    part.last = true;
    EncodePart(item, part);
    ids.insert(ids.end(), part.ids.begin(), part.ids.end());
  }
}

size_t HuggingFaceEngine::Cut(const Item& item, size_t from) const {
  const std::string_view s = item.subject;
  if (chunking_ == Chunking::kExact) {
    for (size_t p = std::max<size_t>(from, 1); p < s.size(); ++p) {
      if (model_->CanCut(s, p)) return p;
    }
    return s.size();
  }
  // A guess, checked when the parts are joined: after a line break, before a letter.
  const size_t limit = std::min(s.size(), from + 4096);
  for (size_t p = std::max<size_t>(from, 1); p < limit; ++p) {
    if (s[p - 1] == '\n' && ((s[p] >= 'a' && s[p] <= 'z') || (s[p] >= 'A' && s[p] <= 'Z'))) return p;
  }
  size_t p = std::min(from, s.size());
  while (p < s.size() && (uint8_t(s[p]) & 0xC0) == 0x80) ++p;
  return p;
}

void HuggingFaceEngine::EncodeParallel(std::string_view text, int threads, std::vector<uint32_t>& ids,
                                       const ProgressFn& progress) const {
  threads = std::max(1, threads);
  std::vector<HfSession> sessions;
  for (int t = 0; t < threads; ++t) sessions.emplace_back(*this);
  std::vector<Item> items;
  sessions[0].Items(text, items);
  // Parts of about a quarter of a thread's share, from 64 KiB to 4 MiB.
  const size_t part_bytes = std::clamp<size_t>(text.size() / size_t(threads * 4), size_t(1) << 16, size_t(1) << 22);
  std::vector<Part> parts;
  for (size_t i = 0; i < items.size(); ++i) {
    if (items[i].token != kNoToken) continue;
    const size_t size = items[i].subject.size();
    size_t from = 0;
    while (true) {
      Part part;
      part.item = i;
      part.from = from;
      part.to = chunking_ == Chunking::kWhole || size - from <= part_bytes ? size : Cut(items[i], from + part_bytes);
      part.last = part.to == size;
      parts.push_back(std::move(part));
      if (parts.back().last) break;
      from = parts.back().to;
    }
  }
  RunTasks(
      parts.size(), threads, [&](size_t p, int worker) { sessions[size_t(worker)].EncodePart(items[parts[p].item], parts[p]); },
      [&](size_t p) { return parts[p].to - parts[p].from; }, progress);
  // Join in order. A part's ids are the true ones from the first of its pre-token starts
  // that the true scan reaches.
  HfSession& joiner = sessions[0];
  size_t next = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    const Item& item = items[i];
    if (item.token != kNoToken) {
      ids.push_back(item.token);
      continue;
    }
    size_t pos = 0;  // the ids are final up to here
    for (; next < parts.size() && parts[next].item == i; ++next) {
      Part& part = parts[next];
      while (pos < part.complete_until) {
        if (pos >= part.from) {
          const auto it = std::lower_bound(part.starts.begin(), part.starts.end(), std::make_pair(pos, size_t(0)));
          if (it != part.starts.end() && it->first == pos) {
            ids.insert(ids.end(), part.ids.begin() + long(it->second), part.ids.begin() + long(part.complete_count));
            pos = part.complete_until;
            break;
          }
        }
        pos = joiner.EncodeNext(item, pos, ids);
      }
      part.ids = {};
    }
    while (pos < item.subject.size()) pos = joiner.EncodeNext(item, pos, ids);
  }
}

// ---- Decoding ------------------------------------------------------------------------

std::string ReplaceAll(std::string s, const std::string& from, const std::string& to) {
  if (from.empty()) return s;
  std::string out;
  size_t at = 0;
  for (size_t hit; (hit = s.find(from, at)) != std::string::npos; at = hit + from.size()) {
    out.append(s, at, hit - at);
    out += to;
  }
  out.append(s, at, std::string::npos);
  return out;
}

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
  if (!unsupported_decoder_.empty()) {
    throw TokenizerError(source_ + ": " + unsupported_decoder_ + " is not implemented; cannot decode");
  }
  static const std::unordered_map<uint32_t, uint8_t> byte_of = [] {
    std::unordered_map<uint32_t, uint8_t> map;
    for (int b = 0; b < 256; ++b) map[Gpt2ByteCodePoint(uint8_t(b))] = uint8_t(b);
    return map;
  }();
  for (const DecoderStep& step : decoders_) {
    switch (step.kind) {
      case DecoderStep::kByteLevel: {
        std::string bytes;
        for (const std::string& t : tokens) {
          std::string mapped;
          bool all = true;
          for (size_t pos = 0; pos < t.size() && all;) {
            const auto it = byte_of.find(NextCodePoint(t, &pos));
            if (it == byte_of.end()) all = false;
            else mapped += char(it->second);
          }
          bytes += all ? mapped : t;
        }
        size_t replaced = 0;
        tokens = {ScrubUtf8(bytes, &replaced)};
        break;
      }
      case DecoderStep::kReplace:
        for (std::string& t : tokens) t = ReplaceAll(t, step.pattern, step.content);
        break;
      case DecoderStep::kByteFallback: {
        std::vector<std::string> out;
        std::string pending;
        size_t pending_count = 0;
        auto flush = [&] {
          if (pending_count == 0) return;
          size_t replaced = 0;
          const std::string valid = ScrubUtf8(pending, &replaced);
          if (replaced == 0) {
            out.push_back(pending);
          } else {
            for (size_t k = 0; k < pending_count; ++k) out.push_back("\xef\xbf\xbd");
          }
          pending.clear();
          pending_count = 0;
        };
        for (const std::string& t : tokens) {
          auto hex = [](char c) { return (c >= '0' && c <= '9') || (c >= 'A' && c <= 'F') || (c >= 'a' && c <= 'f'); };
          if (t.size() == 6 && t.compare(0, 3, "<0x") == 0 && t[5] == '>' && hex(t[3]) && hex(t[4])) {
            pending += char(std::stoi(t.substr(3, 2), nullptr, 16));
            ++pending_count;
          } else {
            flush();
            out.push_back(t);
          }
        }
        flush();
        tokens = std::move(out);
        break;
      }
      case DecoderStep::kFuse: {
        std::string all;
        for (const std::string& t : tokens) all += t;
        tokens = {all};
        break;
      }
      case DecoderStep::kStrip:
        for (std::string& t : tokens) {
          size_t start = 0, stop = t.size();
          for (size_t k = 0; k < step.start && t.compare(start, step.content.size(), step.content) == 0 && !step.content.empty(); ++k) {
            start += step.content.size();
          }
          for (size_t k = 0; k < step.stop && stop >= start + step.content.size() && !step.content.empty() &&
                             t.compare(stop - step.content.size(), step.content.size(), step.content) == 0;
               ++k) {
            stop -= step.content.size();
          }
          t = t.substr(start, stop - start);
        }
        break;
      case DecoderStep::kMetaspace:
        for (size_t k = 0; k < tokens.size(); ++k) {
          tokens[k] = ReplaceAll(tokens[k], step.pattern, " ");
          if (k == 0 && step.strip_first && !tokens[k].empty() && tokens[k][0] == ' ') tokens[k].erase(0, 1);
        }
        break;
    }
  }
  std::string text;
  for (const std::string& t : tokens) text += t;
  return text;
}

// GPT-2's vocab.bpe lines as merges.
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
  return std::make_shared<HuggingFaceEngine>(std::move(vocab), ParseMergeLines(vocab_bpe, source + " (vocab.bpe)"), source);
}

}  // namespace meshtrain::text
