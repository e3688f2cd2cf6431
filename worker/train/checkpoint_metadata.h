// The metadata of a checkpoint (checkpoint.h): its format, the names of its files, and
// the parser that checks what a checkpoint directory holds before anything reads its
// shards. On its own, apart from the writer and reader, for the fuzz target.
//
// Thread-safety: pure functions.

#pragma once

#include <stdexcept>
#include <string>

#include <nlohmann/json.hpp>

#include "api/model_shape.h"

namespace meshtrain::train {

// A checkpoint that cannot be read or used: the message names the file and what is wrong.
class CheckpointError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

inline constexpr const char* kCheckpointFormat = "meshtrain-checkpoint";
// Version 5 splits experts (written only where the layout does): the layout's "expert"
// (EP, which divides "shard") and each file's "expert", its writer's place in its expert
// group (its shard % EP): the file holds that rank's experts of each block, the units
// holding experts sharded over the shard / EP ranks with the same ones
// (checkpoint_layout.h), and every other element as any rank does, so that the EP
// writers of a shard group each hold them (a reader takes them from any one, as it takes
// the tensors every TP rank holds). Absent, EP is 1: a layout without expert parallelism
// still writes version 4, which readers of version 4 read. Version 4 has pipelines: the
// layout's "pipeline" stages, and each file's "stage" and "units" (those of its stage it
// holds, increasing; absent: every unit). Version 3
// checksums each file in chunks (metadata "chunkElements" and "chunkCrc32c"),
// so that a rank reads only the chunks it needs. Version 2 padded each TP slice's
// vocabulary in the engine (metadata "vocabMultiple"; the files hold the model's elements
// only) and had one "crc32c" per file; version 1 had no padding and reads the same way
// with a multiple of 1.
inline constexpr int kCheckpointVersion = 5;

// "rank-00003.bin": the shard file of a rank, in its step's directory.
std::string CheckpointRankFile(int rank);

// The model's family and shape as metadata holds them ("model"), and back: metadata
// without a family is GPT-2's, without maxPositions of seqLen rows of positions. Throws
// CheckpointError naming `file` for a malformed one.
nlohmann::json CheckpointShapeJson(const api::ModelShape& shape);
api::ModelShape ShapeOfCheckpointJson(const nlohmann::json& model, const std::string& file);

// The metadata of a checkpoint, `text` read from `file`, checked for format, fields,
// layout and file names, and that it is of a model of `shape`'s weights (the training
// window may differ: api::ModelShape::SameWeights). Throws CheckpointError
// naming `file` and what is wrong.
nlohmann::json ParseCheckpointMetadata(const std::string& text, const std::string& file, const api::ModelShape& shape);

}  // namespace meshtrain::train
