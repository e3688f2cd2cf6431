// Checkpoints on one machine: a run stopped at any step and resumed gives the losses of
// the run that never stopped, bit for bit; the files of any layout load back exactly and
// hold only the model's elements (never the engine's vocabulary padding); a version-1
// checkpoint (no padding) still loads; a damaged checkpoint is named and skipped; a write
// that fails leaves the last one intact and nothing half-written, and a run whose last
// checkpoint fails, or whose loss diverges, fails; pruning deletes only this model's older
// checkpoints; another model's checkpoints are a configuration error.

#include "worker/train/checkpoint.h"

#include <sys/mount.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <sstream>
#include <thread>

#include <gtest/gtest.h>

#include "api/engine_memory.h"
#include "api/manifest.h"
#include "worker/comm/store.h"
#include "worker/model/parameters.h"
#include "worker/parallel/flat_unit.h"
#include "worker/train/checkpoint_layout.h"
#include "worker/train/checkpoint_reader.h"
#include "worker/train/crc32c.h"
#include "worker/train/run_report.h"
#include "worker/train/token_file.h"
#include "worker/train/trainer.h"

namespace meshtrain::train {
namespace {

namespace fs = std::filesystem;

const api::ModelShape kShape{.layers = 2, .heads = 2, .hidden = 16, .vocab_size = 256, .seq_len = 16};

// A shape whose vocabulary the engine pads in every TP slice: 250 rows to 256 on one rank,
// 125 to 128 with TP 2, 62 or 63 to 128 with TP 4.
const api::ModelShape kOddVocabulary{.layers = 2, .heads = 4, .hidden = 16, .vocab_size = 250, .seq_len = 16};

// Hands `master`, `m` and `v` (equal sizes) to a writer as the rank's snapshot, in memory
// the snapshot owns.
void FillSnapshot(ShardState* into, const std::vector<float>& master, const std::vector<float>& m,
                  const std::vector<float>& v) {
  const size_t n = master.size();
  std::shared_ptr<float[]> arrays(new float[3 * n]);
  std::copy(master.begin(), master.end(), arrays.get());
  std::copy(m.begin(), m.end(), arrays.get() + n);
  std::copy(v.begin(), v.end(), arrays.get() + 2 * n);
  into->size = int64_t(n);
  into->master = arrays.get();
  into->m = arrays.get() + n;
  into->v = arrays.get() + 2 * n;
  into->storage = std::move(arrays);
}

// The single-rank indices of the model elements in shard `shard` of every unit of TP
// slice `tp` of `T`, split as an engine padding its vocabulary to `vocab_multiple` splits
// it: what that rank's checkpoint file holds, in order.
std::vector<int64_t> ShardElements(const api::ModelShape& shape, int tp, int T, int S, int shard, int vocab_multiple) {
  const model::ParameterLayout slice(shape, tp, T, vocab_multiple);
  std::vector<int64_t> at;
  for (int u = 0; u < slice.units(); ++u) {
    const parallel::UnitShard s = parallel::ShardOfUnit(slice, u, S, shard);
    for (int64_t i : slice.WholeIndices(s.unit_begin + s.begin, s.unit_begin + s.begin + s.real)) {
      if (i >= 0) at.push_back(i);
    }
  }
  return at;
}

WholeState RandomState(const api::ModelShape& shape, uint32_t seed) {
  WholeState whole;
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist;
  for (auto* part : {&whole.master, &whole.m, &whole.v}) {
    part->resize(size_t(shape.ParameterCount()));
    for (float& x : *part) x = dist(rng);
  }
  for (float& x : whole.v) x = std::abs(x);  // AdamW's second moments
  return whole;
}

// Writes `whole` as the ranks of `layout` would, through one CheckpointWriter per rank
// (concurrently, rank 0 finishing), each rank's shards split as an engine padding its
// vocabulary to `vocab_multiple` splits them; returns the step directory.
std::string WriteAsLayout(const std::string& path, const api::ModelShape& shape, const api::ParallelLayout& layout,
                          int vocab_multiple, const WholeState& whole, const TrainingPosition& position) {
  // The writers meet rank 0 through a Store, each on a connection of its own.
  comm::StoreServer server("127.0.0.1", 0);
  std::vector<std::unique_ptr<comm::StoreClient>> stores;
  std::vector<std::unique_ptr<CheckpointWriter>> writers;
  for (int rank = 0; rank < layout.world(); ++rank) {
    stores.push_back(std::make_unique<comm::StoreClient>("127.0.0.1:" + std::to_string(server.port()),
                                                         std::chrono::seconds(10)));
    writers.push_back(std::make_unique<CheckpointWriter>(path, 1, shape, layout, vocab_multiple, rank,
                                                         stores.back().get(),
                                                         [](const std::string& e) { ADD_FAILURE() << e; }));
  }
  for (int rank = layout.world() - 1; rank >= 0; --rank) {
    const api::LayoutCoord at = layout.CoordOf(rank);
    std::vector<float> master, m, v;
    for (int64_t i : ShardElements(shape, at.tp, layout.tp(), layout.shard(), at.shard, vocab_multiple)) {
      master.push_back(whole.master[size_t(i)]);
      m.push_back(whole.m[size_t(i)]);
      v.push_back(whole.v[size_t(i)]);
    }
    writers[size_t(rank)]->Save(position, [&](ShardState* into) {
      FillSnapshot(into, master, m, v);
      into->tp_rank = at.tp, into->shard_rank = at.shard, into->replica = at.replica;
    });
  }
  for (auto& w : writers) w->Wait();
  EXPECT_EQ(writers[0]->stats().written, 1);
  char name[32];
  std::snprintf(name, sizeof name, "step-%08lld", static_cast<long long>(position.step));
  return (fs::path(path) / name).string();
}

class CheckpointTest : public testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("meshtrain-checkpoint-" + std::to_string(::getpid()));
    fs::create_directories(dir_);
    WriteTextAsTokenFiles("examples/data/pride-and-prejudice.txt", (dir_ / "train.bin").string(),
                          (dir_ / "val.bin").string(), 0.1);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // 12 steps of a small model (of `shape`); checkpoints every 4 steps under `path` (none if empty).
  api::TrainingJob Job(const std::string& path, const api::ModelShape& shape = kShape) {
    nlohmann::json manifest = {
        {"apiVersion", "meshtrain.dev/v1alpha1"},
        {"kind", "TrainingJob"},
        {"metadata", {{"name", "checkpoint-test"}}},
        {"spec",
         {{"image", "meshtrain:test"},
          {"model", {{"layers", shape.layers}, {"heads", shape.heads}, {"hidden", shape.hidden},
                     {"vocabSize", shape.vocab_size}, {"seqLen", shape.seq_len}, {"dropout", 0.1}}},
          {"data", {{"train", (dir_ / "train.bin").string()}}},
          {"training",
           {{"steps", 12}, {"microBatchSize", 2}, {"globalBatchTokens", 64}, {"learningRate", 1e-2},
            {"warmupSteps", 2}, {"seed", 3}, {"precision", "fp32"}, {"evalInterval", 0}}}}}};
    if (!path.empty()) manifest["spec"]["checkpoint"] = {{"path", path}, {"interval", 4}, {"keep", 2}};
    const api::CheckedJob checked = api::CheckTrainingJob(manifest, "test", 0);
    EXPECT_TRUE(checked.ok()) << checked.errors.front().ToString();
    return checked.job;
  }

