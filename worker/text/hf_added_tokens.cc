#include "worker/text/hf_added_tokens.h"

#include <utf8proc.h>

#include <algorithm>

#include "worker/text/utf8.h"

namespace meshtrain::text::hf {
namespace {

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

}  // namespace

void AddedTokens::AddedMatcher::Add(const AddedToken* token) {
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

const AddedToken* AddedTokens::AddedMatcher::LongestAt(std::string_view text, size_t at, size_t* end) const {
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

void AddedTokens::Parse(const Json& added, const std::string& source) {
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
    tokens_.push_back(std::move(t));
  }
  for (const AddedToken& t : tokens_) (t.normalized ? normalized_ : raw_).Add(&t);
}

void AddedTokens::Split(std::string_view text, bool at_origin, bool normalized,
                        const std::function<void(std::string_view stretch, bool at_origin)>& stretch,
                        const std::function<void(uint32_t id)>& token) const {
  const AddedMatcher& matcher = normalized ? normalized_ : raw_;
  auto add = [&](std::string_view s, bool origin) {
    if (!s.empty()) stretch(s, origin);
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
      add(text.substr(done, start - done), at_origin && done == 0);
      token(t->id);
      done = end;
      at = std::max(at, end);
    }
  }
  add(text.substr(done), at_origin && done == 0);
}

}  // namespace meshtrain::text::hf
