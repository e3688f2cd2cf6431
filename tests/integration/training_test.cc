// Single-rank training on the bundled corpus: the validation loss must fall below
// what a model without context can reach, and runs are bitwise reproducible; a mixture of
// experts' validation loss is the language model's alone, without its load-balancing loss.

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <optional>
#include <stdexcept>
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

  // moe-tiny (Mixtral, 4 experts, 2 a token) for `steps` steps of two micro-batches of 4
  // sequences, validation after every step over 2 micro-batches; with a load-balancing
  // loss of coefficient `aux` if given, and checkpoints after every step under `checkpoints`
  // if not empty.
  api::TrainingJob MoeJob(int64_t steps, std::optional<double> aux, const fs::path& checkpoints) {
    nlohmann::json manifest = api::ReadManifestFile("examples/gpt2-tiny-local.yaml").at(0).object;
    manifest["spec"]["model"] = {{"preset", "moe-tiny"}};
    manifest["spec"]["data"] = {{"train", (dir_ / "train.bin").string()}, {"validation", (dir_ / "val.bin").string()}};
    manifest["spec"].erase("checkpoint");
    if (!checkpoints.empty()) manifest["spec"]["checkpoint"] = {{"path", checkpoints.string()}, {"interval", 1}};
    nlohmann::json& training = manifest["spec"]["training"];
    training["steps"] = steps;
    training["microBatchSize"] = 4;
    training["globalBatchTokens"] = 2 * 4 * 64;
    training["warmupSteps"] = 1;
    training["evalInterval"] = 1;
    training["evalBatches"] = 2;
    if (aux) training["routerAuxLossCoef"] = *aux;
    const api::CheckedJob checked = api::CheckTrainingJob(manifest, "test", 0);
    if (!checked.ok()) throw std::runtime_error(checked.errors.front().ToString());
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
// gpt2-tiny, 100 steps on the example data: fp8's final validation loss within 2% of
// fp32's, both runs in one test, a test for each recipe (each under a minute on 2 cores).
class Float8Accuracy : public TrainingTest, public ::testing::WithParamInterface<const char*> {
 protected:
  double FinalValidation(const std::string& precision, const std::string& recipe, std::string* described) {
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
  }
};

TEST_P(Float8Accuracy, EndsWithinTwoPercentOfFp32sValidationLoss) {
  const std::string recipe = GetParam();
  std::string described;
  const double fp32 = FinalValidation("fp32", "tensorwise", &described);  // the default: fp32 refuses another
  EXPECT_EQ(described.find("fp8"), std::string::npos) << described;
  const double fp8 = FinalValidation("fp8", recipe, &described);
  std::cout << "validation loss after 100 steps: fp32 " << fp32 << ", fp8 (" << recipe << ") " << fp8 << " ("
            << 100 * (fp8 - fp32) / fp32 << "%)" << std::endl;
  EXPECT_LE(std::abs(fp8 - fp32), 0.02 * fp32) << recipe;
  EXPECT_NE(fp8, fp32) << recipe << ": the products were cast";
  EXPECT_NE(described.find("fp8 (" + recipe + ")"), std::string::npos) << described;
}

INSTANTIATE_TEST_SUITE_P(Recipes, Float8Accuracy, ::testing::Values("tensorwise", "rowwise"),
                         [](const ::testing::TestParamInfo<const char*>& recipe) { return std::string(recipe.param); });

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

// The load-balancing loss (spec.training.routerAuxLossCoef) is added to the loss training
// minimises and left out of the validation loss. moe-tiny with coefficient 0.5 and
// without one, from the same initial weights: their validation losses are equal bit for
// bit, while their first steps' losses (the same weights, the same data) differ by 0.5 x
// the load-balancing loss the step reports, which is large enough to show in either. After
// that step the run with it reports a validation loss equal, bit for bit, to that of a run
// without it resumed from the step's checkpoint: the same weights, evaluated without it.
TEST_F(TrainingTest, AMixturesValidationLossLeavesOutItsLoadBalancingLoss) {
  constexpr double kCoef = 0.5;
  const fs::path checkpoints = dir_ / "moe-checkpoints";
  Trainer with(MoeJob(1, kCoef, checkpoints)), without(MoeJob(1, std::nullopt, ""));
  const double untrained = with.Evaluate();
  EXPECT_EQ(untrained, without.Evaluate()) << "the same weights evaluated with and without a load-balancing loss";
  auto first_step = [](Trainer& trainer) {
    std::optional<StepReport> first;
    trainer.Run([&](const StepReport& r) { first = r; });
    if (!first) throw std::runtime_error("the run took no step");
    return *first;
  };
  const StepReport a = first_step(with), b = first_step(without);
  ASSERT_TRUE(a.aux_loss.has_value()) << "the step with a coefficient reports its load-balancing loss";
  EXPECT_FALSE(b.aux_loss.has_value());
  ASSERT_TRUE(a.validation_loss.has_value());
  ASSERT_TRUE(b.validation_loss.has_value());
  std::cout << "moe-tiny: validation loss untrained " << untrained << "; step 1 loss " << a.loss << " with 0.5 x aux "
            << *a.aux_loss << ", " << b.loss << " without; validation after it " << *a.validation_loss << " with, "
            << *b.validation_loss << " without" << std::endl;
  EXPECT_GT(kCoef * *a.aux_loss, 0.1) << "a term that would show in a validation loss that included it";
  EXPECT_NEAR(a.loss - b.loss, kCoef * *a.aux_loss, 1e-5) << "training adds 0.5 x the load-balancing loss";

  // The run with it, resumed without it from its checkpoint of step 1.
  Trainer resumed(MoeJob(2, std::nullopt, checkpoints));
  ASSERT_EQ(resumed.resumed_from(), std::optional<int64_t>(1));
  EXPECT_EQ(resumed.Weights(), with.Weights());
  EXPECT_EQ(*a.validation_loss, resumed.Evaluate()) << "the validation loss the run with it reported";
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
