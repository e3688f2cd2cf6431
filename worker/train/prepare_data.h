// Text to token shards with GPT-2's tokenizer (meshtrain prepare-data --tokenizer).
//
// Documents are JSONL lines (each an object with a "text" string), from files named
// *.jsonl, or whole plain-text files otherwise. Every document starts with the
// end-of-text token (50256 in GPT-2), as llm.c's fineweb.py writes them, so documents
// are always separated. The first `validation_fraction` of the input bytes (whole
// documents; within a lone document, up to the next line break) go to
// PREFIX_val_000000.bin, the rest to PREFIX_train_000001.bin, _000002, ... of at most
// `shard_tokens` tokens each, in llm.c's format (token_file.h), which llm.c reads too.
//
// Tokenizing runs on every core in chunks of documents, and the shards keep the
// documents' order: the output does not depend on the number of threads.
// Thread-safety: PrepareTokenShards may be called from any thread.

#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "worker/text/gpt2_tokenizer.h"

namespace meshtrain::train {

struct PrepareOptions {
  std::vector<std::string> inputs;  // paths or globs, expanded and sorted
  std::string prefix;               // shards are PREFIX_{val,train}_NNNNNN.bin
  uint64_t shard_tokens = 100'000'000;
  double validation_fraction = 0.1;  // 0: no validation shard
  int threads = 0;                   // 0: every core
  size_t piece_bytes = size_t(1) << 20;  // text tokenized by one thread at a time
};

struct PreparedShard {
  std::string path;
  uint64_t tokens = 0;
};

struct PrepareResult {
  std::vector<PreparedShard> validation, train;
  uint64_t documents = 0, bytes = 0;
  uint64_t invalid_utf8 = 0;  // sequences replaced by U+FFFD
};

// Progress, called about once a second and at the end: input bytes done and in all.
using PrepareProgress = std::function<void(uint64_t done_bytes, uint64_t total_bytes)>;

// Throws TokenFileError naming an input that cannot be read, a JSONL line that is not an
// object with a "text" string (file and line), or a shard that cannot be written.
PrepareResult PrepareTokenShards(const text::Gpt2Tokenizer& tokenizer, const PrepareOptions& options,
                                 const PrepareProgress& progress = nullptr);

}  // namespace meshtrain::train
