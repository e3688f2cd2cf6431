// Micro-batches from token files (DESIGN.md, "Data").
//
// The files a spec names (paths or globs, expanded and sorted) are read as one
// stream of tokens. Each global micro-batch is dp_size * B windows of T+1 tokens,
// taken in order; data-parallel rank r reads windows [r*B, (r+1)*B), so the ranks of
// a TP group (same dp rank) read the same samples. The position wraps to the start
// when too few tokens remain, and can be saved and restored for checkpoints.
// Not thread-safe.

#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "worker/train/token_file.h"

namespace meshtrain::train {

class DataLoader {
 public:
  // Throws TokenFileError if a pattern matches nothing or a file is bad, and
  // std::invalid_argument if the data holds fewer than B*T+1 tokens per rank.
  DataLoader(const std::vector<std::string>& patterns, int batch, int seq, int dp_rank = 0, int dp_size = 1);

  // Fills inputs and targets, B*T tokens each (targets are inputs shifted by one).
  void Next(int32_t* inputs, int32_t* targets);

  uint64_t position() const { return position_; }
  void set_position(uint64_t position) { position_ = position; }
  uint64_t tokens() const { return total_; }
  const std::vector<std::string>& files() const { return files_; }

 private:
  uint32_t Token(uint64_t index) const;

  std::vector<std::string> files_;
  std::vector<TokenFile> data_;
  std::vector<uint64_t> starts_;  // index of each file's first token in the stream
  uint64_t total_ = 0;
  int batch_, seq_, dp_rank_, dp_size_;
  uint64_t position_ = 0;
};

}  // namespace meshtrain::train
