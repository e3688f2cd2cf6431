// Single-rank training on the bundled corpus: the validation loss must fall below
// what a model without context can reach, and runs are bitwise reproducible.

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <optional>
#include <string>

#include <gtest/gtest.h>

#include "api/manifest.h"
#include "worker/train/token_file.h"
#include "worker/train/trainer.h"

namespace meshtrain::train {
namespace {

namespace fs = std::filesystem;

class TrainingTest : public testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("meshtrain-training-" + std::to_string(::getpid()));
    fs::create_directories(dir_);
    // The bundled corpus, split 90/10 as `meshtrain prepare-data` does.
    const auto split = WriteTextAsTokenFiles("examples/data/pride-and-prejudice.txt", (dir_ / "train.bin").string(),
                                                (dir_ / "val.bin").string(), 0.1);
    ASSERT_GT(split.train, 600000u);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // The tiny example, with shorter runs and this test's data.
  api::TrainingJob Job(int64_t steps) {
    nlohmann::json manifest = api::ReadManifestFile("examples/gpt2-tiny-local.yaml").at(0).object;
    manifest["spec"]["data"] = {{"train", (dir_ / "train.bin").string()}, {"validation", (dir_ / "val.bin").string()}};
    manifest["spec"].erase("checkpoint");  // checkpoint_test.cc covers them
    manifest["spec"]["training"]["steps"] = steps;
    manifest["spec"]["training"]["globalBatchTokens"] = 2048;
    manifest["spec"]["training"]["warmupSteps"] = std::min<int64_t>(10, steps);
    manifest["spec"]["training"]["evalBatches"] = 4;
    const api::CheckedJob checked = api::CheckTrainingJob(manifest, "test", 0);
    EXPECT_TRUE(checked.ok()) << checked.errors.front().ToString();
    return checked.job;
  }

