// Hugging Face GPT-2 weights in and out: a tiny model written by an independent Python
// reference (tests/data/hf_gpt2_reference.py) loads through spec.model.init.from and gives
// that reference's next-token probabilities; export then import is bitwise; malformed
// files are named; a model of GPT-2's vocabulary (50257, which the engine pads to 50304)
// trains as the unpadded engine does, and its files keep the user's shapes. The Llama
// class's model directories (config.json and sharded safetensors, written by the PyTorch
// reference tests/data/torch_llama_reference.py): in, trained, exported with the CLI and
// read back bit for bit; and every kind of bad directory named before anything trains. A
// mixture of experts' checkpoint of two expert-parallel ranks exports as one rank's weights.
// MESHTRAIN_CLI is the `meshtrain` binary (its run and export commands), MESHTRAIN_WORKER
// the ranks `meshtrain run` starts.

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <map>
#include <numeric>
#include <optional>
#include <functional>
#include <iterator>
#include <set>
#include <string>

#include <gtest/gtest.h>

#include "api/engine_memory.h"
#include "api/manifest.h"
#include "worker/model/parameters.h"
#include "worker/train/checkpoint.h"
#include "worker/train/huggingface.h"
#include "worker/train/safetensors.h"
#include "worker/train/token_file.h"
#include "worker/train/trainer.h"
#include "tests/support/safetensors_shapes.h"

namespace meshtrain::train {
namespace {

namespace fs = std::filesystem;

const api::ModelShape kTiny{2, 2, 8, 11, 6};

class HuggingFaceTest : public ::testing::Test {
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

  // Trains `job`, whose spec.model.init.from is `model` (the run starts from its weights,
  // and moves them), into *trained, then `meshtrain export`s its checkpoint of step 3 under
  // `checkpoints` to `exported` in files of at most 50KB.
  void TrainAndExport(const api::TrainingJob& job, const fs::path& model, const api::ModelShape& shape,
                      const fs::path& checkpoints, const fs::path& exported, std::vector<float>* trained) {
    Trainer start(job);
    EXPECT_EQ(start.Weights(), LoadHuggingFace(model.string(), shape));
    Trainer trainer(job);
    trainer.Run([](const StepReport&) {});
    *trained = trainer.Weights();
    EXPECT_NE(*trained, start.Weights());
    const std::string command = std::string(MESHTRAIN_CLI) + " export " + (checkpoints / "step-00000003").string() +
                                " " + exported.string() + " --max-shard-size 50KB > " + (dir_ / "export.txt").string();
    ASSERT_EQ(std::system(command.c_str()), 0) << command;
  }

