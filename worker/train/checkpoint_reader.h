// Reading a checkpoint one unit shard at a time (docs/checkpoints.md).
//
// A rank resuming under any layout asks for the elements of its own shard of each unit
// in turn, and the reader reads only the chunks of the shard files that hold them
// (checkpoint_layout.h), verifying each chunk's checksum: the whole model is never
// assembled, and a rank holds at most its own state, the chunks in flight and an index of
// one unit while it loads. Checkpoints of format versions 1 and 2 have one checksum per
// file: their files are read and verified whole when the reader opens them, as before.
//
// Thread-safety: none; one thread uses a reader.

#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "api/model_shape.h"
#include "worker/model/parameters.h"
#include "worker/train/checkpoint.h"
#include "worker/train/checkpoint_layout.h"

namespace meshtrain::train {

class CheckpointReader {
 public:
  // Reads and checks the metadata in `directory` for a model of `shape`, and that every
  // shard file is there at its size. Throws CheckpointError naming the file at fault.
  CheckpointReader(const std::string& directory, const api::ModelShape& shape);

  const std::string& directory() const { return directory_; }
  const TrainingPosition& position() const { return position_; }

  // For each i, the checkpoint's fp32 master weight and AdamW m and v of the element of
  // unit `unit` at single-rank index whole_indices[i] (-1: vocabulary padding, zeros),
  // into master[i], m[i] and v[i] (m and v null: the master weights alone, and only their
  // section is read). Reads and verifies only the chunks holding them. Throws
  // CheckpointError naming the file and chunk that fail their checksum or cannot be read,
  // or an element that no file holds.
  void ReadUnit(int unit, const std::vector<int64_t>& whole_indices, float* master, float* m, float* v);

  // Bytes read from the shard files so far.
  int64_t bytes_read() const { return bytes_read_; }

 private:
  struct ShardFile {
    std::string path;
    model::ParameterLayout slice;  // the writer's TP slice
    ShardFileLayout layout;
    std::vector<uint32_t> checksums;  // of each chunk: master's, then m's, then v's
    std::vector<float> whole;         // format 1 and 2: the file, verified on opening
  };
  // Elements [from, from + n) of `section` (0 master, 1 m, 2 v) of `file`'s chunk
  // `chunk`, verified, into `out`.
  void ReadChunk(const ShardFile& file, int section, int chunk, int64_t from, int64_t n, float* out);

  std::string directory_;
  TrainingPosition position_;
  model::ParameterLayout whole_layout_;
  std::vector<ShardFile> files_;
  int64_t bytes_read_ = 0;
};

// The checkpoint in `directory` read through and verified, chunk by chunk, one unit at a
// time. Throws CheckpointError as LoadCheckpoint does.
void VerifyCheckpoint(const std::string& directory, const api::ModelShape& shape);

}  // namespace meshtrain::train
