// Hugging Face GPT-2 weights in and out: a tiny model written by an independent Python
// reference (tests/data/hf_gpt2_reference.py) loads through spec.model.init.from and gives
// that reference's next-token probabilities; export then import is bitwise; malformed
// files are named; a model of GPT-2's vocabulary (50257, which the engine pads to 50304)
// trains as the unpadded engine does, and its files keep the user's shapes.
// MESHTRAIN_CLI is the `meshtrain` binary (its export command).

#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <map>
#include <numeric>
#include <optional>

#include <gtest/gtest.h>

#include "api/engine_memory.h"
#include "api/manifest.h"
#include "worker/model/parameters.h"
#include "worker/train/checkpoint.h"
#include "worker/train/huggingface.h"
#include "worker/train/safetensors.h"
#include "worker/train/token_file.h"
#include "worker/train/trainer.h"

namespace meshtrain::train {
namespace {

namespace fs = std::filesystem;

const api::ModelShape kTiny{2, 2, 8, 11, 6};

class HuggingFaceTest : public testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("meshtrain-hf-" + std::to_string(::getpid()));
    fs::create_directories(dir_);
    const std::string command = "python3 tests/data/hf_gpt2_reference.py " + dir_.string();
    ASSERT_EQ(std::system(command.c_str()), 0) << command;
    std::vector<uint32_t> tokens(4000);
    for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = uint32_t((i * 7 + i / 5) % 11);
    WriteTokenFile((dir_ / "tokens.bin").string(), tokens);
  }
  void TearDown() override { fs::remove_all(dir_); }

  api::TrainingJob Job(const std::string& init, const std::string& checkpoints = "") {
    nlohmann::json manifest = {
        {"apiVersion", "meshtrain.dev/v1alpha1"},
        {"kind", "TrainingJob"},
        {"metadata", {{"name", "hf"}}},
        {"spec",
         {{"image", "meshtrain:test"},
          {"model", {{"layers", 2}, {"heads", 2}, {"hidden", 8}, {"vocabSize", 11}, {"seqLen", 6}}},
          {"data", {{"train", (dir_ / "tokens.bin").string()}}},
          {"training",
           {{"steps", 3}, {"microBatchSize", 2}, {"globalBatchTokens", 12}, {"warmupSteps", 1},
            {"precision", "fp32"}, {"evalInterval", 0}}}}}};
    if (!init.empty()) manifest["spec"]["model"]["init"] = {{"from", init}};
    if (!checkpoints.empty()) manifest["spec"]["checkpoint"] = {{"path", checkpoints}, {"interval", 3}};
    const api::CheckedJob checked = api::CheckTrainingJob(manifest, "test", 0);
    EXPECT_TRUE(checked.ok()) << checked.errors.front().ToString();
    return checked.job;
  }

  fs::path dir_;
};

TEST_F(HuggingFaceTest, ATinyGpt2LoadsAndGivesTheReferencesProbabilities) {
  Trainer trainer(Job((dir_ / "tiny-gpt2.safetensors").string()));
  const nlohmann::json reference = nlohmann::json::parse(std::ifstream(dir_ / "logits.json"));
  const std::vector<int32_t> tokens = reference["tokens"].get<std::vector<int32_t>>();
  for (size_t n = 1; n <= tokens.size(); ++n) {
    const std::vector<float> probs = trainer.model().NextTokenProbabilities(tokens.data(), int(n));
    const std::vector<double> logits = reference["logits"][n - 1].get<std::vector<double>>();
    double top = logits[0], sum = 0;
    for (double l : logits) top = std::max(top, l);
    for (double l : logits) sum += std::exp(l - top);
    ASSERT_EQ(probs.size(), logits.size());
    for (size_t v = 0; v < logits.size(); ++v) {
      EXPECT_NEAR(probs[v], std::exp(logits[v] - top) / sum, 1e-6) << "after " << n << " tokens, token " << v;
    }
  }
}

