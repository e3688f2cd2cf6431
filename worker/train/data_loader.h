// Micro-batches from token shards (DESIGN.md, "Data").
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

#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "worker/train/token_file.h"

namespace meshtrain::train {

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

  // Fills inputs and targets, B*T tokens each (targets are inputs shifted by one).
  void Next(int32_t* inputs, int32_t* targets);

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
  std::vector<TokenFile> data_;
  std::vector<uint64_t> window_starts_;  // index of each file's first window; back(): the count
  uint64_t tokens_ = 0;
  uint64_t position_ = 0;
  std::vector<int32_t> window_;  // T+1 tokens
};

}  // namespace meshtrain::train
