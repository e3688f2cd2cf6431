// How deep JSON text nests, before nlohmann's parser builds anything from it: the manifest
// reader and the model-directory reader refuse text past their limits this way, since
// copying or printing a deeply nested document recurses past the stack.
// Thread-safety: a pure function.

#pragma once

#include <cstddef>
#include <string_view>

namespace meshtrain::api {

// The offset of the first '[' or '{' in `text` that opens a level deeper than `max_depth`,
// or npos. Strings are skipped as nlohmann's parser reads them (from a '"' outside one to
// the next '"' not escaped by a backslash), so the two agree on the depth of every byte up
// to where the parser would stop: text that passes here nests no deeper in the parser.
inline size_t FirstJsonLevelDeeperThan(std::string_view text, int max_depth) {
  int depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') ++i;
      else if (c == '"') in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > max_depth) return i;
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return std::string_view::npos;
}

}  // namespace meshtrain::api