TEST_F(HuggingFaceTest, ExportThenImportIsBitwise) {
  const fs::path checkpoints = dir_ / "checkpoints";
  {
    Trainer trainer(Job((dir_ / "tiny-gpt2.safetensors").string(), checkpoints.string()));
    trainer.Run([](const StepReport&) {});  // three steps, then a checkpoint of step 3
  }
  const std::string step = (checkpoints / "step-00000003").string();
  const LoadedCheckpoint saved = LoadCheckpoint(step, kTiny);
  const fs::path exported = dir_ / "exported.safetensors";
  SaveHuggingFaceGpt2(exported.string(), saved.state.master, kTiny);
  EXPECT_EQ(LoadHuggingFace(exported.string(), kTiny), saved.state.master);
  Trainer imported(Job(exported.string()));
  EXPECT_EQ(imported.Weights(), saved.state.master);
  // The names and shapes are Hugging Face's: Conv1D weights (in, out).
  const std::map<std::string, Tensor> tensors = ReadSafetensors(exported.string());
  EXPECT_EQ(tensors.at("h.1.attn.c_attn.weight").shape, (std::vector<int64_t>{8, 24}));
  EXPECT_EQ(tensors.at("h.0.mlp.c_proj.weight").shape, (std::vector<int64_t>{32, 8}));
  EXPECT_EQ(tensors.at("wte.weight").shape, (std::vector<int64_t>{11, 8}));
}

