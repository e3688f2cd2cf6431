// Sharded, atomic, reshardable checkpoints (docs/checkpoints.md).
//
// Under spec.checkpoint.path, one directory per step:
//   step-00000100/metadata.json   format version, model shape, layout, the engine's vocabulary
//                                 padding, step, data position, and each shard file's rank,
//                                 place, size and the CRC-32C of each of its chunks
//   step-00000100/rank-00003.bin  that rank's shards of fp32 master weights, then AdamW m,
//                                 then v: each unit's shard elements that are the model's
//                                 (no padding), in unit order (checkpoint_layout.h)
//   latest                        "step-00000100": the newest complete checkpoint
// The ranks of replica 0 of every pipeline stage write (the other replicas hold the same
// shards). A checkpoint is
// written into .partial-step-N, each writer leaving its file and a sidecar with the file's
// size and chunk checksums, then telling rank 0 through the Store (or sending its error);
// rank 0 waits for every writer there, writes the metadata, fsyncs, renames the directory
// into place, then moves `latest` (a temporary file, fsync, rename) and deletes all but the
// newest spec.checkpoint.keep of this model's older checkpoints (Finish says which count).
// `latest` never names an incomplete checkpoint, and a failed write removes its partial
// directory and leaves the previous ones as they were.
//
// A rank resuming under any layout (P x R x S x T, another world size) reads only the chunks
// that hold its own elements (checkpoint_reader.h): resharding is exact, and the whole
// model is never assembled. LoadCheckpoint assembles it, for the tools that want it whole.

#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "api/layout.h"
#include "api/model_shape.h"
#include "worker/parallel/engine.h"
#include "worker/train/checkpoint_metadata.h"

namespace meshtrain::comm {
class StoreClient;
}

namespace meshtrain::train {

// Where training stands at a checkpoint.
struct TrainingPosition {
  int64_t step = 0;            // optimizer steps taken
  uint64_t data_position = 0;  // the training data loader's position: windows of its seeded order
};

using parallel::ShardState;
using parallel::WholeState;

struct LoadedCheckpoint {
  std::string directory;
  TrainingPosition position;
  WholeState state;
};

// A file of a checkpoint, whole. Throws CheckpointError naming it when it is missing or
// unreadable.
std::string ReadCheckpointFile(const std::filesystem::path& path);

// The model shape a checkpoint's metadata names; throws CheckpointError naming the file.
api::ModelShape CheckpointModel(const std::string& directory);

// The model of the checkpoint in `directory` when it is whole (its metadata reads and
// names files that are there at their sizes; their data is not read) and of a model other
// than `shape`; nullopt for a checkpoint of `shape` or a damaged one.
std::optional<api::ModelShape> WholeCheckpointOfAnotherModel(const std::string& directory,
                                                             const api::ModelShape& shape);

// Reads and verifies the checkpoint in `directory` for a model of `shape`, whole. Throws
// CheckpointError for a missing, truncated or corrupt file, or metadata of another model
// or format.
LoadedCheckpoint LoadCheckpoint(const std::string& directory, const api::ModelShape& shape);

// The step directories under `path` to resume from, in the order to try them: the one
// `latest` names, then the others newest first.
std::vector<std::string> ResumeCandidates(const std::string& path);

// The run that wrote the checkpoint in `directory`: its job's metadata.uid, "" for a
// checkpoint written without one; nullopt when its metadata cannot be read.
std::optional<std::string> CheckpointRun(const std::string& directory);

// Every step directory under `path`, newest first; with `verify`, each is loaded and
// checked (every file read), and `problem` says what is wrong.
struct CheckpointListing {
  std::string directory;
  int64_t step = -1;
  std::string layout;  // "1 replica x 2 shards x tp 2 (4 ranks)"
  int64_t bytes = 0;
  bool latest = false;
  std::string problem;  // empty when it verifies (or was not verified) and its metadata reads
};
std::vector<CheckpointListing> ListCheckpoints(const std::string& path, bool verify = true);

// Counters of a rank's checkpoint writes, read by metrics.
struct CheckpointStats {
  int64_t written = 0, failures = 0;
  int64_t last_step = -1, last_bytes = 0;  // of the newest complete checkpoint this rank took part in
  double last_seconds = 0;                 // its write time, snapshot to done
  std::string last_error;                  // why the newest failed write failed
};

// Writes this rank's part of checkpoints on a background thread.
// Thread-safety: one thread calls Save and Wait; stats() may be called from any thread.
class CheckpointWriter {
 public:
  // `path` and `keep` from spec.checkpoint; this is `rank` of `layout`; `shape` and the
  // engine's vocabulary padding (Engine::vocab_multiple, which decides how the embedding's
  // and the head's units split into shards) go into the metadata. The writers tell rank 0 through `store` (a
  // connection of the writer's own, for rank 0 waits on it; null only where rank 0 is the
  // one writer: throws std::invalid_argument otherwise). Failures go to `log_error`
  // (called on the writer thread). `run` (the job's metadata.uid) goes into the metadata,
  // so that a restart of the run finds its own checkpoints (CheckpointRun).
  CheckpointWriter(std::string path, int64_t keep, const api::ModelShape& shape, const api::ParallelLayout& layout,
                   int vocab_multiple, int rank, comm::StoreClient* store,
                   std::function<void(const std::string&)> log_error, std::string run = "");
  ~CheckpointWriter();  // waits for the write in progress

  // Removes what an interrupted run left half-written. Rank 0 calls it before any rank
  // writes.
  static void RemovePartial(const std::string& path);

  // Waits for the previous checkpoint's write, has `snapshot` fill the writer's buffer
  // (reused from one checkpoint to the next) with this rank's state at `position`, and
  // hands it to the background thread. Returns the seconds this call took: the stall.
  double Save(const TrainingPosition& position, const std::function<void(ShardState*)>& snapshot);
  // Blocks until the last checkpoint handed over is written (or has failed).
  void Wait();
  CheckpointStats stats() const;

 private:
  void Loop();
  void Write(const TrainingPosition& position, const ShardState& state);
  // Replica 0: this rank's file and sidecar, then its word to rank 0.
  void WriteShards(const ShardState& state, const std::string& partial, const std::string& name);
  // Rank 0: the metadata, the rename, `latest` and pruning, once every writer is done.
  void Finish(const TrainingPosition& position, const std::string& partial, const std::string& name);

  const std::string path_;
  const int64_t keep_;
  const api::ModelShape shape_;
  const api::ParallelLayout layout_;
  const int vocab_multiple_;
  const std::string run_;
  const int rank_;
  comm::StoreClient* const store_;
  const std::function<void(const std::string&)> log_error_;

  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::optional<TrainingPosition> pending_;
  ShardState state_;  // the snapshot being written; the caller fills it only while the writer is idle
  bool busy_ = false, stopping_ = false;
  CheckpointStats stats_;
  std::thread thread_;
};

}  // namespace meshtrain::train
