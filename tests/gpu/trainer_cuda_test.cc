// The Trainer on a GPU (bf16 compute, fp32 master weights, through the CUDA plugin)
// against the fp32 CPU Trainer on the same job: the same first loss and first step
// within mixed-precision error, and training on the bundled corpus that learns.

#include <unistd.h>

#include <cmath>
#include <filesystem>

#include <gtest/gtest.h>

#include "api/manifest.h"
#include "tests/support/gpu.h"
#include "worker/train/token_file.h"
#include "worker/train/trainer.h"

namespace meshtrain::train {
namespace {

using ::meshtrain::testing::RelativeError;

namespace fs = std::filesystem;

class TrainerCudaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    MESHTRAIN_SKIP_WITHOUT_GPU();
    dir_ = fs::temp_directory_path() / ("meshtrain-trainer-cuda-" + std::to_string(::getpid()));
    fs::create_directories(dir_);
    WriteTextAsTokenFiles("examples/data/pride-and-prejudice.txt", (dir_ / "train.bin").string(),
                          (dir_ / "val.bin").string(), 0.1);
  }
  void TearDown() override {
    if (!dir_.empty()) fs::remove_all(dir_);
  }

  api::TrainingJob Job(int64_t steps, const std::string& precision) {
    nlohmann::json manifest = api::ReadManifestFile("examples/gpt2-tiny-local.yaml").at(0).object;
    manifest["spec"]["data"] = {{"train", (dir_ / "train.bin").string()}, {"validation", (dir_ / "val.bin").string()}};
    auto& training = manifest["spec"]["training"];
    training["steps"] = steps;
    training["precision"] = precision;
    training.erase("warmupSteps");  // the example's 20 would not fit 5 steps: the derived one does
    training["evalBatches"] = 4;
    const api::CheckedJob checked = api::CheckTrainingJob(manifest, "test", 0);
    EXPECT_TRUE(checked.ok()) << checked.errors.front().ToString();
    return checked.job;
  }

  fs::path dir_;
};

TEST_F(TrainerCudaTest, FirstStepMatchesTheCpuTrainer) {
  Trainer cpu(Job(5, "fp32"));
  Trainer gpu(Job(5, "bf16"), nullptr, runtime::Device::Cuda(0));
  EXPECT_EQ(gpu.device(), runtime::Device::Cuda(0));
  EXPECT_EQ(gpu.Weights(), cpu.Weights());  // the same initialisation, bit for bit
  const StepReport want = cpu.Step(), got = gpu.Step();
  EXPECT_NEAR(got.loss, want.loss, 0.02 * want.loss);
  EXPECT_NEAR(got.grad_norm, want.grad_norm, 0.05 * want.grad_norm);
  EXPECT_EQ(got.learning_rate, want.learning_rate);
  EXPECT_LT(RelativeError(gpu.Weights(), cpu.Weights()), 0.01);
  EXPECT_GT(gpu.memory().params, 0);
  EXPECT_GT(gpu.memory().activations, 0);
}

TEST_F(TrainerCudaTest, TrainingOnTheCorpusLearnsAndSamples) {
  Trainer gpu(Job(150, "bf16"), nullptr, runtime::Device::Cuda(0));
  const double untrained = gpu.Evaluate();
  EXPECT_NEAR(untrained, std::log(256.0), 0.1);
  double validation = 0;
  gpu.Run([&](const StepReport& r) {
    EXPECT_TRUE(std::isfinite(r.loss)) << "step " << r.step;
    if (r.validation_loss) validation = *r.validation_loss;
  });
  EXPECT_LT(validation, 2.6);  // the bound the CPU TrainingTest holds: below what no context allows
  const std::vector<uint32_t> sample = gpu.Sample({'\n'}, 100, 1);
  ASSERT_EQ(sample.size(), 100u);
  size_t letters = 0;
  for (uint32_t c : sample) letters += std::isalpha(int(c)) || c == ' ';
  EXPECT_GT(letters, 70u) << TokensToText(sample);
}

}  // namespace
}  // namespace meshtrain::train