TEST_F(HuggingFaceTest, MalformedFilesAndWrongShapesAreNamed) {
  auto error_of = [&](const fs::path& file, const api::ModelShape& shape) -> std::string {
    try {
      LoadHuggingFace(file.string(), shape);
    } catch (const SafetensorsError& e) {
      return e.what();
    }
    return "";
  };
  const fs::path good = dir_ / "tiny-gpt2.safetensors";
  std::string bytes;
  {
    std::ifstream in(good, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  const fs::path bad = dir_ / "bad.safetensors";
  // A header length past the end of the file.
  std::string huge = bytes;
  huge[5] = char(0x7f);
  std::ofstream(bad, std::ios::binary | std::ios::trunc) << huge;
  EXPECT_NE(error_of(bad, kTiny).find("does not fit the file"), std::string::npos) << error_of(bad, kTiny);
  // A header that is not JSON.
  std::string garbled = bytes;
  garbled[8] = '#';
  std::ofstream(bad, std::ios::binary | std::ios::trunc) << garbled;
  EXPECT_NE(error_of(bad, kTiny).find("header is not valid JSON"), std::string::npos) << error_of(bad, kTiny);
  // Truncated data.
  std::ofstream(bad, std::ios::binary | std::ios::trunc) << bytes.substr(0, bytes.size() - 64);
  EXPECT_NE(error_of(bad, kTiny).find("data_offsets"), std::string::npos) << error_of(bad, kTiny);
  // The right file for another shape.
  api::ModelShape wider = kTiny;
  wider.hidden = 16;
  EXPECT_NE(error_of(good, wider).find("tensor wte.weight has shape [11, 8], but spec.model needs [11, 16]"),
            std::string::npos)
      << error_of(good, wider);
  api::ModelShape deeper = kTiny;
  deeper.layers = 3;
  EXPECT_NE(error_of(good, deeper).find("tensor h.2.ln_1.weight is missing"), std::string::npos)
      << error_of(good, deeper);
  api::ModelShape shallower = kTiny;
  shallower.layers = 1;
  EXPECT_NE(error_of(good, shallower).find("is not part of a GPT-2 of this shape"), std::string::npos)
      << error_of(good, shallower);
  // Weights that are not finite, which would only show as a diverged first step.
  std::vector<float> weights = LoadHuggingFace(good.string(), kTiny);
  weights[weights.size() / 2] = std::numeric_limits<float>::quiet_NaN();
  SaveHuggingFaceGpt2(bad.string(), weights, kTiny);
  EXPECT_NE(error_of(bad, kTiny).find("holds nan at element "), std::string::npos) << error_of(bad, kTiny);
  EXPECT_NE(error_of(bad, kTiny).find(": the weights are not finite"), std::string::npos) << error_of(bad, kTiny);
  // Through the spec: the field is named, and the run does not start.
  try {
    Trainer trainer(Job((dir_ / "missing.safetensors").string()));
    ADD_FAILURE() << "a missing init file was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("spec.model.init.from: "), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("missing.safetensors: missing or unreadable"), std::string::npos) << e.what();
  }
  // A directory (or a FIFO) is refused by name before it is read.
  fs::create_directories(dir_ / "directory.safetensors");
  try {
    ReadSafetensors((dir_ / "directory.safetensors").string());
    ADD_FAILURE() << "a directory was read as a safetensors file";
  } catch (const SafetensorsError& e) {
    EXPECT_EQ(std::string(e.what()), (dir_ / "directory.safetensors").string() + ": is not a regular file");
  }
}

// GPT-2's vocabulary on a small model: the padded engine (50257 rows padded to 50304)
// trains 20 steps with the unpadded engine's losses (MESHTRAIN_VOCAB_MULTIPLE=1) within
// 1e-5; `meshtrain export` writes wte as 50257 x 32, and the file imports back bitwise.
TEST_F(HuggingFaceTest, Gpt2sVocabularyTrainsPaddedAndItsFilesKeepTheUsersShapes) {
  constexpr int64_t kVocab = 50257;
  const api::ModelShape shape{2, 2, 32, kVocab, 16};
  // A text of period 101 whose tokens spread over the whole vocabulary, the last rows
  // (those next to the padding) included: each token tells the next.
  std::vector<uint32_t> tokens(20000);
  for (size_t i = 0; i < tokens.size(); ++i) {
    const uint64_t j = i % 101;
    tokens[i] = uint32_t(j == 100 ? kVocab - 1 : (j * 4973 + 17) % uint64_t(kVocab));
  }
  WriteTokenFile((dir_ / "gpt2-vocabulary.bin").string(), tokens);
  auto job = [&](const std::string& checkpoints, const std::string& init) {
    nlohmann::json manifest = {
        {"apiVersion", "meshtrain.dev/v1alpha1"},
        {"kind", "TrainingJob"},
        {"metadata", {{"name", "gpt2-vocabulary"}}},
        {"spec",
         {{"image", "meshtrain:test"},
          {"model", {{"layers", 2}, {"heads", 2}, {"hidden", 32}, {"vocabSize", kVocab}, {"seqLen", 16}}},
          {"data", {{"train", (dir_ / "gpt2-vocabulary.bin").string()}}},
          {"training",
           {{"steps", 20}, {"microBatchSize", 2}, {"globalBatchTokens", 64}, {"learningRate", 1e-2},
            {"warmupSteps", 2}, {"seed", 11}, {"precision", "fp32"}, {"evalInterval", 0}}}}}};
    if (!checkpoints.empty()) manifest["spec"]["checkpoint"] = {{"path", checkpoints}, {"interval", 20}};
    if (!init.empty()) manifest["spec"]["model"]["init"] = {{"from", init}};
    const api::CheckedJob checked = api::CheckTrainingJob(manifest, "test", 0);
    EXPECT_TRUE(checked.ok()) << checked.errors.front().ToString();
    return checked.job;
  };
  auto losses_of = [](Trainer& trainer) {
    std::vector<double> losses;
    trainer.Run([&](const StepReport& r) { losses.push_back(r.loss); });
    return losses;
  };

  const fs::path checkpoints = dir_ / "gpt2-vocabulary-checkpoints";
  Trainer padded(job(checkpoints.string(), ""));
  ASSERT_EQ(padded.model().vocab_multiple(), api::kVocabMultiple);
  const std::vector<double> want_losses = [&] {
    // The unpadded engine: the variable is read when the engine is built.
    const char* old = std::getenv("MESHTRAIN_VOCAB_MULTIPLE");
    const std::optional<std::string> saved = old ? std::optional<std::string>(old) : std::nullopt;
    ::setenv("MESHTRAIN_VOCAB_MULTIPLE", "1", 1);
    std::optional<Trainer> unpadded;
    try {
      unpadded.emplace(job("", ""));
    } catch (...) {
      saved ? ::setenv("MESHTRAIN_VOCAB_MULTIPLE", saved->c_str(), 1) : ::unsetenv("MESHTRAIN_VOCAB_MULTIPLE");
      throw;
    }
    saved ? ::setenv("MESHTRAIN_VOCAB_MULTIPLE", saved->c_str(), 1) : ::unsetenv("MESHTRAIN_VOCAB_MULTIPLE");
    EXPECT_EQ(unpadded->model().vocab_multiple(), 1);
    return losses_of(*unpadded);
  }();
  const std::vector<double> losses = losses_of(padded);
  ASSERT_EQ(losses.size(), 20u);
  ASSERT_EQ(want_losses.size(), 20u);
  double worst = 0;
  for (size_t i = 0; i < losses.size(); ++i) {
    EXPECT_NEAR(losses[i], want_losses[i], 1e-5 * want_losses[i]) << "step " << i + 1;
    worst = std::max(worst, std::abs(losses[i] - want_losses[i]) / want_losses[i]);
  }
  std::cout << "vocabulary 50257 padded to 50304: loss " << losses.front() << " -> " << losses.back()
            << "; unpadded " << want_losses.front() << " -> " << want_losses.back() << "; worst relative difference "
            << worst << std::endl;
  EXPECT_NEAR(losses.front(), std::log(double(kVocab)), 0.1) << "uniform over the user's vocabulary at first";
  EXPECT_LT(losses.back(), losses.front() - 1.0) << "the model learns";

  // Export, with the CLI, and the shapes in the file are the user's.
  const fs::path exported = dir_ / "gpt2-vocabulary.safetensors";
  const std::string command = std::string(MESHTRAIN_CLI) + " export " + (checkpoints / "step-00000020").string() +
                              " " + exported.string() + " --format safetensors";
  ASSERT_EQ(std::system(command.c_str()), 0) << command;
  const std::map<std::string, Tensor> tensors = ReadSafetensors(exported.string());
  EXPECT_EQ(tensors.at("wte.weight").shape, (std::vector<int64_t>{kVocab, 32}));
  EXPECT_EQ(tensors.at("wpe.weight").shape, (std::vector<int64_t>{16, 32}));
  const LoadedCheckpoint saved = LoadCheckpoint((checkpoints / "step-00000020").string(), shape);
  EXPECT_EQ(int64_t(saved.state.master.size()), shape.ParameterCount());
  const std::vector<float> trained = padded.Weights();
  EXPECT_EQ(saved.state.master, trained);
  EXPECT_EQ(LoadHuggingFace(exported.string(), shape), trained);
  // The last row, next to the padding, trained (its token occurs in the text).
  const std::vector<float>& wte = tensors.at("wte.weight").values;
  Trainer untrained(job("", ""));
  const std::vector<float> initial = untrained.Weights();
  EXPECT_FALSE(std::equal(wte.end() - 32, wte.end(), initial.begin() + (kVocab - 1) * 32)) << "row 50256 trained";

  // Import into the padded engine: the same weights, and probabilities over the user's
  // vocabulary that are the trained model's.
  Trainer imported(job("", exported.string()));
  EXPECT_EQ(imported.Weights(), trained);
  const std::vector<int32_t> prompt(tokens.begin(), tokens.begin() + 10);
  const std::vector<float> probs = imported.model().NextTokenProbabilities(prompt.data(), int(prompt.size()));
  ASSERT_EQ(int64_t(probs.size()), kVocab);
  EXPECT_EQ(probs, padded.model().NextTokenProbabilities(prompt.data(), int(prompt.size())));
  EXPECT_NEAR(std::accumulate(probs.begin(), probs.end(), 0.0), 1.0, 1e-4);
}

}  // namespace
}  // namespace meshtrain::train
