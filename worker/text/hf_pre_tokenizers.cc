#include "worker/text/hf_pre_tokenizers.h"

#include <map>
#include <utility>

#include "worker/text/utf8.h"

namespace meshtrain::text::hf {
namespace {

// \s of ECMAScript (gpt-3-encoder), for a character class.
constexpr const char* kEcmaSpace =
    "\\t\\n\\x0b\\f\\r \\x{a0}\\x{1680}\\x{2000}-\\x{200a}\\x{2028}\\x{2029}\\x{202f}\\x{205f}\\x{3000}\\x{feff}";
constexpr const char* kGpt2Pattern = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

}  // namespace

void PreTokenizers::Parse(const Json& j, const std::string& source, const std::string& path) {
  if (j.is_null()) return;
  const std::string type = TypeOf(j, source, path);
  if (!steps_.empty() && steps_.back().kind == PreStep::kByteLevel) {
    Fail(source, path, "a pre-tokenizer after ByteLevel is not implemented");
  }
  PreStep step{};
  if (type == "Sequence") {
    const Json& list = j.value("pretokenizers", Json());
    if (!list.is_array()) Fail(source, path + ".pretokenizers", "expected an array");
    for (size_t i = 0; i < list.size(); ++i) Parse(list[i], source, path + ".pretokenizers[" + std::to_string(i) + "]");
    return;
  } else if (type == "Split") {
    step.kind = PreStep::kSplit;
    step.regex = PatternField(j, source, path);
    static const std::map<std::string, Behavior> behaviors = {{"Removed", Behavior::kRemoved},
                                                              {"Isolated", Behavior::kIsolated},
                                                              {"MergedWithPrevious", Behavior::kMergedWithPrevious},
                                                              {"MergedWithNext", Behavior::kMergedWithNext},
                                                              {"Contiguous", Behavior::kContiguous}};
    const std::string behavior = StringField(j, "behavior", source, path);
    const auto it = behaviors.find(behavior);
    if (it == behaviors.end()) Fail(source, path + ".behavior", "\"" + behavior + "\" is not a split behavior");
    step.behavior = it->second;
    step.invert = BoolField(j, "invert", false, source, path);
  } else if (type == "ByteLevel") {
    step.kind = PreStep::kByteLevel;
    step.add_prefix_space = BoolField(j, "add_prefix_space", true, source, path);
    if (BoolField(j, "use_regex", true, source, path)) {
      step.regex = Compile(TranslatePattern(kGpt2Pattern, kUnicodeSpace, source, path), false, source, path);
    }
  } else if (type == "Metaspace") {
    step.kind = PreStep::kMetaspace;
    step.replacement = j.contains("replacement") ? StringField(j, "replacement", source, path) : kMetaspace;
    if (step.replacement.empty()) Fail(source, path + ".replacement", "is empty");
    size_t end = 0;
    NextCodePoint(step.replacement, &end);
    if (end != step.replacement.size()) Fail(source, path + ".replacement", "must be one character");
    if (j.contains("prepend_scheme") && !j["prepend_scheme"].is_null()) {
      const std::string scheme = StringField(j, "prepend_scheme", source, path);
      if (scheme == "always") step.prepend = Prepend::kAlways;
      else if (scheme == "first") step.prepend = Prepend::kFirst;
      else if (scheme == "never") step.prepend = Prepend::kNever;
      else Fail(source, path + ".prepend_scheme", "\"" + scheme + "\" is not always, first or never");
    } else {
      step.prepend = BoolField(j, "add_prefix_space", true, source, path) ? Prepend::kAlways : Prepend::kNever;
    }
    step.split = BoolField(j, "split", true, source, path);
  } else {
    Fail(source, path, "pre-tokenizer type \"" + type + "\" is not implemented");
  }
  steps_.push_back(std::move(step));
}

void PreTokenizers::UseGpt2(const std::string& source) {
  PreStep step{};
  step.kind = PreStep::kByteLevel;
  step.regex = Compile(TranslatePattern(kGpt2Pattern, kEcmaSpace, source, "GPT-2's pattern"), false, source, "pattern");
  steps_.push_back(std::move(step));
}

std::string PreTokenizers::Transform(size_t step, std::string_view piece, bool at_origin) const {
  const PreStep& s = steps_[step];
  if (s.kind == PreStep::kByteLevel) {
    if (s.add_prefix_space && (piece.empty() || piece[0] != ' ')) return " " + std::string(piece);
    return std::string(piece);
  }
  if (s.kind != PreStep::kMetaspace) return std::string(piece);
  std::string out;
  const bool prepend = s.prepend == Prepend::kAlways || (s.prepend == Prepend::kFirst && at_origin);
  if (prepend && piece.substr(0, s.replacement.size()) != s.replacement) {
    // Hugging Face checks the piece after replacing spaces: a leading space becomes it.
    if (piece.empty() || piece[0] != ' ') out = s.replacement;
  }
  for (char c : piece) {
    if (c == ' ') out += s.replacement;
    else out += c;
  }
  return out;
}

void PreTokenizers::Apply(size_t step, std::string_view piece, bool at_origin, Matchers& matchers,
                          PreTokenSink& sink) const {
  if (step == steps_.size()) return sink.Add(piece);
  const std::string transformed = Transform(step, piece, at_origin);
  Split(step, transformed, at_origin, matchers, sink);
}

void PreTokenizers::Split(size_t step, std::string_view piece, bool at_origin, Matchers& matchers,
                          PreTokenSink& sink) const {
  const PreStep& s = steps_[step];
  if (s.kind == PreStep::kMetaspace) {
    if (!s.split) return Apply(step + 1, piece, at_origin, matchers, sink);
    size_t start = 0;
    for (size_t at = s.replacement.size(); at <= piece.size(); ++at) {
      if (at == piece.size() || piece.compare(at, s.replacement.size(), s.replacement) == 0) {
        Apply(step + 1, piece.substr(start, at - start), at_origin && start == 0, matchers, sink);
        start = at;
        if (at != piece.size()) at += s.replacement.size() - 1;
      }
    }
    return;
  }
  if (!s.regex) return Apply(step + 1, piece, at_origin, matchers, sink);
  // Matches and the gaps between them, then the behavior.
  struct Span {
    size_t begin, end;
    bool match;
  };
  std::vector<Span> spans;
  Matcher& m = matchers.Of(*s.regex);
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
  for (const auto& [begin, end] : out) {
    Apply(step + 1, piece.substr(begin, end - begin), at_origin && begin == 0, matchers, sink);
  }
}

}  // namespace meshtrain::text::hf
