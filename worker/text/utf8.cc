#include "worker/text/utf8.h"

namespace meshtrain::text {

namespace {

// The end of the sequence at text[i] (lead byte >= 0x80): of the valid sequence, or else
// of its maximal invalid subpart (the offending byte, if any, starts the next one).
size_t SequenceEnd(std::string_view text, size_t i, bool* valid) {
  const auto lead = uint8_t(text[i]);
  // The continuation count and the range of the first continuation byte (Unicode
  // table 3-7); later continuation bytes are 80..BF.
  int need = 0;
  uint8_t low = 0x80, high = 0xBF;
  if (lead >= 0xC2 && lead <= 0xDF) {
    need = 1;
  } else if (lead >= 0xE0 && lead <= 0xEF) {
    need = 2;
    if (lead == 0xE0) low = 0xA0;
    if (lead == 0xED) high = 0x9F;  // no surrogates
  } else if (lead >= 0xF0 && lead <= 0xF4) {
    need = 3;
    if (lead == 0xF0) low = 0x90;
    if (lead == 0xF4) high = 0x8F;  // nothing past U+10FFFF
  }
  size_t end = i + 1;
  *valid = need > 0;
  for (int k = 0; k < need; ++k, ++end) {
    if (end >= text.size() || uint8_t(text[end]) < low || uint8_t(text[end]) > high) {
      *valid = false;
      break;
    }
    low = 0x80;
    high = 0xBF;
  }
  return end;
}

}  // namespace

size_t FirstInvalidUtf8(std::string_view text) {
  for (size_t i = 0; i < text.size();) {
    if (uint8_t(text[i]) < 0x80) {
      ++i;
      continue;
    }
    bool valid = false;
    const size_t end = SequenceEnd(text, i, &valid);
    if (!valid) return i;
    i = end;
  }
  return text.size();
}

bool IsValidUtf8(std::string_view text) { return FirstInvalidUtf8(text) == text.size(); }

std::string ScrubUtf8(std::string_view text, size_t* replaced) {
  std::string out;
  out.reserve(text.size());
  size_t i = 0;
  while (i < text.size()) {
    const auto lead = uint8_t(text[i]);
    if (lead < 0x80) {
      out += char(lead);
      ++i;
      continue;
    }
    bool valid = false;
    const size_t end = SequenceEnd(text, i, &valid);
    if (valid) {
      out.append(text.substr(i, end - i));
    } else {
      out += "\xEF\xBF\xBD";
      ++*replaced;
    }
    i = end;
  }
  return out;
}

void AppendUtf8(uint32_t cp, std::string& out) {
  if (cp < 0x80) {
    out += char(cp);
  } else if (cp < 0x800) {
    out += char(0xC0 | cp >> 6);
    out += char(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += char(0xE0 | cp >> 12);
    out += char(0x80 | (cp >> 6 & 0x3F));
    out += char(0x80 | (cp & 0x3F));
  } else {
    out += char(0xF0 | cp >> 18);
    out += char(0x80 | (cp >> 12 & 0x3F));
    out += char(0x80 | (cp >> 6 & 0x3F));
    out += char(0x80 | (cp & 0x3F));
  }
}

uint32_t NextCodePoint(std::string_view text, size_t* pos) {
  const auto lead = uint8_t(text[*pos]);
  const int extra = lead < 0x80 ? 0 : lead < 0xE0 ? 1 : lead < 0xF0 ? 2 : 3;
  uint32_t cp = extra == 0 ? lead : lead & (0x3F >> extra);
  for (int k = 1; k <= extra; ++k) cp = cp << 6 | (uint8_t(text[*pos + k]) & 0x3F);
  *pos += 1 + extra;
  return cp;
}

}  // namespace meshtrain::text