  // bytes.bin: 4000 tokens of a pattern over the byte vocabulary, for the Llama class.
  void WriteByteTokens() {
    std::vector<uint32_t> tokens(4000);
    for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = uint32_t((i * 37 + i / 7) % 256);
    WriteTokenFile((dir_ / "bytes.bin").string(), tokens);
  }

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
  SaveSingleFile(exported.string(), saved.state.master, kTiny);
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
  EXPECT_NE(error_of(good, wider).find("wte.weight has shape [11, 8], but spec.model needs [11, 16]"),
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
  SaveSingleFile(bad.string(), weights, kTiny);
  EXPECT_NE(error_of(bad, kTiny).find("holds nan at element "), std::string::npos) << error_of(bad, kTiny);
  EXPECT_NE(error_of(bad, kTiny).find(": the weights are not finite"), std::string::npos) << error_of(bad, kTiny);
  // A one-file form: GPT-2's gives its shape from its tensors; tensors of no family's
  // one-file form are named as such; a family without one is refused a file.
  const api::ModelShape read = HuggingFaceShape(good.string(), kTiny.hidden / kTiny.heads);
  EXPECT_EQ(read.layers, kTiny.layers);
  EXPECT_EQ(read.heads, kTiny.heads);
  EXPECT_EQ(read.vocab_size, kTiny.vocab_size);
  WriteSafetensors(bad.string(), {{"model.embed_tokens.weight", {{11, 8}, std::vector<float>(88)}}}, {});
  try {
    HuggingFaceShape(bad.string());
    ADD_FAILURE() << "a file of no one-file form was read";
  } catch (const SafetensorsError& e) {
    EXPECT_NE(std::string(e.what()).find("bad.safetensors: its tensors are not in a one-file form meshtrain reads "
                                         "(GPT-2's)"),
              std::string::npos)
        << e.what();
  }
  api::ModelShape llama = kTiny;
  llama.family = "llama";
  EXPECT_THROW(SaveSingleFile(bad.string(), weights, llama), SafetensorsError);
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
// trains 20 steps with the unpadded engine's losses (EngineSwitches::vocab_multiple 1) within
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
    Trainer unpadded(job("", ""), nullptr, runtime::Device::Cpu(), nullptr, nullptr, {.vocab_multiple = 1});
    EXPECT_EQ(unpadded.model().vocab_multiple(), 1);
    return losses_of(unpadded);
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

// A Llama-class directory written by the PyTorch reference (`init` mode).
fs::path ReferenceModel(const fs::path& dir, const std::string& family, const std::string& flags) {
  const std::string command = "/usr/bin/python3 tests/data/torch_llama_reference.py init " + dir.string() +
                              " --family " + family + " " + flags;
  EXPECT_EQ(std::system(command.c_str()), 0) << command;
  return dir;
}

// The manifest of a job of one rank whose shape comes from `model`'s config.json: 3 steps
// of 2 sequences of 32 tokens, a checkpoint of the last under `checkpoints` if not empty.
nlohmann::json LlamaManifest(const fs::path& model, const fs::path& tokens, const std::string& checkpoints = "",
                             const nlohmann::json& model_fields = nlohmann::json::object()) {
  nlohmann::json manifest = {
      {"apiVersion", "meshtrain.dev/v1alpha1"},
      {"kind", "TrainingJob"},
      {"metadata", {{"name", "llama"}}},
      {"spec",
       {{"image", "meshtrain:test"},
        {"model", {{"seqLen", 32}, {"init", {{"from", model.string()}}}}},
        {"data", {{"train", tokens.string()}}},
        {"training",
         {{"steps", 3}, {"microBatchSize", 2}, {"globalBatchTokens", 64}, {"warmupSteps", 1}, {"precision", "fp32"},
          {"evalInterval", 0}}}}}};
  for (const auto& [key, value] : model_fields.items()) manifest["spec"]["model"][key] = value;
  if (!checkpoints.empty()) manifest["spec"]["checkpoint"] = {{"path", checkpoints}, {"interval", 3}};
  return manifest;
}

// LlamaManifest's job, its shape from `model`'s config.json (as a worker reads it), or the
// errors of checking it.
api::CheckedJob LlamaJob(const fs::path& model, const fs::path& tokens, const std::string& checkpoints = "",
                         const nlohmann::json& model_fields = nlohmann::json::object()) {
  return api::CheckTrainingJob(LlamaManifest(model, tokens, checkpoints, model_fields), "test", 0,
                               api::ModelDirectory::kRequired);
}

// A file's bytes.
std::string Bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// In, trained, out and in again: a directory of bf16 weights over three shards (Llama,
// untied head), one of fp32 weights in one file (Qwen2, tied head, biases) and one of
// fp32 weights over two shards (Qwen3, untied head, q_norm and k_norm) train from
// spec.model.init.from; `meshtrain export` writes the checkpoint as a directory of small
// shards with an index, names and shapes as transformers writes them, the vocabulary
// unpadded and a tied head once; reading it back gives the checkpoint's weights bit for
// bit, and so does a new run from it.
TEST_F(HuggingFaceTest, ALlamaClassDirectoryTrainsExportsAndLoadsBackBitForBit) {
  WriteByteTokens();
  for (const auto& [family, flags] : {std::pair<std::string, std::string>{"llama", "--dtype bf16 --shards 3"},
                                      std::pair<std::string, std::string>{"qwen2", ""},
                                      std::pair<std::string, std::string>{"qwen3", "--shards 2"}}) {
    SCOPED_TRACE(family);
    const fs::path model = ReferenceModel(dir_ / (family + "-in"), family, flags);
    const fs::path checkpoints = dir_ / (family + "-checkpoints"), exported = dir_ / (family + "-out");
    const api::CheckedJob checked = LlamaJob(model, dir_ / "bytes.bin", checkpoints.string());
    ASSERT_TRUE(checked.ok()) << checked.errors.front().ToString();
    const api::ModelShape shape = api::ShapeOf(checked.job.spec.model);
    EXPECT_EQ(shape.family, family);
    EXPECT_EQ(shape.hidden, 40);
    EXPECT_EQ(shape.KvHeads(), 2);
    EXPECT_EQ(shape.tied, family == "qwen2");
    // The run starts from the directory's weights.
    std::vector<float> trained;
    ASSERT_NO_FATAL_FAILURE(TrainAndExport(checked.job, model, shape, checkpoints, exported, &trained));
    const nlohmann::json config = nlohmann::json::parse(std::ifstream(exported / "config.json"));
    const std::map<std::string, std::string> architecture = {
        {"llama", "LlamaForCausalLM"}, {"qwen2", "Qwen2ForCausalLM"}, {"qwen3", "Qwen3ForCausalLM"}};
    EXPECT_EQ(config.at("architectures")[0], architecture.at(family));
    EXPECT_EQ(config.at("model_type"), family);
    EXPECT_EQ(config.at("torch_dtype"), "float32");
    EXPECT_EQ(config.at("num_key_value_heads"), 2);
    EXPECT_EQ(config.at("head_dim"), 12);
    const nlohmann::json index = nlohmann::json::parse(std::ifstream(exported / "model.safetensors.index.json"));
    std::map<std::string, Tensor> files;
    std::set<std::string> names;
    for (const auto& [name, file] : index.at("weight_map").items()) {
      names.insert(file.get<std::string>());
      EXPECT_LE(fs::file_size(exported / file.get<std::string>()), 50'000u) << file;
    }
    EXPECT_GT(names.size(), 2u) << "several shards";
    for (const std::string& name : names) files.merge(ReadSafetensors((exported / name).string()));
    EXPECT_EQ(files.at("model.embed_tokens.weight").shape, (std::vector<int64_t>{256, 40})) << "no padding rows";
    EXPECT_EQ(files.at("model.layers.1.self_attn.q_proj.weight").shape, (std::vector<int64_t>{48, 40}));
    EXPECT_EQ(files.at("model.layers.1.self_attn.k_proj.weight").shape, (std::vector<int64_t>{24, 40}));
    EXPECT_EQ(files.at("model.layers.0.mlp.down_proj.weight").shape, (std::vector<int64_t>{40, 76}));
    EXPECT_EQ(files.contains("lm_head.weight"), family != "qwen2") << "a tied head is written once";
    EXPECT_EQ(files.contains("model.layers.0.self_attn.q_proj.bias"), family == "qwen2");
    if (family == "qwen3") {  // the per-head norms, by transformers' names
      EXPECT_EQ(files.at("model.layers.1.self_attn.q_norm.weight").shape, (std::vector<int64_t>{12}));
      EXPECT_EQ(files.at("model.layers.1.self_attn.k_norm.weight").shape, (std::vector<int64_t>{12}));
      EXPECT_EQ(config.at("use_sliding_window"), false);
      EXPECT_EQ(config.at("attention_bias"), false);
    } else {
      EXPECT_FALSE(files.contains("model.layers.0.self_attn.q_norm.weight"));
    }
    EXPECT_EQ(index.at("weight_map").size(), files.size());
    int64_t data_bytes = 0;  // transformers' total_size: the tensors' data, 4 bytes a value here
    for (const auto& [name, t] : files) data_bytes += 4 * int64_t(t.values.size());
    EXPECT_EQ(index.at("metadata").at("total_size"), data_bytes);

    const LoadedCheckpoint saved = LoadCheckpoint((checkpoints / "step-00000003").string(), shape);
    EXPECT_EQ(saved.state.master, trained);
    EXPECT_EQ(LoadHuggingFace(exported.string(), shape), trained);
    const api::CheckedJob again = LlamaJob(exported, dir_ / "bytes.bin");
    ASSERT_TRUE(again.ok()) << again.errors.front().ToString();
    EXPECT_EQ(api::ShapeOf(again.job.spec.model), shape) << "the exported config.json gives the same shape";
    EXPECT_EQ(Trainer(again.job).Weights(), trained);
  }
}

// What a bad directory gets: an error naming the file, the key or the tensor, from the
// checks that run before any rank trains (the job's check; the Trainer's, which opens
// every file's header), and nothing trained.
TEST_F(HuggingFaceTest, BadLlamaClassDirectoriesAreNamed) {
  WriteByteTokens();
  const fs::path good = ReferenceModel(dir_ / "good", "qwen2", "");
  const fs::path sharded = ReferenceModel(dir_ / "sharded", "llama", "--shards 3");
  auto copy = [&](const fs::path& from, const std::string& name) {
    const fs::path to = dir_ / name;
    fs::copy(from, to, fs::copy_options::recursive);
    return to;
  };
  auto edit_config = [](const fs::path& model, const std::function<void(nlohmann::json&)>& edit) {
    nlohmann::json config = nlohmann::json::parse(std::ifstream(model / "config.json"));
    edit(config);
    std::ofstream(model / "config.json", std::ios::trunc) << config.dump();
  };
  // The job's check: config.json.
  auto job_error = [&](const fs::path& model, const nlohmann::json& fields = nlohmann::json::object()) {
    const api::CheckedJob checked = LlamaJob(model, dir_ / "bytes.bin", "", fields);
    return checked.ok() ? std::string() : checked.errors.front().ToString();
  };
  auto expect_job_error = [&](const fs::path& model, const std::string& want,
                              const nlohmann::json& fields = nlohmann::json::object()) {
    const std::string error = job_error(model, fields);
    EXPECT_NE(error.find(want), std::string::npos) << "want \"" << want << "\", got \"" << error << "\"";
  };
  EXPECT_EQ(job_error(good), "");
  for (const char* architecture : {"Qwen2MoeForCausalLM", "GemmaForCausalLM"}) {
    const fs::path model = copy(good, architecture);
    edit_config(model, [&](nlohmann::json& c) { c["architectures"] = {architecture}; });
    expect_job_error(model, std::string("architecture ") + architecture + " is not one meshtrain trains");
  }
  const fs::path yarn = copy(sharded, "yarn");
  edit_config(yarn, [](nlohmann::json& c) { c["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}}; });
  expect_job_error(yarn, "rope_scaling type \"yarn\" is not implemented");
  const fs::path gelu = copy(sharded, "gelu");
  edit_config(gelu, [](nlohmann::json& c) { c["hidden_act"] = "gelu"; });
  expect_job_error(gelu, "hidden_act gelu is not implemented");
  const fs::path biased = copy(sharded, "biased");
  edit_config(biased, [](nlohmann::json& c) { c["attention_bias"] = true; });
  expect_job_error(biased, "attention_bias true is not implemented");
  const fs::path sliding = copy(good, "sliding");
  edit_config(sliding, [](nlohmann::json& c) { c["use_sliding_window"] = true; });
  expect_job_error(sliding, "use_sliding_window true is not implemented");
  const fs::path mistral = copy(sharded, "mistral");
  edit_config(mistral, [](nlohmann::json& c) {
    c["architectures"] = {"MistralForCausalLM"};
    c["sliding_window"] = 16;
  });
  expect_job_error(mistral, "sliding_window (16)");
  expect_job_error(good, "spec.model.hidden: 64 disagrees with", {{"hidden", 64}});
  expect_job_error(good, "hidden_size is 40", {{"hidden", 64}});
  expect_job_error(good, "spec.model.seqLen: 256 exceeds", {{"seqLen", 256}});

  // The Trainer's check (CheckTrainable, before the rendezvous): the weights' files.
  auto weights_error = [&](const fs::path& model) -> std::string {
    const api::CheckedJob checked = LlamaJob(model, dir_ / "bytes.bin");
    if (!checked.ok()) return "job: " + checked.errors.front().ToString();
    try {
      CheckTrainable(checked.job, 0, 1);
    } catch (const std::invalid_argument& e) {
      return e.what();
    }
    return "";
  };
  auto expect_weights_error = [&](const fs::path& model, const std::string& want) {
    const std::string error = weights_error(model);
    EXPECT_NE(error.find(want), std::string::npos) << "want \"" << want << "\", got \"" << error << "\"";
    EXPECT_NE(error.find("spec.model.init.from: "), std::string::npos) << error;
  };
  EXPECT_EQ(weights_error(good), "");
  auto edit_weights = [](const fs::path& file, const std::function<void(std::map<std::string, Tensor>&)>& edit) {
    std::map<std::string, Tensor> tensors = ReadSafetensors(file.string());
    edit(tensors);
    WriteSafetensors(file.string(), tensors);
  };
  const fs::path missing = copy(good, "missing");
  edit_weights(missing / "model.safetensors", [](auto& t) { t.erase("model.layers.1.mlp.up_proj.weight"); });
  expect_weights_error(missing, "tensor model.layers.1.mlp.up_proj.weight is missing");
  const fs::path extra = copy(good, "extra");
  edit_weights(extra / "model.safetensors", [](auto& t) { t["model.layers.2.mlp.up_proj.weight"] = {{1}, {0.0f}}; });
  expect_weights_error(extra, "tensor model.layers.2.mlp.up_proj.weight is not part of a Qwen2 of this shape");
  const fs::path misshapen = copy(good, "misshapen");
  edit_weights(misshapen / "model.safetensors",
               [](auto& t) { t["model.norm.weight"] = {{41}, std::vector<float>(41, 1.0f)}; });
  expect_weights_error(misshapen, "tensor model.norm.weight has shape [41], but spec.model needs [40]");
  // Qwen3: a head_dim that disagrees with the tensors is named by its key; so are
  // sliding-window layers and an unimplemented RoPE scaling.
  const fs::path qwen3 = ReferenceModel(dir_ / "qwen3", "qwen3", "");
  EXPECT_EQ(weights_error(qwen3), "");
  const fs::path head_dim = copy(qwen3, "head-dim");
  edit_config(head_dim, [](nlohmann::json& c) { c["head_dim"] = 16; });
  expect_weights_error(head_dim, "self_attn.q_proj.weight has shape [48, 40], but spec.model needs [64, 40] "
                                 "(config.json's num_attention_heads x head_dim, hidden_size)");
  const fs::path no_head_dim = copy(qwen3, "no-head-dim");  // Qwen3's default is 128, not hidden / heads
  edit_config(no_head_dim, [](nlohmann::json& c) { c.erase("head_dim"); });
  expect_weights_error(no_head_dim, "needs [512, 40] (config.json's num_attention_heads x head_dim");
  const fs::path qwen3_sliding = copy(qwen3, "qwen3-sliding");
  edit_config(qwen3_sliding, [](nlohmann::json& c) { c["use_sliding_window"] = true; });
  expect_job_error(qwen3_sliding, "use_sliding_window true is not implemented");
  const fs::path qwen3_yarn = copy(qwen3, "qwen3-yarn");
  edit_config(qwen3_yarn, [](nlohmann::json& c) { c["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}}; });
  expect_job_error(qwen3_yarn, "config.json: rope_scaling type \"yarn\" is not implemented");
  const fs::path not_finite = copy(good, "not-finite");
  edit_weights(not_finite / "model.safetensors", [](auto& t) {
    t.at("model.layers.0.self_attn.k_proj.weight").values[7] = std::numeric_limits<float>::infinity();
  });
  // Values are read when the run starts (every rank its own): the Trainer names them.
  try {
    Trainer trainer(LlamaJob(not_finite, dir_ / "bytes.bin").job);
    ADD_FAILURE() << "an infinite weight was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("tensor model.layers.0.self_attn.k_proj.weight holds inf at element 7"),
              std::string::npos)
        << e.what();
  }
  // A shard the index names that is not there.
  const fs::path lost_shard = copy(sharded, "lost-shard");
  fs::remove(lost_shard / "model-00002-of-00003.safetensors");
  expect_weights_error(lost_shard, "names the shard model-00002-of-00003.safetensors, which is missing");
  // A dtype meshtrain does not read: the file's header says F64.
  const fs::path f64 = copy(good, "f64");
  {
    std::ifstream in(f64 / "model.safetensors", std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), {});
    const size_t at = bytes.find("\"F32\"");  // the first tensor's dtype
    ASSERT_NE(at, std::string::npos);
    bytes.replace(at, 5, "\"F64\"");
    std::ofstream(f64 / "model.safetensors", std::ios::binary | std::ios::trunc) << bytes;
  }
  expect_weights_error(f64, "dtype F64 is not one meshtrain reads (F32, F16 or BF16)");
  // Neither weights file.
  const fs::path empty = copy(good, "no-weights");
  fs::remove(empty / "model.safetensors");
  expect_weights_error(empty, "holds neither model.safetensors nor model.safetensors.index.json");
}

// The mixtures of experts (Mixtral in bf16 over three shards, Qwen3-MoE in fp32 over two,
// written by the PyTorch reference with the per-expert names of published checkpoints)
// train from spec.model.init.from; `meshtrain export` writes the same tensors by the same
// names, which read back bit for bit. Their config.json keys that would change the math,
// a missing expert and transformers 5's fused in-memory experts are named.
TEST_F(HuggingFaceTest, AMixtureOfExpertsDirectoryTrainsExportsAndLoadsBackBitForBit) {
  WriteByteTokens();
  for (const auto& [family, flags] : {std::pair<std::string, std::string>{"mixtral", "--dtype bf16 --shards 3"},
                                      std::pair<std::string, std::string>{"qwen3_moe", "--shards 2"}}) {
    SCOPED_TRACE(family);
    const bool mixtral = family == "mixtral";
    const fs::path model = ReferenceModel(dir_ / (family + "-in"), family, flags);
    const fs::path checkpoints = dir_ / (family + "-checkpoints"), exported = dir_ / (family + "-out");
    const api::CheckedJob checked = LlamaJob(model, dir_ / "bytes.bin", checkpoints.string());
    ASSERT_TRUE(checked.ok()) << checked.errors.front().ToString();
    const api::ModelShape shape = api::ShapeOf(checked.job.spec.model);
    EXPECT_EQ(shape.family, family);
    EXPECT_EQ(shape.experts, 4);
    EXPECT_EQ(shape.experts_per_token, 2);
    EXPECT_EQ(shape.moe_intermediate, 28);
    EXPECT_EQ(shape.norm_topk_prob, mixtral);
    std::vector<float> trained;
    ASSERT_NO_FATAL_FAILURE(TrainAndExport(checked.job, model, shape, checkpoints, exported, &trained));
    const nlohmann::json config = nlohmann::json::parse(std::ifstream(exported / "config.json"));
    EXPECT_EQ(config.at("architectures")[0], mixtral ? "MixtralForCausalLM" : "Qwen3MoeForCausalLM");
    EXPECT_EQ(config.at("model_type"), family);
    EXPECT_EQ(config.at(mixtral ? "num_local_experts" : "num_experts"), 4);
    EXPECT_EQ(config.at("num_experts_per_tok"), 2);
    EXPECT_EQ(config.at(mixtral ? "intermediate_size" : "moe_intermediate_size"), 28);
    const std::map<std::string, std::vector<int64_t>> written = testing::TensorShapesIn(exported),
                                                      read = testing::TensorShapesIn(model);
    EXPECT_EQ(written, read) << "the tensors the directory came with, by the same names and shapes";
    const std::string sparse = mixtral ? "model.layers.1.block_sparse_moe." : "model.layers.1.mlp.";
    EXPECT_EQ(written.at(sparse + "gate.weight"), (std::vector<int64_t>{4, 40}));
    EXPECT_EQ(written.at(sparse + (mixtral ? "experts.3.w2.weight" : "experts.3.down_proj.weight")),
              (std::vector<int64_t>{40, 28}));
    EXPECT_EQ(written.contains("model.layers.1.self_attn.q_norm.weight"), !mixtral);
    EXPECT_EQ(LoadHuggingFace(exported.string(), shape), trained);
    const api::CheckedJob again = LlamaJob(exported, dir_ / "bytes.bin");
    ASSERT_TRUE(again.ok()) << again.errors.front().ToString();
    EXPECT_EQ(api::ShapeOf(again.job.spec.model), shape) << "the exported config.json gives the same shape";
  }

  // What a bad directory gets, before anything trains.
  const fs::path mixtral = dir_ / "mixtral-in", qwen = dir_ / "qwen3_moe-in";
  auto copy = [&](const fs::path& from, const std::string& name) {
    const fs::path to = dir_ / name;
    fs::copy(from, to, fs::copy_options::recursive);
    return to;
  };
  auto job_error = [&](const fs::path& model, const std::function<void(nlohmann::json&)>& edit) {
    nlohmann::json config = nlohmann::json::parse(std::ifstream(model / "config.json"));
    edit(config);
    std::ofstream(model / "config.json", std::ios::trunc) << config.dump();
    const api::CheckedJob checked = LlamaJob(model, dir_ / "bytes.bin");
    return checked.ok() ? std::string() : checked.errors.front().ToString();
  };
  struct Bad {
    fs::path from;
    std::function<void(nlohmann::json&)> edit;
    std::string want;
    std::string where = "config.json: ";  // what the error names before `want`
  };
  int n = 0;
  for (const Bad& b : std::vector<Bad>{
           {mixtral, [](auto& c) { c["router_jitter_noise"] = 0.1; }, "router_jitter_noise 0.1 is not implemented"},
           {mixtral,
            [](auto& c) {
              c["output_router_logits"] = true;  // the load-balancing loss, of a coefficient that must not be negative
              c["router_aux_loss_coef"] = -0.5;
            },
            "router_aux_loss_coef must not be negative"},
           {mixtral, [](auto& c) { c["num_experts_per_tok"] = 5; },
            "num_experts_per_tok 5 exceeds num_local_experts (4)"},
           // Dense blocks (mlp_only_layers, decoder_sparse_step) are read, with at least one
           // sparse block left (AQwen3MoeWithDenseBlocksTrainsExports... trains them); what
           // is not a block index, or no list, or a step below 1, is named.
           {qwen, [](auto& c) { c["mlp_only_layers"] = {2}; },
            "mlp_only_layers [2]: 2 is not a block index below 2 (num_hidden_layers)"},
           {qwen, [](auto& c) { c["mlp_only_layers"] = {-1}; },
            "mlp_only_layers [-1]: -1 is not a block index below 2 (num_hidden_layers)"},
           {qwen, [](auto& c) { c["mlp_only_layers"] = {0.5}; },
            "mlp_only_layers [0.5]: 0.5 is not a block index below 2 (num_hidden_layers)"},
           {qwen, [](auto& c) { c["mlp_only_layers"] = 0; }, "mlp_only_layers must be a list of block indices, got 0"},
           {qwen, [](auto& c) { c["decoder_sparse_step"] = 0; },
            "decoder_sparse_step must be a positive integer below 2^31, got 0"},
           {qwen, [](auto& c) { c["mlp_only_layers"] = {0, 1}; },
            "leaves no sparse block of the 2: such a model is Qwen3-MoE's attention with dense MLPs (family qwen3)",
            "spec.model.mlpOnlyLayers: "},
           {qwen, [](auto& c) { c["decoder_sparse_step"] = 3; },
            "leaves no sparse block of the 2: such a model is Qwen3-MoE's attention with dense MLPs (family qwen3)",
            "spec.model.decoderSparseStep: "},
           {qwen, [](auto& c) { c["mlp_only_layers"] = {1}; }, ""},   // block 0 sparse, 1 dense (job check only)
           {qwen, [](auto& c) { c["decoder_sparse_step"] = 2; }, ""},  // block 1 sparse, 0 dense
           {qwen, [](auto& c) { c["mlp_only_layers"] = nullptr; }, ""},  // Qwen3MoeConfig's None: no dense block
           {qwen, [](auto& c) { c["shared_expert_intermediate_size"] = 64; },
            "shared_expert_intermediate_size 64 is not implemented"},
           {qwen, [](auto& c) { c["max_window_layers"] = 1; }, ""},  // changes nothing without sliding windows
       }) {
    const std::string error = job_error(copy(b.from, "bad-" + std::to_string(n++)), b.edit);
    if (b.want.empty()) {
      EXPECT_EQ(error, "");
    } else {
      EXPECT_NE(error.find(b.where + b.want), std::string::npos)
          << "want \"" << b.where << b.want << "\", got \"" << error << "\"";
    }
  }
  auto weights_error = [&](const fs::path& model, const std::function<void(std::map<std::string, Tensor>&)>& edit) {
    const std::string shard = "model-00001-of-00002.safetensors";
    std::map<std::string, Tensor> tensors = ReadSafetensors((model / shard).string());
    edit(tensors);
    WriteSafetensors((model / shard).string(), tensors);
    // The index names what the shard holds now.
    const fs::path index = model / "model.safetensors.index.json";
    nlohmann::json map = nlohmann::json::parse(std::ifstream(index));
    nlohmann::json& weights = map.at("weight_map");
    for (auto it = weights.begin(); it != weights.end();) {
      it = it.value() == shard && !tensors.contains(it.key()) ? weights.erase(it) : std::next(it);
    }
    for (const auto& [name, t] : tensors) weights[name] = shard;
    std::ofstream(index, std::ios::trunc) << map.dump();
    try {
      CheckTrainable(LlamaJob(model, dir_ / "bytes.bin").job, 0, 1);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  const std::string expert = "model.layers.0.mlp.experts.1.up_proj.weight";
  const std::string missing = weights_error(copy(qwen, "no-expert"), [&](auto& t) { ASSERT_EQ(t.erase(expert), 1u); });
  EXPECT_NE(missing.find("tensor " + expert + " is missing"), std::string::npos) << missing;
  const std::string fused = weights_error(copy(qwen, "fused"), [](auto& t) {
    t["model.layers.0.mlp.experts.gate_up_proj"] = {{4, 40, 56}, std::vector<float>(4 * 40 * 56, 0.0f)};
  });
  EXPECT_NE(fused.find("tensor model.layers.0.mlp.experts.gate_up_proj is not part of a Qwen3-MoE of this shape"),
            std::string::npos)
      << fused;
}

// Qwen3-MoE with dense blocks, written by the PyTorch reference: mlp_only_layers [0] of 2
// blocks in fp32 over two shards (block 0 dense, 1 sparse), and decoder_sparse_step 2 with
// mlp_only_layers [2] (a block the step makes dense already) of 4 blocks in bf16 over
// three (blocks 1 and 3 sparse). A dense block is Qwen3MoeMLP: mlp.gate_proj, up_proj and
// down_proj, intermediate_size (76) wide, and no router or experts. Each trains from
// spec.model.init.from, starting from the directory's weights; `meshtrain export` writes
// config.json with both keys as they came and the tensors the directory came with, by the
// same names and shapes, which read back bit for bit and give the same shape again.
TEST_F(HuggingFaceTest, AQwen3MoeWithDenseBlocksTrainsExportsAndLoadsBackBitForBit) {
  WriteByteTokens();
  struct Case {
    std::string name, flags;
    int64_t layers, step;
    std::vector<int64_t> mlp_only, sparse;
  };
  for (const Case& c : {Case{"mlp-only", "--mlp-only-layers 0 --shards 2", 2, 1, {0}, {1}},
                        Case{"step", "--layers 4 --sparse-step 2 --mlp-only-layers 2 --dtype bf16 --shards 3", 4, 2,
                             {2}, {1, 3}}}) {
    SCOPED_TRACE(c.name);
    const fs::path model = ReferenceModel(dir_ / (c.name + "-in"), "qwen3_moe", c.flags);
    const nlohmann::json given = nlohmann::json::parse(std::ifstream(model / "config.json"));
    ASSERT_EQ(given.at("decoder_sparse_step"), c.step);
    ASSERT_EQ(given.at("mlp_only_layers"), nlohmann::json(c.mlp_only));
    const fs::path checkpoints = dir_ / (c.name + "-checkpoints"), exported = dir_ / (c.name + "-out");
    const api::CheckedJob checked = LlamaJob(model, dir_ / "bytes.bin", checkpoints.string());
    ASSERT_TRUE(checked.ok()) << checked.errors.front().ToString();
    const api::ModelShape shape = api::ShapeOf(checked.job.spec.model);
    EXPECT_EQ(shape.family, "qwen3_moe");
    EXPECT_EQ(shape.layers, c.layers);
    EXPECT_EQ(shape.decoder_sparse_step, c.step);
    EXPECT_EQ(shape.mlp_only_layers, c.mlp_only);
    EXPECT_EQ(shape.intermediate, 76);
    EXPECT_EQ(shape.moe_intermediate, 28);
    std::vector<int64_t> sparse;
    for (int64_t l = 0; l < shape.layers; ++l) {
      if (!shape.DenseBlock(l)) sparse.push_back(l);
    }
    EXPECT_EQ(sparse, c.sparse) << "the sparse blocks, as transformers decides them";
    EXPECT_EQ(shape.DenseBlocks(), c.layers - int64_t(c.sparse.size()));
    const std::string described = api::DescribeShape(shape);
    EXPECT_NE(described.find("dense MLP 76 in blocks 0"), std::string::npos) << described;
    std::vector<float> trained;
    ASSERT_NO_FATAL_FAILURE(TrainAndExport(checked.job, model, shape, checkpoints, exported, &trained));
    const nlohmann::json config = nlohmann::json::parse(std::ifstream(exported / "config.json"));
    EXPECT_EQ(config.at("architectures")[0], "Qwen3MoeForCausalLM");
    EXPECT_EQ(config.at("num_hidden_layers"), c.layers);
    EXPECT_EQ(config.at("decoder_sparse_step"), c.step);
    EXPECT_EQ(config.at("mlp_only_layers"), nlohmann::json(c.mlp_only));
    EXPECT_EQ(config.at("intermediate_size"), 76) << "the dense blocks' width";
    EXPECT_EQ(config.at("moe_intermediate_size"), 28);
    const std::map<std::string, std::vector<int64_t>> written = testing::TensorShapesIn(exported),
                                                      read = testing::TensorShapesIn(model);
    EXPECT_EQ(written, read) << "the tensors the directory came with, by the same names and shapes";
    for (int64_t l = 0; l < c.layers; ++l) {
      const std::string mlp = "model.layers." + std::to_string(l) + ".mlp.";
      const bool dense = std::find(c.sparse.begin(), c.sparse.end(), l) == c.sparse.end();
      SCOPED_TRACE(mlp + (dense ? " dense" : " sparse"));
      EXPECT_EQ(written.contains(mlp + "gate.weight"), !dense);
      EXPECT_EQ(written.contains(mlp + "gate_proj.weight"), dense);
      EXPECT_EQ(written.contains(mlp + "up_proj.weight"), dense);
      EXPECT_EQ(written.contains(mlp + "down_proj.weight"), dense);
      int experts = 0;
      for (const auto& [name, shape_of] : written) experts += name.starts_with(mlp + "experts.");
      EXPECT_EQ(experts, dense ? 0 : 4 * 3);
      if (dense) {
        EXPECT_EQ(written.at(mlp + "gate_proj.weight"), (std::vector<int64_t>{76, 40}));
        EXPECT_EQ(written.at(mlp + "up_proj.weight"), (std::vector<int64_t>{76, 40}));
        EXPECT_EQ(written.at(mlp + "down_proj.weight"), (std::vector<int64_t>{40, 76}));
      } else {
        EXPECT_EQ(written.at(mlp + "gate.weight"), (std::vector<int64_t>{4, 40}));
        EXPECT_EQ(written.at(mlp + "experts.3.down_proj.weight"), (std::vector<int64_t>{40, 28}));
      }
    }
    EXPECT_EQ(LoadHuggingFace(exported.string(), shape), trained);
    const api::CheckedJob again = LlamaJob(exported, dir_ / "bytes.bin");
    ASSERT_TRUE(again.ok()) << again.errors.front().ToString();
    EXPECT_EQ(api::ShapeOf(again.job.spec.model), shape) << "the exported config.json gives the same shape";
    EXPECT_EQ(Trainer(again.job).Weights(), trained);
  }
}

// A checkpoint written under expert parallelism 2 (`meshtrain run` of two ranks, each
// holding 2 of the 4 experts of every block, the rest sharded over both) exports, through
// `meshtrain export`, as the per-expert tensors of published checkpoints (Mixtral's
// block_sparse_moe.experts.{e}.w1, w3 and w2, Qwen3-MoE's mlp.experts.{e}.gate_proj,
// up_proj and down_proj, every expert of every block), and file for file byte for byte as
// the export of the same weights from one rank: those a single-rank run resumed from the
// checkpoint holds.
TEST_F(HuggingFaceTest, AnExpertParallelCheckpointExportsAsOneRanksWeightsDo) {
  WriteByteTokens();
  for (const std::string family : {"mixtral", "qwen3_moe"}) {
    SCOPED_TRACE(family);
    const bool mixtral = family == "mixtral";
    const fs::path model = ReferenceModel(dir_ / (family + "-in"), family, "");
    const fs::path checkpoints = dir_ / (family + "-ep2-checkpoints");
    nlohmann::json manifest = LlamaManifest(model, dir_ / "bytes.bin", checkpoints.string());
    manifest["metadata"]["name"] = mixtral ? "ep2-mixtral" : "ep2-qwen3-moe";
    manifest["spec"]["gpusPerNode"] = 2;
    manifest["spec"]["parallelism"] = {{"expertParallelDegree", 2}};
    manifest["spec"]["training"]["globalBatchTokens"] = 2 * 2 * 32;  // each rank's 2 sequences a step
    const api::CheckedJob ep2 = api::CheckTrainingJob(manifest, "test", 0, api::ModelDirectory::kRequired);
    ASSERT_TRUE(ep2.ok()) << ep2.errors.front().ToString();
    const fs::path job = dir_ / (family + "-ep2.json"), log = dir_ / (family + "-ep2.log");
    std::ofstream(job) << manifest.dump(2);
    const std::string run = std::string("MESHTRAIN_WORKER=") + MESHTRAIN_WORKER + " " + MESHTRAIN_CLI + " run " +
                            job.string() + " --sample-tokens 0 > " + log.string() + " 2>&1";
    ASSERT_EQ(std::system(run.c_str()), 0) << run << "\n" << Bytes(log);
    const fs::path step = checkpoints / "step-00000003";
    const nlohmann::json meta = nlohmann::json::parse(std::ifstream(step / "metadata.json"));
    ASSERT_EQ(meta.at("layout").value("expert", 1), 2) << "written under EP 2: " << meta.at("layout").dump();
    ASSERT_EQ(meta.at("files").size(), 2u);
    EXPECT_NE(meta.at("files")[0].at("expert"), meta.at("files")[1].at("expert")) << "one file per expert rank";

    const fs::path from_ep2 = dir_ / (family + "-ep2-out"), from_one = dir_ / (family + "-one-out");
    const std::string export_command = std::string(MESHTRAIN_CLI) + " export " + step.string() + " " +
                                       from_ep2.string() + " --max-shard-size 50KB > " + log.string() + " 2>&1";
    ASSERT_EQ(std::system(export_command.c_str()), 0) << export_command << "\n" << Bytes(log);

    // One rank resumed from the checkpoint holds its weights; exported as the CLI exports
    // (F32, shards of at most 50 KB), straight from them.
    const api::CheckedJob single = LlamaJob(model, dir_ / "bytes.bin", checkpoints.string());
    ASSERT_TRUE(single.ok()) << single.errors.front().ToString();
    const api::ModelShape shape = api::ShapeOf(single.job.spec.model);
    ASSERT_EQ(shape.experts, 4);
    Trainer one(single.job);
    ASSERT_EQ(one.resumed_from(), std::optional<int64_t>(3));
    const std::vector<float> weights = one.Weights();
    EXPECT_NE(weights, LoadHuggingFace(model.string(), shape)) << "the ranks trained";
    ExportHuggingFace(from_one.string(), shape, {Dtype::kF32, 50'000, ""},
                      [&](int, int64_t first, int64_t count, float* values) {
                        std::copy(weights.begin() + first, weights.begin() + first + count, values);
                      });

    std::set<std::string> files_ep2, files_one;
    for (const auto& entry : fs::directory_iterator(from_ep2)) files_ep2.insert(entry.path().filename().string());
    for (const auto& entry : fs::directory_iterator(from_one)) files_one.insert(entry.path().filename().string());
    EXPECT_EQ(files_ep2, files_one);
    EXPECT_GT(files_ep2.size(), 3u) << "config.json, the index and several shards";
    for (const std::string& file : files_one) {
      if (files_ep2.contains(file)) {
        EXPECT_EQ(Bytes(from_ep2 / file), Bytes(from_one / file)) << file;
      }
    }

    // Every expert of every block, by its published names, each expert rank's its own.
    const nlohmann::json index = nlohmann::json::parse(std::ifstream(from_ep2 / "model.safetensors.index.json"));
    std::map<std::string, Tensor> tensors;
    for (const std::string& file : files_ep2) {
      if (file.ends_with(".safetensors")) tensors.merge(ReadSafetensors((from_ep2 / file).string()));
    }
    EXPECT_EQ(index.at("weight_map").size(), tensors.size());
    const std::string sparse = mixtral ? "block_sparse_moe." : "mlp.";
    const std::vector<std::string> matrices = mixtral ? std::vector<std::string>{"w1", "w3", "w2"}
                                                      : std::vector<std::string>{"gate_proj", "up_proj", "down_proj"};
    int expert_tensors = 0;
    for (const auto& [name, t] : tensors) expert_tensors += name.find(".experts.") != std::string::npos;
    EXPECT_EQ(expert_tensors, 2 * 4 * 3) << "2 blocks of 4 experts of 3 matrices";
    for (int l = 0; l < 2; ++l) {
      for (int e = 0; e < 4; ++e) {
        for (size_t m = 0; m < matrices.size(); ++m) {
          const std::string name = "model.layers." + std::to_string(l) + "." + sparse + "experts." + std::to_string(e) +
                                   "." + matrices[m] + ".weight";
          ASSERT_TRUE(tensors.contains(name)) << name;
          EXPECT_EQ(tensors.at(name).shape, m == 2 ? (std::vector<int64_t>{40, 28}) : (std::vector<int64_t>{28, 40}))
              << name;
        }
      }
      // Each expert its own values: no expert rank's written in place of the other's.
      const std::string a = "model.layers." + std::to_string(l) + "." + sparse + "experts.";
      for (int e = 0; e < 4; ++e) {
        for (int f = e + 1; f < 4; ++f) {
          for (const std::string& m : matrices) {
            EXPECT_NE(tensors.at(a + std::to_string(e) + "." + m + ".weight").values,
                      tensors.at(a + std::to_string(f) + "." + m + ".weight").values)
                << "block " << l << ", experts " << e << " and " << f << ", " << m;
          }
        }
      }
    }
    EXPECT_EQ(LoadHuggingFace(from_ep2.string(), shape), weights);
  }
}

}  // namespace
}  // namespace meshtrain::train
