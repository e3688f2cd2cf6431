// The one engine on a GPU (label gpu; "skipped: no GPU" elsewhere):
//   - one rank in bf16 on CUDA against the CPU in fp32, 20 steps of GPT-2 tiny and of
//     llama-tiny: the loss curves agree within bf16's tolerance, and both learn;
//   - a checkpoint written on the GPU resumes on the CPU, and the reverse: the weights
//     after loading are the checkpoint's, bit for bit;
//   - 2 and 4 ranks sharing the GPU (collectives staged through pinned host memory, as
//     NCCL refuses two ranks on one GPU): S=2, T=2 x S=2 with offload at horizon 1, and
//     R2 x S2, through `meshtrain run`, against the one-rank GPU curve.

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "api/manifest.h"
#include "tests/support/gpu.h"
#include "worker/train/checkpoint.h"
#include "worker/train/token_file.h"
#include "worker/train/trainer.h"

namespace meshtrain::train {
namespace {

namespace fs = std::filesystem;

// bf16 stores 8 significant bits (relative 2^-9 per value); over 20 steps of this model
// the curves drift apart by up to about 1e-2, while a wrong gradient or layout moves them
// by 1e-1 or stops the learning.
constexpr double kBf16Tolerance = 3e-2;

class EngineOnCuda : public ::testing::Test {
 protected:
  void SetUp() override {
    MESHTRAIN_SKIP_WITHOUT_GPU();
    dir_ = fs::temp_directory_path() / ("meshtrain-engine-cuda-" + std::to_string(::getpid()));
    fs::create_directories(dir_);
    WriteTextAsTokenFiles("examples/data/pride-and-prejudice.txt", (dir_ / "train.bin").string(),
                          (dir_ / "val.bin").string(), 0.1);
  }
  void TearDown() override {
    if (!dir_.empty()) fs::remove_all(dir_);
  }

  // GPT-2 tiny on `gpus` ranks of one node, in `precision`.
  nlohmann::json Manifest(int64_t steps, const std::string& precision, int gpus = 1, int tp = 1, int shard = 1,
                          int offload = 0, const std::string& preset = "gpt2-tiny") {
    nlohmann::json parallelism = {{"tensorParallelDegree", tp}, {"hybridShardDegree", shard}};
    if (offload > 0) parallelism.update({{"activationOffloading", true}, {"activationLoadingHorizon", offload}});
    return {{"apiVersion", "meshtrain.dev/v1alpha1"},
            {"kind", "TrainingJob"},
            {"metadata", {{"name", "engine-cuda"}}},
            {"spec",
             {{"image", "meshtrain"},
              {"nodes", 1},
              {"gpusPerNode", gpus},
              {"model", {{"preset", preset}}},
              {"parallelism", parallelism},
              {"data", {{"train", (dir_ / "train.bin").string()}, {"validation", (dir_ / "val.bin").string()}}},
              {"training",
               {{"steps", steps}, {"globalBatchTokens", 4096}, {"microBatchSize", 8}, {"learningRate", 1e-3},
                {"warmupSteps", 5}, {"gradClip", 1.0}, {"seed", 1337}, {"precision", precision},
                {"evalInterval", 0}}}}}};
  }
  static api::TrainingJob Job(const nlohmann::json& manifest) {
    const api::CheckedJob checked = api::CheckTrainingJob(manifest, "test", 0);
    EXPECT_TRUE(checked.ok()) << checked.errors.front().ToString();
    return checked.job;
  }
  static std::vector<double> Losses(Trainer& trainer) {
    std::vector<double> losses;
    trainer.Run([&](const StepReport& r) { losses.push_back(r.loss); });
    return losses;
  }
  // The worst relative difference of two curves; and, over a whole run, that the second learns.
  static void ExpectClose(const std::vector<double>& want, const std::vector<double>& got, const std::string& what,
                          bool whole_run = true) {
    ASSERT_EQ(got.size(), want.size()) << what;
    double worst = 0;
    for (size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::abs(got[i] - want[i]) / std::abs(want[i]));
    std::printf("%s: loss %.4f -> %.4f against %.4f -> %.4f, worst relative difference %.2e\n", what.c_str(),
                got.front(), got.back(), want.front(), want.back(), worst);
    EXPECT_LE(worst, kBf16Tolerance) << what;
    if (whole_run) {
      EXPECT_LT(got.back(), got.front() - 0.5) << what << ": the model does not learn";
    }
  }

