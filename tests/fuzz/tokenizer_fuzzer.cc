// libFuzzer target for Hugging Face tokenizers (worker/text/tokenizer.h): a tokenizer.json
// and a tokenizer_config.json loaded, then text encoded and decoded with them.
//
// The input: tokenizer.json's text; then, after a NUL byte (which JSON text cannot hold),
// the text to encode; then, after another NUL, tokenizer_config.json's text. Without a
// text, a fixed one is encoded.
//
// Beyond "no crash", it checks on every input:
//   - only TokenizerError escapes loading, and its message names the file it is about;
//     so does encoding's (a pattern that fails on the text, past PCRE2's match limit);
//   - every id of the encoding, and of the document frame, is below vocab_size();
//   - a session encodes a text the same the second time (its cache changes nothing) as
//     a fresh session does, and says how many invalid UTF-8 sequences it replaced;
//   - decoding those ids gives text, or TokenizerError for a decoder that is not
//     implemented; never std::out_of_range.

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "worker/text/tokenizer.h"

namespace {

using meshtrain::text::Tokenizer;
using meshtrain::text::TokenizerError;

[[noreturn]] void Fail(const char* what, const std::string& detail) {
  std::fprintf(stderr, "%s: %s\n", what, detail.c_str());
  std::abort();
}

// The part of `input` after the `n`th NUL (0: before the first), up to the next.
std::string_view Part(std::string_view input, int n) {
  size_t begin = 0;
  for (int i = 0; i < n; ++i) {
    const size_t nul = input.find('\0', begin);
    if (nul == std::string_view::npos) return {};
    begin = nul + 1;
  }
  const size_t end = input.find('\0', begin);
  return input.substr(begin, end == std::string_view::npos ? std::string_view::npos : end - begin);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  const bool has_text = input.find('\0') != std::string_view::npos;
  const std::string_view json = Part(input, 0), config = Part(input, 2);
  const std::string_view text = has_text ? Part(input, 1) : "Hello world, it's 2026.\n東京 👍🏽 naïve café  x";
  const std::string file = "fuzz/tokenizer.json", config_file = "fuzz/tokenizer_config.json";
  std::optional<Tokenizer> tokenizer;
  try {
    tokenizer.emplace(Tokenizer::FromHuggingFaceFile(json, file, config, config_file));
  } catch (const TokenizerError& e) {
    const std::string message = e.what();
    if (!message.starts_with(file + ": ") && !message.starts_with(config_file + ": ")) {
      Fail("an error that does not name its file", message);
    }
    return 0;
  }
  const uint32_t vocab = tokenizer->vocab_size();
  for (const std::vector<uint32_t>* frame : {&tokenizer->frame().before, &tokenizer->frame().after}) {
    for (uint32_t id : *frame) {
      if (id >= vocab) Fail("a frame id past the vocabulary", std::to_string(id));
    }
  }
  if (tokenizer->eos() >= vocab) Fail("an EOS past the vocabulary", std::to_string(tokenizer->eos()));

  std::vector<uint32_t> first, second;
  Tokenizer::Session session(*tokenizer);
  size_t replaced = 0;
  try {
    replaced = session.Encode(text, first);
  } catch (const TokenizerError& e) {  // a pattern past PCRE2's match limit on this text
    if (!std::string_view(e.what()).starts_with(file + ": ")) Fail("an encoding error without its file", e.what());
    return 0;
  }
  if (session.Encode(text, second) != replaced || second != first) Fail("a session's cache changed the ids", "");
  if (tokenizer->Encode(text) != first) Fail("a fresh session gave other ids", "");
  for (uint32_t id : first) {
    if (id >= vocab) Fail("an id past the vocabulary", std::to_string(id) + " of " + std::to_string(vocab));
  }
  try {
    (void)tokenizer->Decode(first);
  } catch (const TokenizerError&) {  // a decoder that is not implemented
  } catch (const std::out_of_range& e) {
    Fail("decoding its own ids went past the vocabulary", e.what());
  }
  return 0;
}