  fs::path dir_;
};

// Stops a run from its report callback after step `at`, as a crash would (the Trainer's
// destructor only waits for the write already handed over).
struct Stop {};

std::vector<double> Losses(Trainer& trainer, int64_t stop_after = -1) {
  std::vector<double> losses;
  try {
    trainer.Run([&](const StepReport& r) {
      losses.push_back(r.loss);
      if (r.step == stop_after) throw Stop{};
    });
  } catch (const Stop&) {
  }
  return losses;
}

TEST_F(CheckpointTest, AResumedRunRepeatsTheUninterruptedLossesBitForBit) {
  Trainer straight(Job(""));
  const std::vector<double> want = Losses(straight);
  ASSERT_EQ(want.size(), 12u);
  for (int64_t stop : {5, 8, 11}) {
    const std::string path = (dir_ / ("ckpt-" + std::to_string(stop))).string();
    {
      Trainer first(Job(path));
      EXPECT_FALSE(first.resumed_from());
      Losses(first, stop);
    }
    Trainer resumed(Job(path));
    const int64_t from = stop / 4 * 4;  // the last checkpoint before the stop
    ASSERT_EQ(resumed.resumed_from(), std::optional<int64_t>(from)) << "stopped after step " << stop;
    const std::vector<double> after = Losses(resumed);
    ASSERT_EQ(after.size(), size_t(12 - from));
    for (size_t i = 0; i < after.size(); ++i) {
      EXPECT_EQ(after[i], want[size_t(from) + i]) << "step " << from + int64_t(i) + 1 << ", stopped after " << stop;
    }
    // The run ended with a checkpoint of its last step; the newest two are kept.
    EXPECT_EQ(ListCheckpoints(path).size(), 2u);
    EXPECT_EQ(ListCheckpoints(path).front().step, 12);
    EXPECT_TRUE(ListCheckpoints(path).front().latest);
  }
  // resume: false starts again from step 0.
  api::TrainingJob fresh = Job((dir_ / "ckpt-5").string());
  fresh.spec.checkpoint.resume = false;
  EXPECT_FALSE(Trainer(fresh).resumed_from());
}

// What the ranks of a layout would write, from a known whole state, through the writers
// themselves (one per rank, concurrently, rank 0 finishing): loading gives it back exactly,
// and the files hold the model's elements only, whether the engine pads its vocabulary
// (by 128, in every TP slice of this shape) or not.
TEST_F(CheckpointTest, EveryLayoutsFilesLoadBackTheWholeStateExactly) {
  const api::ModelShape shape = kOddVocabulary;
  const WholeState whole = RandomState(shape, 1);
  struct Sizes {
    int nodes, gpus, tp, shard;
  };
  for (const int vocab_multiple : {1, api::kVocabMultiple}) {
    for (const Sizes& s :
         {Sizes{1, 1, 1, 1}, Sizes{1, 3, 1, 3}, Sizes{1, 4, 2, 2}, Sizes{2, 4, 2, 2}, Sizes{1, 8, 4, 2}}) {
      const api::ParallelLayout layout(s.nodes, s.gpus, s.tp, s.shard);
      const std::string path = (dir_ / ("layout-" + std::to_string(layout.world()) + "-" + std::to_string(s.tp) +
                                        "-v" + std::to_string(vocab_multiple)))
                                   .string();
      const std::string step = WriteAsLayout(path, shape, layout, vocab_multiple, whole, {7, 99});
      const LoadedCheckpoint loaded = LoadCheckpoint(step, shape);
      EXPECT_EQ(loaded.position.step, 7);
      EXPECT_EQ(loaded.position.data_position, 99u);
      EXPECT_EQ(loaded.state.master, whole.master) << layout.world() << " ranks, tp " << s.tp << ", vocabulary padded to "
                                                   << vocab_multiple;
      EXPECT_EQ(loaded.state.m, whole.m);
      EXPECT_EQ(loaded.state.v, whole.v);
      const std::vector<CheckpointListing> listed = ListCheckpoints(path);
      ASSERT_EQ(listed.size(), 1u);
      EXPECT_TRUE(listed[0].problem.empty()) << listed[0].problem;
      int64_t slices = 0;  // replica 0 writes every TP slice once, whole tensors in each
      for (int t = 0; t < s.tp; ++t) slices += model::ParameterLayout(shape, t, s.tp).total();
      EXPECT_EQ(listed[0].bytes, int64_t(3 * sizeof(float)) * slices);
    }
  }
}

// A checkpoint of the padded engine holds exactly the model's elements (the file is 3 x 4
// bytes per parameter, not per padded element), records the padding, and reshards: written
// again as 2 shards x TP 2 (each file its shards' model elements) and resumed from there,
// the run goes on with the losses of the run that never stopped, bit for bit.
TEST_F(CheckpointTest, ThePaddedEnginesCheckpointHoldsTheModelsElementsAndReshards) {
  const api::ModelShape shape = kOddVocabulary;
  Trainer straight(Job("", shape));
  const std::vector<double> want = Losses(straight);
  ASSERT_EQ(want.size(), 12u);
  const fs::path path = dir_ / "padded";
  {
    Trainer first(Job(path.string(), shape));
    Losses(first, 4);
  }
  const fs::path step = path / "step-00000004";
  const nlohmann::json meta = nlohmann::json::parse(std::ifstream(step / "metadata.json"));
  EXPECT_EQ(meta.at("version"), 4);
  EXPECT_EQ(meta.at("vocabMultiple"), api::kVocabMultiple);
  const int64_t padded = model::ParameterLayout(shape, 0, 1, api::kVocabMultiple).total();
  ASSERT_GT(padded, shape.ParameterCount());
  EXPECT_EQ(int64_t(fs::file_size(step / "rank-00000.bin")), 3 * 4 * shape.ParameterCount())
      << "the engine holds " << padded << " elements, " << shape.ParameterCount() << " of them the model's";
  const LoadedCheckpoint written = LoadCheckpoint(step.string(), shape);

  // Another layout's files of the same state, as its padded ranks would write them.
  const fs::path resharded = dir_ / "resharded";
  const api::ParallelLayout layout(1, 4, 2, 2);
  const std::string step4 = WriteAsLayout(resharded.string(), shape, layout, api::kVocabMultiple, written.state,
                                          written.position);
  int64_t model_elements = 0, held_elements = 0;
  for (int rank = 0; rank < layout.world(); ++rank) {
    const api::LayoutCoord at = layout.CoordOf(rank);
    const int64_t elements = int64_t(ShardElements(shape, at.tp, 2, 2, at.shard, api::kVocabMultiple).size());
    int64_t held = 0;  // what that rank's engine holds: its shards, padding included
    const model::ParameterLayout slice(shape, at.tp, 2, api::kVocabMultiple);
    for (int u = 0; u < slice.units(); ++u) held += parallel::ShardOfUnit(slice, u, 2, at.shard).real;
    char name[32];
    std::snprintf(name, sizeof name, "rank-%05d.bin", rank);
    EXPECT_EQ(int64_t(fs::file_size(fs::path(step4) / name)), 3 * 4 * elements)
        << name << ": its shards hold " << held << " elements, " << elements << " of them the model's";
    model_elements += elements, held_elements += held;
  }
  EXPECT_LT(model_elements, held_elements) << "the ranks' shards hold their vocabulary slices' padding rows";
  const LoadedCheckpoint back = LoadCheckpoint(step4, shape);
  EXPECT_EQ(back.state.master, written.state.master);
  EXPECT_EQ(back.state.m, written.state.m);
  EXPECT_EQ(back.state.v, written.state.v);
  Trainer resumed(Job(resharded.string(), shape));
  ASSERT_EQ(resumed.resumed_from(), std::optional<int64_t>(4));
  const std::vector<double> after = Losses(resumed);
  ASSERT_EQ(after.size(), 8u);
  for (size_t i = 0; i < after.size(); ++i) EXPECT_EQ(after[i], want[4 + i]) << "step " << 5 + i;
}

// A rank resuming reads only the chunks that hold its own elements, and verifies them:
// written by one rank, the blocks' segments span two chunks each; shard 0 of 2 needs
// only the first of them, so a corrupt second chunk fails shard 1's read, naming the
// file and chunk, while shard 0 reads its elements exactly and never sees it.
TEST_F(CheckpointTest, ARankReadsAndVerifiesOnlyTheChunksOfItsOwnElements) {
  const api::ModelShape shape{.layers = 2, .heads = 2, .hidden = 192, .vocab_size = 256, .seq_len = 16};
  const WholeState whole = RandomState(shape, 4);
  const std::string step = WriteAsLayout((dir_ / "one-writer").string(), shape, api::ParallelLayout(1, 1, 1, 1),
                                         api::kVocabMultiple, whole, {5, 10});
  const model::ParameterLayout whole_layout(shape);
  const ShardFileLayout file = LayOutShardFile(model::ParameterLayout(shape, 0, 1, api::kVocabMultiple), 1, 0);
  ASSERT_EQ(file.units[1].chunks, 2) << "a block's segment spans two chunks";
  const int64_t file_bytes = 3 * file.elements * int64_t(sizeof(float));

  // Reads shard `shard` of 2 of every unit; returns the bytes read, or throws.
  auto read_shard = [&](int shard) {
    CheckpointReader reader(step, shape);
    const model::ParameterLayout slice(shape, 0, 1, api::kVocabMultiple);
    for (int u = 0; u < slice.units(); ++u) {
      const parallel::UnitShard s = parallel::ShardOfUnit(slice, u, 2, shard);
      const std::vector<int64_t> at = slice.WholeIndices(s.unit_begin + s.begin, s.unit_begin + s.begin + s.real);
      std::vector<float> master(at.size()), m(at.size()), v(at.size());
      reader.ReadUnit(u, at, master.data(), m.data(), v.data());
      for (size_t i = 0; i < at.size(); ++i) {
        const float want[3] = {at[i] < 0 ? 0 : whole.master[size_t(at[i])], at[i] < 0 ? 0 : whole.m[size_t(at[i])],
                               at[i] < 0 ? 0 : whole.v[size_t(at[i])]};
        if (master[i] != want[0] || m[i] != want[1] || v[i] != want[2]) {
          ADD_FAILURE() << "shard " << shard << ", unit " << u << ": element " << at[i] << " read wrong";
          break;
        }
      }
    }
    return reader.bytes_read();
  };
  const int64_t first = read_shard(0), second = read_shard(1);
  // Shard 0 reads the root unit's chunk and the first chunk of each block, of 3 sections.
  EXPECT_EQ(first, 3 * int64_t(sizeof(float)) * (file.units[0].elements + 2 * kChunkElements));
  EXPECT_EQ(second, file_bytes) << "shard 1's elements reach into every chunk";
  EXPECT_LT(first, file_bytes);

  // A flipped bit in the AdamW v section's second chunk of block 0.
  const fs::path data = fs::path(step) / "rank-00000.bin";
  {
    std::fstream io(data, std::ios::in | std::ios::out | std::ios::binary);
    const int64_t at = (2 * file.elements + file.units[1].offset + kChunkElements + 7) * int64_t(sizeof(float));
    io.seekg(at);
    char byte = 0;
    io.read(&byte, 1);
    byte ^= 0x04;
    io.seekp(at);
    io.write(&byte, 1);
  }
  EXPECT_EQ(read_shard(0), first) << "shard 0 never reads the damaged chunk";
  try {
    read_shard(1);
    ADD_FAILURE() << "a corrupt chunk was read without complaint";
  } catch (const CheckpointError& e) {
    EXPECT_EQ(std::string(e.what()), data.string() + ": checksum mismatch in chunk " +
                                         std::to_string(file.units[1].first_chunk + 1) +
                                         " of its AdamW v: the data is corrupt");
  }
  EXPECT_NE(ListCheckpoints((dir_ / "one-writer").string())[0].problem.find("checksum mismatch"), std::string::npos)
      << "verifying reads every chunk";
}

// When no checkpoint can be read, after one was partly restored (its damage lies in the
// last unit's chunk), the run starts from the initial state, exactly as a fresh one does.
TEST_F(CheckpointTest, WhenNoCheckpointCanBeReadTheRunStartsFromTheInitialState) {
  const std::string path = (dir_ / "all-damaged").string();
  {
    Trainer trainer(Job(path));
    Losses(trainer);  // checkpoints of steps 8 and 12
  }
  for (const char* step : {"step-00000008", "step-00000012"}) {
    const fs::path file = fs::path(path) / step / "rank-00000.bin";
    std::fstream io(file, std::ios::in | std::ios::out | std::ios::binary);
    io.seekg(-8, std::ios::end);  // AdamW v of the last block: read after every other unit
    char byte = 0;
    io.read(&byte, 1);
    byte ^= 0x20;
    io.seekp(-8, std::ios::end);
    io.write(&byte, 1);
  }
  Trainer resumed(Job(path));
  EXPECT_FALSE(resumed.resumed_from());
  ASSERT_EQ(resumed.checkpoint_warnings().size(), 2u);
  for (const std::string& warning : resumed.checkpoint_warnings())
    EXPECT_NE(warning.find("checksum mismatch in chunk"), std::string::npos) << warning;
  Trainer fresh(Job(""));
  EXPECT_EQ(resumed.Weights(), fresh.Weights());
  ShardState restored, initial;
  resumed.model().Snapshot(&restored);
  fresh.model().Snapshot(&initial);
  ASSERT_EQ(restored.size, initial.size);
  EXPECT_EQ(std::vector<float>(restored.m, restored.m + restored.size), std::vector<float>(restored.size, 0.0f));
  EXPECT_EQ(std::vector<float>(restored.v, restored.v + restored.size), std::vector<float>(restored.size, 0.0f));
  EXPECT_EQ(Losses(resumed), Losses(fresh));
}

// Damage of every kind is named, and resuming falls back to the newest intact checkpoint.
TEST_F(CheckpointTest, ADamagedCheckpointIsNamedAndTheNewestIntactOneIsUsed) {
  const std::string path = (dir_ / "ckpt").string();
  {
    api::TrainingJob job = Job(path);
    job.spec.checkpoint.keep = 3;
    Trainer trainer(job);
    Losses(trainer);  // checkpoints of steps 4, 8 and 12
  }
  const fs::path newest = fs::path(path) / "step-00000012", older = fs::path(path) / "step-00000008";
  auto error_of = [&](const fs::path& dir) -> std::string {
    try {
      LoadCheckpoint(dir.string(), kShape);
    } catch (const CheckpointError& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_EQ(error_of(newest), "");
  const fs::path file = newest / "rank-00000.bin";
  std::string bytes;
  {
    std::ifstream in(file, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  // A flipped bit.
  std::string flipped = bytes;
  flipped[flipped.size() / 2] ^= 0x10;
  std::ofstream(file, std::ios::binary | std::ios::trunc) << flipped;
  EXPECT_NE(error_of(newest).find(file.string() + ": checksum mismatch"), std::string::npos) << error_of(newest);
  // A truncated file.
  std::ofstream(file, std::ios::binary | std::ios::trunc) << bytes.substr(0, bytes.size() - 4);
  EXPECT_NE(error_of(newest).find(file.string() + ": truncated"), std::string::npos) << error_of(newest);
  // Another model's metadata.
  api::ModelShape other = kShape;
  other.hidden = 32;
  try {
    LoadCheckpoint(older.string(), other);
    ADD_FAILURE() << "a checkpoint of another model loaded";
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("a checkpoint of another model"), std::string::npos) << e.what();
  }
  // The resume skips the damaged newest with a warning naming it, and takes step 8.
  {
    Trainer resumed(Job(path));
    EXPECT_EQ(resumed.resumed_from(), std::optional<int64_t>(8));
    ASSERT_EQ(resumed.checkpoint_warnings().size(), 1u);
    EXPECT_NE(resumed.checkpoint_warnings()[0].find("step-00000012"), std::string::npos);
  }
  // Numbers that are not integers in range: a chunk size past 2^64 (which JSON parsing
  // makes a double) and a fractional step.
  {
    std::ifstream in(older / "metadata.json");
    const nlohmann::json meta = nlohmann::json::parse(std::string(std::istreambuf_iterator<char>(in), {}));
    auto parse_error = [&](const std::string& text) -> std::string {
      try {
        ParseCheckpointMetadata(text, "m.json", kShape);
      } catch (const CheckpointError& e) {
        return e.what();
      }
      return "";
    };
    EXPECT_EQ(parse_error(meta.dump()), "");
    std::string huge = meta.dump();
    const std::string chunk = "\"chunkElements\":";
    ASSERT_NE(huge.find(chunk), std::string::npos);
    huge.insert(huge.find(chunk) + chunk.size(), "876543222222222222222222222222");
    EXPECT_EQ(parse_error(huge), "m.json: malformed metadata: /files/0/chunkElements is not an integer in range");
    nlohmann::json fractional = meta;
    fractional["step"] = 8.5;
    EXPECT_EQ(parse_error(fractional.dump()), "m.json: malformed metadata: /step is not an integer in range");
  }
  // A missing file, and a directory in its place.
  fs::remove(older / "rank-00000.bin");
  EXPECT_NE(error_of(older).find("rank-00000.bin: missing or unreadable"), std::string::npos) << error_of(older);
  fs::create_directory(older / "rank-00000.bin");
  EXPECT_NE(error_of(older).find("rank-00000.bin: is not a regular file"), std::string::npos) << error_of(older);
  // Malformed metadata, and a directory in its place.
  std::ofstream(older / "metadata.json", std::ios::trunc) << "{\"format\": ";
  EXPECT_NE(error_of(older).find("metadata.json: not valid JSON"), std::string::npos) << error_of(older);
  fs::remove(older / "metadata.json");
  fs::create_directory(older / "metadata.json");
  EXPECT_NE(error_of(older).find("metadata.json: is not a regular file"), std::string::npos) << error_of(older);
}

// A checkpoint that cannot be written is an error naming the path; training goes on and
// the checkpoint before it stays the newest.
TEST_F(CheckpointTest, AFailedWriteLeavesThePreviousCheckpointAndTrainingGoesOn) {
  // A file where the partial directory must go (root writes through permissions).
  const std::string path = (dir_ / "ckpt").string();
  std::vector<double> losses;
  {
    Trainer trainer(Job(path));
    trainer.Run([&](const StepReport& r) {
      losses.push_back(r.loss);
      // Before the next checkpoint, block its directory with a file. The first one may
      // still be on its way (written in the background), so the parent may not exist yet.
      if (r.step == 6) {
        fs::create_directories(path);
        EXPECT_TRUE(std::ofstream(fs::path(path) / ".partial-step-00000008") << "in the way");
      }
    });
    EXPECT_EQ(losses.size(), 12u) << "training goes on";
    EXPECT_GE(trainer.checkpoint_stats().failures, 1);
  }
  EXPECT_FALSE(fs::exists(fs::path(path) / ".partial-step-00000008")) << "a failed write leaves nothing behind";
  const std::vector<CheckpointListing> listed = ListCheckpoints(path);
  ASSERT_FALSE(listed.empty());
  EXPECT_EQ(listed.back().step, 4);
  for (const CheckpointListing& c : listed) {
    EXPECT_NE(c.step, 8) << "the failed checkpoint must not appear";
    EXPECT_TRUE(c.problem.empty()) << c.directory << ": " << c.problem;
  }
}

// A full disk: a 1 MiB tmpfs cannot hold a checkpoint of this model's 3 x 4 x 8.5K
// floats plus the next. The error names the path and says the disk is full; training
// goes on.
TEST_F(CheckpointTest, AFullDiskIsAnErrorNamingThePathAndTrainingGoesOn) {
  const fs::path mount = dir_ / "small-disk";
  fs::create_directories(mount);
  if (::mount("tmpfs", mount.c_str(), "tmpfs", 0, "size=64k") != 0) {
    GTEST_SKIP() << "skipped: cannot mount a tmpfs here (" << std::strerror(errno) << "); needs root";
  }
  std::vector<double> losses;
  int64_t failures = 0;
  std::string final_error;
  {
    Trainer trainer(Job((mount / "ckpt").string()));
    try {
      trainer.Run([&](const StepReport& r) { losses.push_back(r.loss); });
    } catch (const CheckpointError& e) {
      final_error = e.what();
    }
    failures = trainer.checkpoint_stats().failures;
  }
  std::vector<std::string> left;
  std::error_code unlisted;
  for (const auto& entry : fs::directory_iterator(mount / "ckpt", unlisted)) left.push_back(entry.path().filename().string());
  std::string error;
  {
    CheckpointWriter writer((mount / "direct").string(), 1, kShape, api::ParallelLayout(1, 1, 1, 1),
                            api::kVocabMultiple, 0, nullptr, [&](const std::string& e) { error = e; });
    writer.Save({1, 0}, [](ShardState* into) {
      const std::vector<float> ones(size_t(kShape.ParameterCount()), 1.0f);  // 128 KiB in all
      FillSnapshot(into, ones, ones, ones);
    });
    writer.Wait();
  }
  ::umount(mount.c_str());
  EXPECT_NE(error.find((mount / "direct" / ".partial-step-00000001" / "rank-00000.bin").string()), std::string::npos)
      << error;
  EXPECT_NE(error.find("No space left on device"), std::string::npos) << error;
  EXPECT_EQ(losses.size(), 12u) << "training goes on";
  EXPECT_EQ(failures, 3) << "the checkpoints of steps 4, 8 and 12 do not fit in 64 KiB";
  EXPECT_NE(final_error.find("the final checkpoint, of step 12 under " + (mount / "ckpt").string() +
                             ", was not written: checkpoint of step 12 failed: "),
            std::string::npos)
      << final_error;
  EXPECT_NE(final_error.find("No space left on device"), std::string::npos) << final_error;
  EXPECT_EQ(left, std::vector<std::string>{}) << "failed writes leave no partial directories behind";
}

// A checkpoint path that is a regular file: every write fails, and the final one fails
// the run, naming the path.
TEST_F(CheckpointTest, AFinalCheckpointThatCannotBeWrittenFailsTheRun) {
  const fs::path file = dir_ / "a-file";
  std::ofstream(file) << "not a directory";
  Trainer trainer(Job(file.string()));
  int64_t steps = 0;
  try {
    trainer.Run([&](const StepReport&) { ++steps; });
    ADD_FAILURE() << "the run succeeded without its final checkpoint";
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("the final checkpoint, of step 12 under " + file.string() +
                                         ", was not written: checkpoint of step 12 failed: cannot create " +
                                         (file / ".partial-step-00000012").string()),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(steps, 12) << "the earlier failures are warnings";
  EXPECT_EQ(trainer.checkpoint_stats().failures, 3);
}

// A step whose loss is not finite ends the run there, and no checkpoint of the diverged
// model replaces the good ones.
TEST_F(CheckpointTest, ADivergedRunStopsWithoutACheckpointOfIt) {
  const std::string path = (dir_ / "ckpt").string();
  {
    Trainer trainer(Job(path));
    Losses(trainer);  // checkpoints of steps 8 and 12
  }
  const fs::path newest = fs::path(path) / "step-00000012" / "rank-00000.bin";
  const std::string weights = ReadCheckpointFile(newest);
  api::TrainingJob job = Job(path);
  job.spec.checkpoint.resume = false;
  job.spec.training.learning_rate = 1e30;
  Trainer diverging(job);
  std::vector<double> losses;
  try {
    diverging.Run([&](const StepReport& r) { losses.push_back(r.loss); });
    ADD_FAILURE() << "a run with a loss of nan went on";
  } catch (const TrainingDiverged& e) {
    const std::string want = "step " + std::to_string(losses.size() + 1) + ": the loss is ";
    EXPECT_EQ(std::string(e.what()).find(want), 0u) << e.what();
    EXPECT_NE(std::string(e.what()).find("training diverged"), std::string::npos) << e.what();
  }
  EXPECT_LT(losses.size(), 4u) << "it diverges before its first checkpoint";
  const std::vector<CheckpointListing> listed = ListCheckpoints(path);
  ASSERT_EQ(listed.size(), 2u);
  EXPECT_EQ(listed[0].step, 12);
  EXPECT_EQ(listed[1].step, 8);
  for (const CheckpointListing& c : listed) EXPECT_EQ(c.problem, "") << c.directory;
  EXPECT_EQ(ReadCheckpointFile(newest), weights);
}

// The names in a directory, and what `latest` says.
std::vector<std::string> Contents(const fs::path& path) {
  std::vector<std::string> names;
  for (const auto& entry : fs::recursive_directory_iterator(path)) names.push_back(entry.path().string());
  std::sort(names.begin(), names.end());
  std::ifstream latest(path / "latest");
  names.push_back("latest: " + std::string(std::istreambuf_iterator<char>(latest), {}));
  return names;
}

// Resuming where the newest whole checkpoint is another model's is a configuration error
// naming the checkpoint and both models, and touches nothing; a damaged one of another
// model is skipped as any damaged one is.
TEST_F(CheckpointTest, AnotherModelsCheckpointIsAConfigurationErrorAndStaysAsItWas) {
  const std::string path = (dir_ / "ckpt").string();
  api::ModelShape other = kShape;
  other.layers = 3;
  {
    Trainer trainer(Job(path, other));
    Losses(trainer);  // checkpoints of steps 8 and 12
  }
  const std::vector<std::string> before = Contents(path);
  try {
    Trainer trainer(Job(path));
    ADD_FAILURE() << "a run resumed into another model's checkpoints";
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()),
              "spec.checkpoint.path: " + path + "/step-00000012 is a checkpoint of another model (gpt2: layers 3, heads 2, "
              "hidden 16, vocabSize 256, seqLen 16) than spec.model (gpt2: layers 2, heads 2, hidden 16, vocabSize "
              "256, seqLen 16); give this job a checkpoint directory of its own");
  }
  EXPECT_EQ(Contents(path), before);

  // This model's checkpoint is the newest whole one (the other model's newest lost a
  // file): the run resumes from it.
  {
    api::TrainingJob job = Job((dir_ / "mine").string());
    job.spec.training.steps = 4;
    Trainer trainer(job);
    Losses(trainer);
  }
  fs::rename(dir_ / "mine" / "step-00000004", fs::path(path) / "step-00000010");
  fs::remove(fs::path(path) / "step-00000012" / "rank-00000.bin");
  Trainer resumed(Job(path));
  EXPECT_EQ(resumed.resumed_from(), std::optional<int64_t>(4));
  ASSERT_EQ(resumed.checkpoint_warnings().size(), 1u);
  EXPECT_NE(resumed.checkpoint_warnings()[0].find("step-00000012"), std::string::npos);
  // Its checkpoint of step 8 would replace the other model's whole one: it fails instead.
  // That of step 12 replaces the damaged one.
  EXPECT_EQ(Losses(resumed).size(), 8u);
  EXPECT_EQ(resumed.checkpoint_stats().failures, 1);
  EXPECT_EQ(CheckpointModel(path + "/step-00000008"), other);
  EXPECT_EQ(CheckpointModel(path + "/step-00000012"), kShape);
}

// Pruning keeps the newest `keep` of this model's checkpoints, counting and deleting no
// stray name, damaged or other model's checkpoint, nor one newer than the one written.
TEST_F(CheckpointTest, PruningDeletesOnlyThisModelsOlderCheckpoints) {
  const fs::path path = dir_ / "ckpt";
  api::ModelShape other = kShape;
  other.layers = 3;
  {
    api::TrainingJob job = Job((dir_ / "other").string(), other);
    job.spec.training.steps = 4;
    Trainer trainer(job);
    Losses(trainer);
  }
  {
    Trainer first(Job(path.string()));
    Losses(first, 5);  // a checkpoint of step 4
  }
  fs::rename(dir_ / "other" / "step-00000004", path / "step-00000001");
  for (const char* stray : {"step-abc", "step-00000009", "step-5"}) fs::create_directories(path / stray);
  {
    Trainer resumed(Job(path.string()));
    ASSERT_EQ(resumed.resumed_from(), std::optional<int64_t>(4));
    Losses(resumed);  // checkpoints of steps 8 and 12
  }
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(path)) names.push_back(entry.path().filename().string());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"latest", "step-00000001", "step-00000008", "step-00000009",
                                             "step-00000012", "step-5", "step-abc"}));
  EXPECT_EQ(ListCheckpoints(path.string()).front().step, 12);
  EXPECT_EQ(CheckpointModel((path / "step-00000001").string()), other);
}

