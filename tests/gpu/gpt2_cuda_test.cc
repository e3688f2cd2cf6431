// The mixed-precision CUDA GPT-2 against the fp32 CPU model it mirrors.

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "api/model_shape.h"
#include "tests/support/gpu.h"
#include "worker/model/gpt2.h"
#include "worker/model/gpt2_cuda.h"

namespace meshtrain::model {
namespace {

using ::meshtrain::testing::RelativeError;

constexpr int kBatch = 2, kSeq = 32;
constexpr uint64_t kSeed = 1234;

std::vector<int32_t> RandomTokens(int vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> tokens(size_t(kBatch) * kSeq);
  for (int32_t& t : tokens) t = int32_t(rng() % uint32_t(vocab));
  return tokens;
}

class Gpt2CudaTest : public ::testing::Test {
 protected:
  void SetUp() override { MESHTRAIN_SKIP_WITHOUT_GPU(); }
  const api::ModelShape& shape = *api::FindPreset("gpt2-tiny");
  runtime::MemoryAccounting accounting;
};

TEST_F(Gpt2CudaTest, LossAndGradientsMatchTheCpuModel) {
  const auto inputs = RandomTokens(int(shape.vocab_size), 1), targets = RandomTokens(int(shape.vocab_size), 2);
  Gpt2<float> cpu(shape, kBatch, kSeq);
  InitParameters(cpu.params().data(), cpu.layout(), kSeed);
  cpu.ZeroGrad();
  const double cpu_loss = cpu.Forward(inputs.data(), targets.data(), kBatch, kSeq);
  cpu.Backward(1.0f);

  Gpt2Cuda gpu(shape, kBatch, kSeq, kSeed, &accounting);
  const double gpu_loss = gpu.Forward(inputs.data(), targets.data(), kBatch, kSeq);
  gpu.Backward(1.0f);
  EXPECT_NEAR(gpu_loss, cpu_loss, 0.02 * cpu_loss);
  const std::vector<float> cpu_grads(cpu.grads().begin(), cpu.grads().end());
  EXPECT_LT(RelativeError(gpu.Gradients(), cpu_grads), 0.05);
  const std::vector<float> cpu_params(cpu.params().begin(), cpu.params().end());
  EXPECT_EQ(gpu.MasterWeights(), cpu_params);  // the same initialisation, bit for bit
  EXPECT_GT(accounting.peak(runtime::MemoryCategory::kActivations), 0);
}

TEST_F(Gpt2CudaTest, TrainingOnOneBatchDrivesTheLossDown) {
  const auto inputs = RandomTokens(int(shape.vocab_size), 3), targets = RandomTokens(int(shape.vocab_size), 4);
  Gpt2Cuda gpu(shape, kBatch, kSeq, kSeed, &accounting);
  double first = 0, loss = 0;
  for (int step = 1; step <= 40; ++step) {
    gpu.ZeroGrad();
    loss = gpu.Forward(inputs.data(), targets.data(), kBatch, kSeq);
    if (step == 1) first = loss;
    gpu.Backward(1.0f);
    EXPECT_TRUE(std::isfinite(gpu.GradNorm()));
    gpu.Update(3e-3f, 0.9f, 0.95f, 1e-8f, 0.0f, 1.0f, step);
  }
  EXPECT_NEAR(first, std::log(double(shape.vocab_size)), 0.5);  // untrained: about uniform
  EXPECT_LT(loss, 0.5 * first) << "40 steps on one batch should memorise much of it";
}

}  // namespace
}  // namespace meshtrain::model
