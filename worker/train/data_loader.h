// Micro-batches from token shards (docs/design.md, "Data").
//
// The files a spec names (paths or globs, expanded and sorted; MTOK, llm.c or raw uint16,
// token_file.h) are cut into windows of T+1 tokens at stride T, none crossing the end of
// a file. Windows are read in a seeded order: pass p over the data (an epoch) takes
// them in the order of a pseudo-random permutation keyed by (seed, p), so each pass is
// different and every run with the same seed reads the same windows.
//
// A global micro-batch is the next dp_size * B windows of that order; data-parallel
// rank r takes windows [r*B, (r+1)*B) of it and reads only those, so the ranks of a TP
// group (same dp rank) read the same samples. A pass ends when fewer windows than a
// micro-batch remain in it.
//
// The position is the number of windows taken by all ranks together. Saved in
// checkpoints and restored, it makes a resume read exactly what an uninterrupted run
// would. Not thread-safe.
//
// Loss masks: a shard with a mask beside it (SHARD.mask, token_file.h; prepare-data writes
// them for prompt/completion data) has some tokens that are context only. Next writes
// target -1 where the mask says the token is not a target; inputs stay the real tokens.
// Without masks every target is real. GlobalTargets counts the targets that are not -1 in
// the next global micro-batches, reading only their masks, so that the loss can be the mean
// over the whole global batch's targets before the first backward.

#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "worker/train/token_file.h"

namespace meshtrain::train {

// Where documents start in token data (spec.data.attention: document), from the framing
// prepare-data writes (text::Tokenizer::frame, prepare_data.h): at each `start` token,
// the one a tokenizer puts before every document (the BOS; GPT-2's <|endoftext|>, which
// llm.c's data puts between documents), or, for a tokenizer that puts none, at the token
// after each `end` token (the EOS it puts after every document). Of start tokens in a row
// only the last starts a document (a GPT-2 prompt/completion pair ends with the
// <|endoftext|> that also starts the next). A window's first token starts a document
// too: its document began before the window, or at it.
struct DocumentMarks {
  std::optional<int32_t> start, end;
  // start: frame.before's first token, if any; else end: frame.after's last, if any.
  static DocumentMarks Of(const std::vector<uint32_t>& before, const std::vector<uint32_t>& after);
  bool empty() const { return !start && !end; }
  // The rows of tokens [0, n) where a document starts, ascending: 0, then each row the
  // marks say.
  std::vector<int64_t> Starts(const int32_t* tokens, int64_t n) const;
  // Whether tokens [0, n) hold a mark that starts a document after their first token.
  bool Found(const int32_t* tokens, int64_t n) const;
};

struct DataOptions {
  int batch = 1, seq = 1;
  int dp_rank = 0, dp_size = 1;
  TokenFormat format = TokenFormat::kHeader;
  uint32_t vocab_size = 0;  // tokens at or above it are an error; 0: not checked
  uint64_t seed = 0;        // keys the order of windows
};

class DataLoader {
 public:
  // Opens every file and scans it against the vocabulary. Throws TokenFileError if a
  // pattern matches nothing or a file is bad, and std::invalid_argument if the data
  // holds fewer windows than one global micro-batch needs.
  DataLoader(const std::vector<std::string>& patterns, const DataOptions& options);

  // Fills inputs and targets, B*T tokens each (targets are inputs shifted by one; -1
  // where the shard's mask says the token is not a target).
  void Next(int32_t* inputs, int32_t* targets);

  // The number of targets that are not -1 in the next `micro_steps` global micro-batches
  // (every data-parallel rank's windows: micro_steps * dp_size * B windows from the
  // position), without moving the position. micro_steps * dp_size * B * T without masks.
  int64_t GlobalTargets(int64_t micro_steps) const;
  // Whether any shard has a loss mask.
  bool masked() const;
  // The first file whose first `tokens` tokens hold no mark of a document's start
  // (DocumentMarks::Found), or empty when every file has one.
  std::string FileWithoutDocuments(const DocumentMarks& marks, uint64_t tokens) const;

  uint64_t position() const { return position_; }
  void set_position(uint64_t position) { position_ = position; }
  uint64_t tokens() const { return tokens_; }
  uint64_t windows() const { return window_starts_.back(); }
  const std::vector<std::string>& files() const { return files_; }

  // Window `index` of the order of pass `pass` (a bijection on [0, count) for each key).
  static uint64_t Permute(uint64_t index, uint64_t count, uint64_t seed, uint64_t pass);

 private:
  DataOptions options_;
  std::vector<std::string> files_;
  // Where window `index` of the order of pass `pass` is: its file and first token.
  std::pair<size_t, uint64_t> Window(uint64_t index, uint64_t pass) const;

  std::vector<TokenFile> data_;
  std::vector<std::optional<TokenMask>> masks_;  // each file's, if it has one
  std::vector<uint64_t> window_starts_;  // index of each file's first window; back(): the count
  uint64_t tokens_ = 0;
  uint64_t position_ = 0;
  std::vector<int32_t> window_;  // T+1 tokens
};

}  // namespace meshtrain::train