// spec.checkpoint.resume false passes over what other runs left under the path, but a
// restart of the run (the same metadata.uid) resumes its own checkpoints.
TEST_F(CheckpointTest, WithoutResumeARestartTakesOnlyItsOwnRunsCheckpoints) {
  const fs::path path = dir_ / "ckpt";
  {
    api::TrainingJob other = Job(path.string());
    other.metadata.uid = "run-b";
    Trainer trainer(other);
    Losses(trainer, 9);  // checkpoints of steps 4 and 8
  }
  api::TrainingJob job = Job(path.string());
  job.metadata.uid = "run-a";
  job.spec.checkpoint.resume = false;
  job.spec.checkpoint.interval = 3;
  {
    Trainer first(job);
    EXPECT_FALSE(first.resumed_from());
    Losses(first, 2);  // stopped before its first checkpoint
  }
  {
    Trainer restarted(job);
    EXPECT_FALSE(restarted.resumed_from());  // `latest` is the other run's step 8
    Losses(restarted, 5);  // a checkpoint of step 3
  }
  EXPECT_EQ(CheckpointRun((path / "step-00000003").string()), std::optional<std::string>("run-a"));
  EXPECT_EQ(CheckpointRun((path / "step-00000008").string()), std::optional<std::string>("run-b"));
  {
    std::ofstream latest(path / "latest", std::ios::trunc);
    latest << "step-00000008";
  }
  Trainer restarted(job);
  EXPECT_EQ(restarted.resumed_from(), std::optional<int64_t>(3));
  api::TrainingJob anonymous = job;
  anonymous.metadata.uid.clear();
  EXPECT_FALSE(Trainer(anonymous).resumed_from());
  api::TrainingJob resuming = job;
  resuming.spec.checkpoint.resume = true;
  EXPECT_EQ(Trainer(resuming).resumed_from(), std::optional<int64_t>(8));
}