  fs::path dir_;
};

TEST_F(TrainingTest, ValidationLossFallsBelowWhatNoContextAllows) {
  Trainer trainer(Job(100));
  const double untrained = trainer.Evaluate();
  EXPECT_NEAR(untrained, std::log(256.0), 0.1);  // uniform over bytes at init
  std::vector<double> validation;
  trainer.Run([&](const StepReport& r) {
    if (r.validation_loss) validation.push_back(*r.validation_loss);
  });
  ASSERT_FALSE(validation.empty());
  std::cout << "validation loss: untrained " << untrained << ", then";
  for (double v : validation) std::cout << " " << v;
  std::cout << std::endl;
  // The bytes of this text taken one at a time carry 3.09 nats (their unigram entropy),
  // and an untrained model scores ln 256 = 5.55: 2.6 needs the model to use context.
  EXPECT_LT(validation.back(), 2.6);
  EXPECT_LT(validation.back(), validation.front());
  const std::string sample = trainer.SampleText(200, 1);
  EXPECT_EQ(sample.size(), 200u);
  size_t letters = 0;
  for (char c : sample) letters += std::isalpha(static_cast<unsigned char>(c)) || c == ' ';
  EXPECT_GT(letters, 150u) << sample;  // mostly words, not byte noise
}

// Float8 training (the CPU's emulation of the float8 products) learns as fp32 does: 100
// steps of each recipe end within 2% of fp32's validation loss, and the model line says
// which recipe ran.
TEST_F(TrainingTest, Float8EndsWithinTwoPercentOfFp32sValidationLoss) {
  auto final_validation = [&](const std::string& precision, const std::string& recipe, std::string* described) {
    api::TrainingJob job = Job(100);
    job.spec.training.precision = precision;
    job.spec.training.float8.recipe = recipe;
    Trainer trainer(job);
    *described = trainer.Describe();
    std::optional<double> last;
    trainer.Run([&](const StepReport& r) {
      if (r.validation_loss) last = r.validation_loss;
    });
    EXPECT_TRUE(last.has_value());
    return last.value_or(0);
  };
  std::string described;
  const double fp32 = final_validation("fp32", "tensorwise", &described);
  EXPECT_EQ(described.find("fp8"), std::string::npos) << described;
  for (const std::string recipe : {"tensorwise", "rowwise"}) {
    const double fp8 = final_validation("fp8", recipe, &described);
    std::cout << "validation loss after 100 steps: fp32 " << fp32 << ", fp8 (" << recipe << ") " << fp8 << " ("
              << 100 * (fp8 - fp32) / fp32 << "%)" << std::endl;
    EXPECT_LE(std::abs(fp8 - fp32), 0.02 * fp32) << recipe;
    EXPECT_NE(fp8, fp32) << recipe << ": the products were cast";
    EXPECT_NE(described.find("fp8 (" + recipe + ")"), std::string::npos) << described;
  }
}

TEST_F(TrainingTest, SameSeedGivesBitwiseIdenticalLosses) {
  auto losses = [&] {
    Trainer trainer(Job(6));
    std::vector<double> out;
    trainer.Run([&](const StepReport& r) { out.push_back(r.loss); });
    return out;
  };
  const std::vector<double> first = losses(), second = losses();
  ASSERT_EQ(first.size(), 6u);
  for (size_t i = 0; i < first.size(); ++i) EXPECT_EQ(first[i], second[i]) << "step " << i + 1;
  EXPECT_LT(first.back(), first.front());
}

// The message of the std::invalid_argument that Trainer's constructor throws for `job`.
std::string Refusal(const api::TrainingJob& job) {
  try {
    Trainer trainer(job);
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  ADD_FAILURE() << "the trainer accepted the job";
  return "";
}

TEST_F(TrainingTest, AWorldWithoutItsCommunicatorIsRefusedClearly) {
  api::TrainingJob job = Job(5);
  job.spec.nodes = 2;
  job.spec.training.global_batch_tokens = 4096;
  const std::string message = Refusal(job);
  EXPECT_NE(message.find("the job has 2 ranks"), std::string::npos) << message;
  EXPECT_NE(message.find("meshtrain-worker"), std::string::npos) << message;
}

TEST_F(TrainingTest, ATensorParallelDegreeThatDoesNotSplitTheHeadsIsRefusedNamingTheField) {
  api::TrainingJob job = Job(5);
  job.spec.gpus_per_node = 3;
  job.spec.parallelism.tensor_parallel_degree = 3;  // gpt2-tiny has 4 heads
  job.spec.training.global_batch_tokens = 1024;
  try {
    CheckTrainable(job, 0, 3);
    ADD_FAILURE() << "3 TP ranks split 4 heads";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("spec.parallelism.tensorParallelDegree: must divide spec.model.heads (4)"),
              std::string::npos)
        << e.what();
  }
}

// spec.data.attention document: data whose tokenizer marks no document start in a file is
// refused naming the field and the file; with <|endoftext|> before each document (the byte
// tokenizer of examples/data/byte-tokenizer) it trains, and the validation loss is within
// documents too.
TEST_F(TrainingTest, DocumentAttentionNeedsDataThatMarksWhereDocumentsStart) {
  api::TrainingJob job = Job(3);
  job.spec.data.attention = "document";
  job.spec.model.tokenizer = "examples/data/byte-tokenizer";
  job.spec.model.vocab_size = 264;  // the tokenizer's 257
  const std::string bytes = (dir_ / "train.bin").string();
  try {
    CheckTrainable(job, 0, 1);
    ADD_FAILURE() << "bytes without <|endoftext|> have documents";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("spec.data.attention: document: " + bytes + " holds no document start"),
              std::string::npos)
        << e.what();
  }
  // Each line a document.
  for (const char* split : {"train", "val"}) {
    const TokenFile text = TokenFile::Open((dir_ / (std::string(split) + ".bin")).string());
    std::vector<uint32_t> tokens{256};
    for (uint64_t i = 0; i < text.size(); ++i) {
      tokens.push_back(text[i]);
      if (text[i] == '\n') tokens.push_back(256);
    }
    WriteTokenFile((dir_ / (std::string(split) + ".documents.bin")).string(), tokens);
  }
  job.spec.data.train = {(dir_ / "train.documents.bin").string()};
  job.spec.data.validation = {(dir_ / "val.documents.bin").string()};
  CheckTrainable(job, 0, 1);
  Trainer trainer(job);
  std::vector<double> losses;
  trainer.Run([&](const StepReport& r) { losses.push_back(r.loss); });
  ASSERT_EQ(losses.size(), 3u);
  EXPECT_LT(losses.back(), losses.front());
  job.spec.model.tokenizer.clear();  // nothing says where documents start
  EXPECT_NE(Refusal(job).find("spec.data.attention: document"), std::string::npos);
}

// spec.resources.memoryLimitMiB caps what the rank's allocator may hold: a limit the
// model's state does not fit under fails construction with the allocator's error.
TEST_F(TrainingTest, TheSpecsMemoryLimitCapsTheAllocator) {
  api::TrainingJob job = Job(5);
  job.spec.resources.memory_limit_mib = 2;  // gpt2-tiny's fp32 state is 12.7 MiB
  try {
    Trainer trainer(job);
    ADD_FAILURE() << "the model trained under 2 MiB";
  } catch (const runtime::OutOfMemory& e) {
    EXPECT_NE(std::string(e.what()).find("would pass the limit of 2.0 MiB"), std::string::npos) << e.what();
  }
  job.spec.resources.memory_limit_mib = 512;
  Trainer roomy(job);
  EXPECT_GT(roomy.memory().params, 0);
}

}  // namespace
}  // namespace meshtrain::train
