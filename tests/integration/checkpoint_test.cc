// Checkpoints on one machine: a run stopped at any step and resumed gives the losses of
// the run that never stopped, bit for bit; the files of any layout load back exactly;
// a damaged checkpoint is named and skipped; a write that fails leaves the last one intact.

#include "worker/train/checkpoint.h"

#include <sys/mount.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include <gtest/gtest.h>

#include "api/manifest.h"
#include "worker/model/parameters.h"
#include "worker/parallel/flat_unit.h"
#include "worker/train/token_file.h"
#include "worker/train/trainer.h"

namespace meshtrain::train {
namespace {

namespace fs = std::filesystem;

const api::ModelShape kShape{.layers = 2, .heads = 2, .hidden = 16, .vocab_size = 256, .seq_len = 16};

class CheckpointTest : public testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("meshtrain-checkpoint-" + std::to_string(::getpid()));
    fs::create_directories(dir_);
    WriteTextAsTokenFiles("examples/data/pride-and-prejudice.txt", (dir_ / "train.bin").string(),
                          (dir_ / "val.bin").string(), 0.1);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // 12 steps of a small model; checkpoints every 4 steps under `path` (none if empty).
  api::TrainingJob Job(const std::string& path) {
    nlohmann::json manifest = {
        {"apiVersion", "meshtrain.dev/v1alpha1"},
        {"kind", "TrainingJob"},
        {"metadata", {{"name", "checkpoint-test"}}},
        {"spec",
         {{"image", "meshtrain:test"},
          {"model", {{"layers", 2}, {"heads", 2}, {"hidden", 16}, {"vocabSize", 256}, {"seqLen", 16}, {"dropout", 0.1}}},
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
// themselves (one per rank, concurrently, rank 0 finishing): loading gives it back exactly.
TEST_F(CheckpointTest, EveryLayoutsFilesLoadBackTheWholeStateExactly) {
  const api::ModelShape shape{.layers = 2, .heads = 4, .hidden = 16, .vocab_size = 250, .seq_len = 16};
  const model::ParameterLayout whole_layout(shape);
  WholeState whole;
  std::mt19937 rng(1);
  std::normal_distribution<float> dist;
  for (auto* part : {&whole.master, &whole.m, &whole.v}) {
    part->resize(size_t(whole_layout.total()));
    for (float& x : *part) x = dist(rng);
  }
  struct Sizes {
    int nodes, gpus, tp, shard;
  };
  for (const Sizes& s : {Sizes{1, 1, 1, 1}, Sizes{1, 3, 1, 3}, Sizes{1, 4, 2, 2}, Sizes{2, 4, 2, 2}, Sizes{1, 8, 4, 2}}) {
    const api::ParallelLayout layout(s.nodes, s.gpus, s.tp, s.shard);
    const std::string path = (dir_ / ("layout-" + std::to_string(layout.world()) + "-" + std::to_string(s.tp))).string();
    std::vector<std::unique_ptr<CheckpointWriter>> writers;
    for (int rank = 0; rank < layout.world(); ++rank) {
      writers.push_back(std::make_unique<CheckpointWriter>(path, 1, shape, layout, rank, [](const std::string& e) {
        ADD_FAILURE() << e;
      }));
    }
    for (int rank = layout.world() - 1; rank >= 0; --rank) {
      const api::LayoutCoord at = layout.CoordOf(rank);
      const model::ParameterLayout slice(shape, at.tp, layout.tp());
      ShardState state{at.tp, at.shard, at.replica, {}, {}, {}};
      for (int u = 0; u < slice.units(); ++u) {
        const parallel::UnitShard shard = parallel::ShardOfUnit(slice, u, layout.shard(), at.shard);
        for (int64_t i : slice.WholeIndices(shard.unit_begin + shard.begin, shard.unit_begin + shard.begin + shard.real)) {
          state.master.push_back(whole.master[size_t(i)]);
          state.m.push_back(whole.m[size_t(i)]);
          state.v.push_back(whole.v[size_t(i)]);
        }
      }
      writers[size_t(rank)]->Save({7, 99}, [&](ShardState* into) { *into = std::move(state); });
    }
    for (auto& w : writers) w->Wait();
    EXPECT_EQ(writers[0]->stats().written, 1);
    const LoadedCheckpoint loaded = LoadCheckpoint((fs::path(path) / "step-00000007").string(), shape);
    EXPECT_EQ(loaded.position.step, 7);
    EXPECT_EQ(loaded.position.data_position, 99u);
    EXPECT_EQ(loaded.state.master, whole.master) << layout.world() << " ranks, tp " << s.tp;
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
  // A missing file.
  fs::remove(older / "rank-00000.bin");
  EXPECT_NE(error_of(older).find("rank-00000.bin: missing or unreadable"), std::string::npos) << error_of(older);
  // Malformed metadata.
  std::ofstream(older / "metadata.json", std::ios::trunc) << "{\"format\": ";
  EXPECT_NE(error_of(older).find("metadata.json: not valid JSON"), std::string::npos) << error_of(older);
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
      // After the first checkpoint lands, block the next one's directory with a file.
      if (r.step == 6) std::ofstream(fs::path(path) / ".partial-step-00000008") << "in the way";
    });
    EXPECT_EQ(losses.size(), 12u) << "training goes on";
    EXPECT_GE(trainer.checkpoint_stats().failures, 1);
  }
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
  {
    Trainer trainer(Job((mount / "ckpt").string()));
    trainer.Run([&](const StepReport& r) { losses.push_back(r.loss); });
    failures = trainer.checkpoint_stats().failures;
  }
  std::string error;
  {
    CheckpointWriter writer((mount / "direct").string(), 1, kShape, api::ParallelLayout(1, 1, 1, 1), 0,
                            [&](const std::string& e) { error = e; });
    writer.Save({1, 0}, [](ShardState* into) {
      for (auto* part : {&into->master, &into->m, &into->v}) part->assign(20000, 1.0f);
    });
    writer.Wait();
  }
  ::umount(mount.c_str());
  EXPECT_NE(error.find((mount / "direct" / ".partial-step-00000001" / "rank-00000.bin").string()), std::string::npos)
      << error;
  EXPECT_NE(error.find("No space left on device"), std::string::npos) << error;
  EXPECT_EQ(losses.size(), 12u) << "training goes on";
  EXPECT_EQ(failures, 3) << "the checkpoints of steps 4, 8 and 12 do not fit in 64 KiB";
}

}  // namespace
}  // namespace meshtrain::train
