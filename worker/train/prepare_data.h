// Text to token shards with a model's tokenizer (meshtrain prepare-data --tokenizer DIR).
//
// Documents are JSON lines of files named *.jsonl, each an object with a "text" string, or
// with "prompt" and "completion" strings (fine-tuning data), or else whole plain-text
// files. Each document is framed as its tokenizer says (text::Tokenizer::frame): the BOS
// before it where the tokenizer adds one, the EOS after it; GPT-2's single <|endoftext|>
// before it, as llm.c's fineweb.py writes them. A prompt/completion document is BOS, the
// prompt, the completion and the EOS, always; only the completion's tokens and the EOS are
// targets, which the shard's loss mask says (token_file.h: SHARD.mask, written only for
// shards that hold such a document).
//
// The first `validation_fraction` of the input bytes go to PREFIX_val_000000.bin, the rest
// to PREFIX_train_000001.bin, _000002, ... in llm.c's format (token_file.h): uint16 for
// vocabularies up to 65536 tokens, else Llama 3's uint32. A JSON line's document is never
// cut, neither between shards (a shard closes early instead, and a document longer than
// shard_tokens makes a shard of its own) nor between validation and training. A plain-text
// file is one document, which may be cut between shards and for validation at any token
// (its tokens are those of the whole file).
//
// Tokenizing runs on every core: documents of JSON lines in rounds of about piece_bytes of
// text per thread, a plain-text file cut where its tokenizer splits anyway
// (Tokenizer::EncodeParallel). The output does not depend on the number of threads.
//
// Errors name the file, line and JSON path. When one is thrown, every shard and mask this
// call wrote is removed (each was written whole, through a temporary file and rename), so
// nothing half-done is left. Invalid UTF-8 is replaced by U+FFFD with a warning naming the
// file, line and byte offset.
//
// Thread-safety: PrepareTokenShards may be called from any thread.

#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "worker/text/tokenizer.h"

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
  bool masked = false;  // a loss mask was written beside it (path + ".mask")
};

struct PrepareResult {
  std::vector<PreparedShard> validation, train;
  uint64_t documents = 0, bytes = 0;
  uint64_t prompt_completion = 0;  // documents that were prompt/completion pairs
  uint64_t invalid_utf8 = 0;       // sequences replaced by U+FFFD
  // One line per input with invalid UTF-8 (the first 20): FILE:LINE: ... byte offset.
  std::vector<std::string> warnings;
};

// Progress, called about once a second and at the end: input bytes done and in all.
using PrepareProgress = std::function<void(uint64_t done_bytes, uint64_t total_bytes)>;

// Throws TokenFileError naming an input that cannot be read, a JSON line that is not an
// object, lacks its fields or has an empty completion (file, line and JSON path), or a
// shard that cannot be written.
PrepareResult PrepareTokenShards(const text::Tokenizer& tokenizer, const PrepareOptions& options,
                                 const PrepareProgress& progress = nullptr);

}  // namespace meshtrain::train