// Metadata whose step or data position no run writes makes the checkpoint damaged; one
// at or past the job's last step resumes and says the job is complete.
TEST_F(CheckpointTest, AStepOrDataPositionOutOfRangeIsDamageAndAFinishedJobSaysSo) {
  const fs::path path = dir_ / "ckpt";
  {
    Trainer trainer(Job(path.string()));
    Losses(trainer);  // checkpoints of steps 8 and 12
  }
  const fs::path file = path / "step-00000012" / "metadata.json";
  nlohmann::json meta;
  {
    std::ifstream in(file);
    meta = nlohmann::json::parse(in);
  }
  auto parse_error = [&](const nlohmann::json& changed) -> std::string {
    try {
      ParseCheckpointMetadata(changed.dump(), "m.json", kShape);
    } catch (const CheckpointError& e) {
      return e.what();
    }
    return "";
  };
  for (int64_t step : {-3, 0}) {
    nlohmann::json changed = meta;
    changed["step"] = step;
    EXPECT_EQ(parse_error(changed),
              "m.json: step " + std::to_string(step) + " is not a step a checkpoint is written at (1 or later)");
  }
  nlohmann::json changed = meta;
  changed["dataPosition"] = -1;
  EXPECT_EQ(parse_error(changed), "m.json: dataPosition -1 is not a position in the data (0 or more)");
  changed = meta;
  changed.erase("dataOrder");  // dataPosition would count in an order no reader knows
  EXPECT_EQ(parse_error(changed), "m.json: dataOrder null is not \"windows\", the order dataPosition counts in");

  changed = meta;
  changed["step"] = -3;
  std::ofstream(file, std::ios::trunc) << changed.dump();
  {
    Trainer resumed(Job(path.string()));
    EXPECT_EQ(resumed.resumed_from(), std::optional<int64_t>(8));
    ASSERT_EQ(resumed.checkpoint_warnings().size(), 1u);
    EXPECT_NE(resumed.checkpoint_warnings()[0].find("step -3 is not a step"), std::string::npos)
        << resumed.checkpoint_warnings()[0];
  }
  changed["step"] = 99;
  std::ofstream(file, std::ios::trunc) << changed.dump();
  Trainer resumed(Job(path.string()));
  EXPECT_EQ(resumed.resumed_from(), std::optional<int64_t>(99));
  std::ostringstream out;
  RunReport report(out, resumed, runtime::Device::Cpu());
  report.Started();
  EXPECT_NE(out.str().find("the job is already complete at step 99 (spec.training.steps is 12): nothing to train"),
            std::string::npos)
      << out.str();
  EXPECT_EQ(Losses(resumed).size(), 0u);
}

}  // namespace
}  // namespace meshtrain::train
