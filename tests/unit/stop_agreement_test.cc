// The ranks' side of a suspension (trainer.h, RunEnd): told to stop, the ranks agree after
// a step to stop after it, checkpoint that step (once), and the run resumed from it gives
// the losses of the run that never stopped, with no step trained twice.

#include <atomic>
#include <filesystem>
#include <mutex>

#include <gtest/gtest.h>
#include <unistd.h>

#include "api/manifest.h"
#include "tests/support/fabric_ranks.h"
#include "worker/train/checkpoint.h"
#include "worker/train/token_file.h"
#include "worker/train/trainer.h"

namespace meshtrain::train {
namespace {

namespace fs = std::filesystem;

class StopAgreementTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("meshtrain-stop-" + std::to_string(::getpid()));
    fs::create_directories(dir_);
    WriteTextAsTokenFiles("examples/data/pride-and-prejudice.txt", (dir_ / "train.bin").string(),
                          (dir_ / "val.bin").string(), 0.1);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // 12 steps of a small model; checkpoints every 4 steps under `path` (none if empty).
  api::TrainingJob Job(const std::string& path, int nodes = 1) {
    nlohmann::json manifest = {
        {"apiVersion", "meshtrain.dev/v1alpha1"},
        {"kind", "TrainingJob"},
        {"metadata", {{"name", "stop-test"}}},
        {"spec",
         {{"image", "meshtrain:test"},
          {"nodes", nodes},
          {"model", {{"layers", 2}, {"heads", 2}, {"hidden", 16}, {"vocabSize", 256}, {"seqLen", 16}}},
          {"data", {{"train", (dir_ / "train.bin").string()}}},
          {"training",
           {{"steps", 12}, {"microBatchSize", 2}, {"globalBatchTokens", 64}, {"learningRate", 1e-2},
            {"warmupSteps", 2}, {"seed", 3}, {"precision", "fp32"}, {"evalInterval", 0}}}}}};
    if (!path.empty()) manifest["spec"]["checkpoint"] = {{"path", path}, {"interval", 4}, {"keep", 5}};
    const api::CheckedJob checked = api::CheckTrainingJob(manifest, "test", 0);
    EXPECT_TRUE(checked.ok()) << checked.errors.front().ToString();
    return checked.job;
  }

  fs::path dir_;
};

std::vector<int64_t> Steps(const std::string& path) {
  std::vector<int64_t> steps;
  for (const auto& c : ListCheckpoints(path)) steps.push_back(c.step);
  return steps;
}

TEST(RanksThatAsked, EveryRankLearnsWhichRanksAsked) {
  std::mutex mu;
  std::vector<std::vector<int>> none(3), some(3);
  testing::RunFabricRanks(3, 1, comm::FabricOptions{}, [&](comm::Communicator& world) {
    const std::vector<int> a = RanksThatAsked(&world, false);
    const std::vector<int> b = RanksThatAsked(&world, world.rank() == 1);
    std::lock_guard lock(mu);
    none[size_t(world.rank())] = a;
    some[size_t(world.rank())] = b;
  });
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(none[size_t(r)], std::vector<int>{}) << "rank " << r;
    EXPECT_EQ(some[size_t(r)], std::vector<int>{1}) << "rank " << r;
  }
  EXPECT_EQ(RanksThatAsked(nullptr, true), std::vector<int>{0});
  EXPECT_EQ(RanksThatAsked(nullptr, false), std::vector<int>{});
}

TEST_F(StopAgreementTest, AStoppedRunCheckpointsItsStepAndResumesWithTheUninterruptedLosses) {
  std::vector<double> want;
  {
    Trainer straight(Job(""));
    const RunEnd end = straight.Run([&](const StepReport& r) { want.push_back(r.loss); }, [] { return false; });
    EXPECT_FALSE(end.stopped);
    EXPECT_EQ(end.step, 12);
  }
  ASSERT_EQ(want.size(), 12u);

  const std::string path = (dir_ / "ckpt").string();
  std::vector<double> losses;
  {
    Trainer first(Job(path));
    int64_t trained = 0;
    // Told to stop while step 6 trains (between two checkpoints of the interval).
    const RunEnd end = first.Run([&](const StepReport& r) { losses.push_back(r.loss), trained = r.step; },
                                 [&] { return trained >= 6; });
    EXPECT_TRUE(end.stopped);
    EXPECT_EQ(end.step, 6);
    EXPECT_EQ(end.asked, std::vector<int>{0});
    EXPECT_TRUE(end.wrote);
    EXPECT_TRUE(end.checkpointed);
  }
  EXPECT_EQ(Steps(path), (std::vector<int64_t>{6, 4}));
  {
    // Resumed and told to stop at once: the step it resumed from has its checkpoint.
    Trainer idle(Job(path));
    ASSERT_EQ(idle.resumed_from(), std::optional<int64_t>(6));
    int steps = 0;
    const RunEnd end = idle.Run([&](const StepReport&) { ++steps; }, [] { return true; });
    EXPECT_TRUE(end.stopped);
    EXPECT_EQ(end.step, 6);
    EXPECT_FALSE(end.wrote);
    EXPECT_TRUE(end.checkpointed);
    EXPECT_EQ(steps, 0) << "no step is trained after a stop";
  }
  EXPECT_EQ(Steps(path), (std::vector<int64_t>{6, 4}));
  {
    Trainer resumed(Job(path));
    ASSERT_EQ(resumed.resumed_from(), std::optional<int64_t>(6));
    std::vector<int64_t> steps;
    resumed.Run([&](const StepReport& r) { losses.push_back(r.loss), steps.push_back(r.step); }, [] { return false; });
    EXPECT_EQ(steps.front(), 7) << "no step is trained twice";
  }
  ASSERT_EQ(losses.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(losses[i], want[i]) << "step " << i + 1;

  // A fresh run told to stop before its first step has nothing to save.
  const std::string fresh = (dir_ / "fresh").string();
  Trainer never(Job(fresh));
  const RunEnd end = never.Run([](const StepReport&) {}, [] { return true; });
  EXPECT_TRUE(end.stopped);
  EXPECT_EQ(end.step, 0);
  EXPECT_FALSE(end.wrote);
  EXPECT_FALSE(end.checkpointed);
  EXPECT_TRUE(Steps(fresh).empty());
}

// Only rank 1 is told to stop; both ranks stop after the same step.
TEST_F(StopAgreementTest, EveryRankStopsAfterTheStepWhereAnyWasTold) {
  std::mutex mu;
  std::vector<RunEnd> ends(2);
  std::vector<int64_t> last(2, 0);
  testing::RunFabricRanks(2, 2, comm::FabricOptions{}, [&](comm::Communicator& world) {
    Trainer trainer(Job("", 2), &world);
    int64_t trained = 0;
    const bool told = world.rank() == 1;
    const RunEnd end = trainer.Run([&](const StepReport& r) { trained = r.step; },
                                   [&] { return told && trained >= 3; });
    std::lock_guard lock(mu);
    ends[size_t(world.rank())] = end;
    last[size_t(world.rank())] = trained;
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(ends[size_t(r)].stopped) << "rank " << r;
    EXPECT_EQ(ends[size_t(r)].step, 3) << "rank " << r;
    EXPECT_EQ(last[size_t(r)], 3) << "rank " << r;
    EXPECT_EQ(ends[size_t(r)].asked, std::vector<int>{1}) << "rank " << r;
    EXPECT_FALSE(ends[size_t(r)].checkpointed) << "no checkpoint path";
  }
}

}  // namespace
}  // namespace meshtrain::train
