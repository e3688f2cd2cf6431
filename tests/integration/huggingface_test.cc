// Hugging Face GPT-2 weights in and out: a tiny model written by an independent Python
// reference (tests/data/hf_gpt2_reference.py) loads through spec.model.init.from and gives
// that reference's next-token probabilities; export then import is bitwise; malformed
// files are named.

#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>

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
  EXPECT_EQ(LoadHuggingFaceGpt2(exported.string(), kTiny), saved.state.master);
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
      LoadHuggingFaceGpt2(file.string(), shape);
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
  // Through the spec: the field is named, and the run does not start.
  try {
    Trainer trainer(Job((dir_ / "missing.safetensors").string()));
    ADD_FAILURE() << "a missing init file was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("spec.model.init.from: "), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("missing.safetensors: missing or unreadable"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace meshtrain::train
