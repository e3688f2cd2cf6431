#include "worker/text/hf_normalizers.h"

#include <utf8proc.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "worker/text/tokenizer.h"

namespace meshtrain::text::hf {
namespace {

std::string UnicodeNormalize(std::string_view text, int options) {
  utf8proc_uint8_t* out = nullptr;
  const utf8proc_ssize_t n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(text.data()),
                                          utf8proc_ssize_t(text.size()), &out, utf8proc_option_t(options));
  if (n < 0) throw TokenizerError(std::string("Unicode normalization failed: ") + utf8proc_errmsg(n));
  std::string result(reinterpret_cast<char*>(out), size_t(n));
  std::free(out);
  return result;
}

}  // namespace

void Normalizers::Parse(const Json& j, const std::string& source, const std::string& path) {
  if (j.is_null()) return;
  const std::string type = TypeOf(j, source, path);
  if (type == "Sequence") {
    const Json& list = j.value("normalizers", Json());
    if (!list.is_array()) Fail(source, path + ".normalizers", "expected an array");
    for (size_t i = 0; i < list.size(); ++i) Parse(list[i], source, path + ".normalizers[" + std::to_string(i) + "]");
  } else if (type == "NFC" || type == "NFKC" || type == "NFD" || type == "NFKD") {
    steps_.push_back({type == "NFC"    ? Step::kNfc
                      : type == "NFKC" ? Step::kNfkc
                      : type == "NFD"  ? Step::kNfd
                                       : Step::kNfkd,
                      "", "", nullptr});
  } else if (type == "Prepend") {
    steps_.push_back({Step::kPrepend, StringField(j, "prepend", source, path), "", nullptr});
  } else if (type == "Replace") {
    Step step{Step::kReplace, "", StringField(j, "content", source, path), nullptr};
    std::string literal;
    step.regex = PatternField(j, source, path, &literal);
    step.text = literal;
    steps_.push_back(std::move(step));
  } else {
    Fail(source, path, "normalizer type \"" + type + "\" is not implemented");
  }
}

void Normalizers::Normalize(std::string& text, Matchers& matchers) const {
  for (const Step& step : steps_) {
    switch (step.kind) {
      case Step::kNfc:
      case Step::kNfd:
      case Step::kNfkc:
      case Step::kNfkd: {
        // ASCII is the same in every form; below U+0300 nothing composes or reorders (NFC).
        const bool compat = step.kind == Step::kNfkc || step.kind == Step::kNfkd;
        const bool compose = step.kind == Step::kNfc || step.kind == Step::kNfkc;
        const uint8_t stable_below = step.kind == Step::kNfc ? 0xCC : 0x80;
        if (std::all_of(text.begin(), text.end(), [&](char c) { return uint8_t(c) < stable_below; })) break;
        text = UnicodeNormalize(text, UTF8PROC_STABLE | (compose ? UTF8PROC_COMPOSE : UTF8PROC_DECOMPOSE) |
                                          (compat ? UTF8PROC_COMPAT : 0));
        break;
      }
      case Step::kPrepend:
        if (!text.empty()) text.insert(0, step.text);
        break;
      case Step::kReplace: {
        std::string out;
        size_t at = 0, begin = 0, end = 0;
        Matcher& m = matchers.Of(*step.regex);
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

}  // namespace meshtrain::text::hf
