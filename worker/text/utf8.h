// UTF-8 helpers for the tokenizer. Thread-safety: plain functions.

#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace meshtrain::text {

// `text` with each maximal invalid subsequence replaced by U+FFFD, as the WHATWG
// decoder (a browser's or Node's TextDecoder) does. Adds the number replaced to
// `*replaced`. Valid text comes back unchanged.
std::string ScrubUtf8(std::string_view text, size_t* replaced);

// Whether `text` is valid UTF-8 (what ScrubUtf8 leaves unchanged).
bool IsValidUtf8(std::string_view text);

// The byte offset of the first invalid sequence in `text`, or text.size().
size_t FirstInvalidUtf8(std::string_view text);

// Appends the UTF-8 encoding of `code_point` (at most U+10FFFF) to `out`.
void AppendUtf8(uint32_t code_point, std::string& out);

// Reads the code point at `text[*pos]` and advances `*pos`; `text` must be valid UTF-8.
uint32_t NextCodePoint(std::string_view text, size_t* pos);

}  // namespace meshtrain::text
