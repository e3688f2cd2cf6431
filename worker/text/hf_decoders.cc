#include "worker/text/hf_decoders.h"

#include <cstdint>
#include <unordered_map>
#include <utility>

#include "worker/text/tokenizer.h"
#include "worker/text/utf8.h"

namespace meshtrain::text::hf {
namespace {

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

}  // namespace

void Decoders::Parse(const Json& j, const std::string& source, const std::string& path) {
  if (j.is_null() || !unsupported_.empty()) return;
  const std::string type = TypeOf(j, source, path);
  Step step{};
  if (type == "Sequence") {
    const Json& list = j.value("decoders", Json());
    if (!list.is_array()) Fail(source, path + ".decoders", "expected an array");
    for (size_t i = 0; i < list.size(); ++i) Parse(list[i], source, path + ".decoders[" + std::to_string(i) + "]");
    return;
  } else if (type == "ByteLevel") {
    step.kind = Step::kByteLevel;
  } else if (type == "Replace") {
    step.kind = Step::kReplace;
    const Json& p = j.value("pattern", Json());
    if (!p.is_object() || !p.contains("String") || !p["String"].is_string()) {
      unsupported_ = path + ": a Replace decoder with a regular expression";
      return;
    }
    step.pattern = p["String"].get<std::string>();
    step.content = StringField(j, "content", source, path);
  } else if (type == "ByteFallback") {
    step.kind = Step::kByteFallback;
  } else if (type == "Fuse") {
    step.kind = Step::kFuse;
  } else if (type == "Strip") {
    step.kind = Step::kStrip;
    step.content = StringField(j, "content", source, path);
    step.start = CountField(j, "start", source, path);
    step.stop = CountField(j, "stop", source, path);
  } else if (type == "Metaspace") {
    step.kind = Step::kMetaspace;
    step.pattern = j.contains("replacement") ? StringField(j, "replacement", source, path) : kMetaspace;
    const bool has_scheme = j.contains("prepend_scheme") && !j["prepend_scheme"].is_null();
    const std::string scheme = has_scheme ? StringField(j, "prepend_scheme", source, path) : "";
    step.strip_first = scheme.empty() ? BoolField(j, "add_prefix_space", true, source, path) : scheme != "never";
  } else {
    unsupported_ = path + ": decoder type \"" + type + "\"";
    return;
  }
  steps_.push_back(std::move(step));
}

void Decoders::UseByteLevel() { steps_.push_back({Step::kByteLevel, "", "", 0, 0, false}); }

std::string Decoders::Decode(std::vector<std::string> tokens, const std::string& source) const {
  if (!unsupported_.empty()) {
    throw TokenizerError(source + ": " + unsupported_ + " is not implemented; cannot decode");
  }
  static const std::unordered_map<uint32_t, uint8_t> byte_of = [] {
    std::unordered_map<uint32_t, uint8_t> map;
    for (int b = 0; b < 256; ++b) map[Gpt2ByteCodePoint(uint8_t(b))] = uint8_t(b);
    return map;
  }();
  for (const Step& step : steps_) {
    switch (step.kind) {
      case Step::kByteLevel: {
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
      case Step::kReplace:
        for (std::string& t : tokens) t = ReplaceAll(t, step.pattern, step.content);
        break;
      case Step::kByteFallback: {
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
      case Step::kFuse: {
        std::string all;
        for (const std::string& t : tokens) all += t;
        tokens = {all};
        break;
      }
      case Step::kStrip:
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
      case Step::kMetaspace:
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

}  // namespace meshtrain::text::hf