  fs::path dir_;
};

TEST_F(EngineOnCuda, OneRankInBf16FollowsTheCpuInFp32) {
  Trainer cpu(Job(Manifest(20, "fp32")), nullptr, runtime::Device::Cpu());
  Trainer gpu(Job(Manifest(20, "bf16")), nullptr, runtime::Device::Cuda(0));
  EXPECT_TRUE(gpu.device().is_cuda());
  EXPECT_NE(gpu.Describe().find("bf16 FSDP"), std::string::npos) << gpu.Describe();
  ExpectClose(Losses(cpu), Losses(gpu), "one rank, cuda bf16 against cpu fp32");
  const std::vector<float> probs = gpu.model().NextTokenProbabilities(std::vector<int32_t>{72, 101, 108}.data(), 3);
  ASSERT_EQ(probs.size(), 256u);  // the user's vocabulary, not the padded one
  double total = 0;
  for (float p : probs) total += p;
  EXPECT_NEAR(total, 1.0, 1e-3);
}

// The Llama class on the CUDA table (RMSNorm, RoPE, SwiGLU, cuDNN's grouped-query
// attention), S = T = 1, against the CPU: llama-tiny, its untied head a unit of its own.
TEST_F(EngineOnCuda, LlamaOnOneRankInBf16FollowsTheCpuInFp32) {
  Trainer cpu(Job(Manifest(20, "fp32", 1, 1, 1, 0, "llama-tiny")), nullptr, runtime::Device::Cpu());
  Trainer gpu(Job(Manifest(20, "bf16", 1, 1, 1, 0, "llama-tiny")), nullptr, runtime::Device::Cuda(0));
  EXPECT_TRUE(gpu.device().is_cuda());
  ExpectClose(Losses(cpu), Losses(gpu), "llama-tiny on one rank, cuda bf16 against cpu fp32");
  const std::vector<float> probs = gpu.model().NextTokenProbabilities(std::vector<int32_t>{72, 101, 108}.data(), 3);
  ASSERT_EQ(probs.size(), 256u);
  double total = 0;
  for (float p : probs) total += p;
  EXPECT_NEAR(total, 1.0, 1e-3);
}

TEST_F(EngineOnCuda, ACheckpointWrittenOnTheGpuResumesOnTheCpuAndTheReverse) {
  for (const bool gpu_first : {true, false}) {
    const fs::path checkpoints = dir_ / (gpu_first ? "from-gpu" : "from-cpu");
    auto with_checkpoints = [&](int64_t steps, const std::string& precision) {
      nlohmann::json manifest = Manifest(steps, precision);
      manifest["spec"]["checkpoint"] = {{"path", checkpoints.string()}, {"interval", 5}, {"keep", 2}};
      return Job(manifest);
    };
    const runtime::Device first = gpu_first ? runtime::Device::Cuda(0) : runtime::Device::Cpu();
    const runtime::Device second = gpu_first ? runtime::Device::Cpu() : runtime::Device::Cuda(0);
    {  // the 15-step job, stopped after its checkpoint at step 10 (as a failure would stop it)
      struct Stop {};
      Trainer writer(with_checkpoints(15, gpu_first ? "bf16" : "fp32"), nullptr, first);
      try {
        writer.Run([](const StepReport& r) {
          if (r.step == 10) throw Stop{};
        });
      } catch (const Stop&) {
      }
    }  // the writer's destructor waits for the checkpoint's files
    const std::vector<std::string> candidates = ResumeCandidates(checkpoints.string());
    ASSERT_FALSE(candidates.empty());
    const std::optional<LoadedCheckpoint> written = LoadCheckpoint(candidates.front(), *api::FindPreset("gpt2-tiny"));
    Trainer reader(with_checkpoints(15, gpu_first ? "fp32" : "bf16"), nullptr, second);
    ASSERT_EQ(reader.resumed_from(), std::optional<int64_t>(10)) << (gpu_first ? "gpu to cpu" : "cpu to gpu");
    EXPECT_EQ(reader.Weights(), written->state.master) << "the weights after loading are the checkpoint's";
    const std::vector<double> after = Losses(reader);
    // Against 15 uninterrupted steps on the second device: steps 11-15 follow it (the
    // first ten differ by the two devices' precisions only).
    Trainer uninterrupted(Job(Manifest(15, gpu_first ? "fp32" : "bf16")), nullptr, second);
    const std::vector<double> all = Losses(uninterrupted);
    ExpectClose(std::vector<double>(all.begin() + 10, all.end()), after,
                gpu_first ? "resumed on the cpu from the gpu's checkpoint" : "resumed on the gpu from the cpu's checkpoint",
                /*whole_run=*/false);
  }
}

// The losses `meshtrain run` prints, step by step.
std::vector<double> RunLosses(const fs::path& job, const fs::path& log) {
  const std::string command = std::string(MESHTRAIN_CLI) + " run " + job.string() + " --no-resume --sample-tokens 0 > " +
                              log.string() + " 2>&1";
  const int status = std::system(command.c_str());
  std::ifstream in(log);
  const std::string text((std::istreambuf_iterator<char>(in)), {});
  EXPECT_EQ(status, 0) << text;
  std::vector<double> losses;
  const std::regex step(R"(step +\d+/\d+ \| loss ([0-9.]+))");
  for (auto it = std::sregex_iterator(text.begin(), text.end(), step); it != std::sregex_iterator(); ++it) {
    losses.push_back(std::stod((*it)[1]));
  }
  return losses;
}

TEST_F(EngineOnCuda, RanksSharingTheGpuFollowOneRank) {
  struct Layout {
    const char* name;
    int gpus, tp, shard, offload;
  };
  std::vector<double> one;
  for (const Layout l : {Layout{"one rank", 1, 1, 1, 0}, Layout{"S=2", 2, 1, 2, 0},
                         Layout{"T=2 x S=2, offload horizon 1", 4, 2, 2, 1}, Layout{"R2 x S2", 4, 1, 2, 0}}) {
    const fs::path job = dir_ / "job.json", log = dir_ / "run.log";
    std::ofstream(job) << Manifest(20, "bf16", l.gpus, l.tp, l.shard, l.offload).dump(2);
    const std::vector<double> losses = RunLosses(job, log);
    if (one.empty()) {
      one = losses;
      ASSERT_EQ(one.size(), 20u);
      continue;
    }
    ExpectClose(one, losses, std::string(l.name) + " sharing the GPU");
    std::ifstream in(log);
    const std::string text((std::istreambuf_iterator<char>(in)), {});
    EXPECT_NE(text.find("ranks share a GPU"), std::string::npos) << "the staged fallback is said once:\n" << text;
  }
}

}  // namespace
}  // namespace meshtrain::train
