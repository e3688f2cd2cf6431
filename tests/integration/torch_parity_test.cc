// The Llama class, its mixtures of experts too, against an independent implementation of
// the same math: PyTorch in float64 (tests/data/torch_llama_reference.py, Debian's
// python3-torch), written from
// transformers' modeling code. Both start from the same Hugging Face directory, which the
// reference writes and meshtrain reads through spec.model.init.from (config.json gives the
// shape), and train the same batches with the same schedule: AdamW with decay on every
// matrix, global-norm clipping, two micro-batches a step. meshtrain trains on one CPU rank
// in fp32 (the layouts are held to one rank by engine_check) and exports a Hugging Face
// directory, which the reference reads back as transformers would.
//
// Bounds, as GPT-2 meets them: every step's loss within 1e-4 relative of the float64 run,
// and the exported weights within 4e-4 of the distance training moved them. fp32 against
// float64 over 12 steps is far inside both (the test prints the figures); a wrong RoPE
// frequency, head mapping or norm is not.

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "api/manifest.h"
#include "api/model_shape.h"
#include "worker/train/data_loader.h"
#include "worker/train/huggingface.h"
#include "worker/train/schedule.h"
#include "worker/train/token_file.h"
#include "worker/train/trainer.h"

namespace meshtrain::train {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

constexpr int kSteps = 12, kSeq = 32, kMicroBatch = 2, kAccumulation = 2;

class TorchParity : public ::testing::Test {
 protected:
  void SetUp() override {
    if (std::system("/usr/bin/python3 -c 'import torch' 2>/dev/null") != 0) {
      GTEST_FAIL() << "Debian's python3-torch is missing: scripts/setup.sh installs it";
    }
    dir_ = fs::temp_directory_path() / ("meshtrain-torch-parity-" + std::to_string(::getpid()));
    fs::create_directories(dir_);
    WriteTextAsTokenFiles(MESHTRAIN_CORPUS, (dir_ / "train.bin").string(), (dir_ / "val.bin").string(), 0.1);
  }
  void TearDown() override { fs::remove_all(dir_); }

  static void Python(const std::string& args) {
    const std::string command = "/usr/bin/python3 tests/data/torch_llama_reference.py " + args;
    ASSERT_EQ(std::system(command.c_str()), 0) << command;
  }

  api::TrainingJob Job(const fs::path& model) const {
    const Json manifest = {
        {"apiVersion", "meshtrain.dev/v1alpha1"},
        {"kind", "TrainingJob"},
        {"metadata", {{"name", "parity"}}},
        {"spec",
         {{"image", "meshtrain:test"},
          {"nodes", 1},
          {"gpusPerNode", 1},
          {"model", {{"seqLen", kSeq}, {"init", {{"from", model.string()}}}}},
          {"data", {{"train", (dir_ / "train.bin").string()}}},
          {"training",
           {{"steps", kSteps}, {"microBatchSize", kMicroBatch},
            {"globalBatchTokens", kMicroBatch * kSeq * kAccumulation}, {"learningRate", 3e-3}, {"warmupSteps", 3},
            {"weightDecay", 0.1}, {"gradClip", 1.0}, {"seed", 11}, {"precision", "fp32"}, {"evalInterval", 0}}}}}};
    const api::CheckedJob checked = api::CheckTrainingJob(manifest, "parity", 0, api::ModelDirectory::kRequired);
    if (!checked.ok()) throw std::runtime_error(checked.errors.front().ToString());
    return checked.job;
  }

  // The batches the Trainer reads on one rank, and each step's learning rate.
  Json Batches(const api::TrainingJob& job) const {
    DataOptions options;
    options.batch = kMicroBatch;
    options.seq = kSeq;
    options.vocab_size = uint32_t(*job.spec.model.vocab_size);
    options.seed = uint64_t(job.spec.training.seed);
    DataLoader data({(dir_ / "train.bin").string()}, options);
    std::vector<int32_t> inputs(kMicroBatch * kSeq), targets(kMicroBatch * kSeq);
    Json steps = Json::array();
    for (int step = 0; step < kSteps; ++step) {
      Json micro_batches = Json::array();
      for (int m = 0; m < kAccumulation; ++m) {
        data.Next(inputs.data(), targets.data());
        Json in = Json::array(), out = Json::array();
        for (int b = 0; b < kMicroBatch; ++b) {
          in.push_back(std::vector<int32_t>(inputs.begin() + b * kSeq, inputs.begin() + (b + 1) * kSeq));
          out.push_back(std::vector<int32_t>(targets.begin() + b * kSeq, targets.begin() + (b + 1) * kSeq));
        }
        micro_batches.push_back({{"inputs", in}, {"targets", out}});
      }
      steps.push_back({{"lr", LearningRate(job.spec.training, step)}, {"micro_batches", micro_batches}});
    }
    const api::TrainingSpec& t = job.spec.training;
    return {{"weight_decay", t.weight_decay}, {"grad_clip", t.grad_clip}, {"beta1", 0.9}, {"beta2", 0.95},
            {"epsilon", 1e-8}, {"steps", steps}};
  }

  // `aux`: a mixture's load-balancing loss on, of this coefficient, by init's --aux (which
  // writes output_router_logits true and router_aux_loss_coef into config.json): the job
  // takes the coefficient from there, and every step reports the loss it added.
  void Check(const std::string& family, const std::string& init_flags, std::optional<double> aux = std::nullopt) {
    const fs::path model = dir_ / (family + "-model"), exported = dir_ / (family + "-exported");
    Python("init " + model.string() + " --family " + family + " " + init_flags +
           (aux ? " --aux " + Json(*aux).dump() : ""));
    const api::TrainingJob job = Job(model);
    const api::ModelShape shape = api::ShapeOf(job.spec.model);
    EXPECT_EQ(shape.family, family) << "config.json gave the family";
    EXPECT_EQ(job.spec.training.router_aux_loss_coef, aux) << family << ": the load-balancing loss by config.json";
    std::ofstream(dir_ / "batches.json") << Batches(job).dump();

    Trainer trainer(job);
    std::vector<double> losses, aux_losses;
    trainer.Run([&](const StepReport& r) {
      losses.push_back(r.loss);
      if (r.aux_loss) aux_losses.push_back(*r.aux_loss);
    });
    EXPECT_EQ(aux_losses.size(), aux ? losses.size() : 0u) << family << ": a load-balancing loss each step, or none";
    const std::vector<float> weights = trainer.Weights();
    ExportHuggingFace(exported.string(), shape, {Dtype::kF32, uint64_t(1) << 16, ""},
                      [&](int, int64_t first, int64_t count, float* values) {
                        std::copy(weights.begin() + first, weights.begin() + first + count, values);
                      });
    Python("train " + model.string() + " " + (dir_ / "batches.json").string() + " " + (dir_ / "result.json").string() +
           " --exported " + exported.string());
    const Json result = Json::parse(std::ifstream(dir_ / "result.json"));
    if (shape.experts > 0) {  // the reference's dense and dispatch forms of the sparse MLP agree
      EXPECT_LT(double(result.at("moe_forms")), 1e-12) << family;
    }
    ASSERT_EQ(result.at("losses").size(), losses.size());
    double worst = 0;
    for (size_t i = 0; i < losses.size(); ++i) {
      const double want = result.at("losses")[i];
      worst = std::max(worst, std::abs(losses[i] - want) / want);
      EXPECT_NEAR(losses[i], want, 1e-4 * want) << family << " step " << i + 1;
    }
    const double ratio = result.at("distance_ratio");
    std::printf("%s (%s): %d steps, loss %.6f -> %.6f (PyTorch float64 %.6f -> %.6f), worst loss error %.2e; "
                "exported weights off by %.2e of the distance training moved them\n",
                family.c_str(), api::DescribeShape(shape).c_str(), kSteps, losses.front(), losses.back(),
                double(result.at("losses").front()), double(result.at("losses").back()), worst, ratio);
    if (!aux_losses.empty()) {
      std::printf("%s: load-balancing loss %.4f -> %.4f, x %g added to each step's loss\n", family.c_str(),
                  aux_losses.front(), aux_losses.back(), *aux);
    }
    EXPECT_LT(ratio, 4e-4) << family;
    EXPECT_LT(losses.back(), losses.front() - 0.5) << family << ": the model learns";
  }

  fs::path dir_;
};

// Llama: an untied head, 4 query heads over 2 key/value heads of 12 channels (wider than
// hidden / heads), llama3 RoPE scaling; the directory's weights in bf16, over 3 shards.
TEST_F(TorchParity, LlamaTrainsAsPyTorchDoes) { Check("llama", "--dtype bf16 --shards 3"); }

// Qwen2: biases on q, k and v, a tied head, linear RoPE scaling, one file in fp32.
TEST_F(TorchParity, Qwen2TrainsAsPyTorchDoes) { Check("qwen2", ""); }

// Qwen3: q_norm and k_norm on every head of q and k before RoPE (weights away from 1),
// heads x head_dim (48) past hidden (40), a tied head, no RoPE scaling, two shards in fp32.
TEST_F(TorchParity, Qwen3TrainsAsPyTorchDoes) { Check("qwen3", "--tied 1 --shards 2"); }

// Mixtral: a mixture of 4 experts of 28 units, 2 a token, their weights renormalised;
// the router and each expert's w1, w3 and w2 by the names of published checkpoints, in bf16
// over 3 shards.
TEST_F(TorchParity, MixtralTrainsAsPyTorchDoes) { Check("mixtral", "--dtype bf16 --shards 3"); }

// Qwen3-MoE: Qwen3's attention (q_norm, k_norm) and 4 experts, 2 a token, without
// norm_topk_prob (the chosen experts' softmax probabilities as they are), beside an unused
// dense intermediate_size; two shards in fp32.
TEST_F(TorchParity, Qwen3MoeTrainsAsPyTorchDoes) { Check("qwen3_moe", "--shards 2"); }

// The load-balancing loss: config.json's output_router_logits true with router_aux_loss_coef
// 0.5 turns it on, and each micro-batch's loss is the cross-entropy plus 0.5 x
// load_balancing_loss_func of every block's router logits, as transformers 4.x adds it (one
// softmax over every block's logits concatenated, the top k, E x the sum over experts of
// the share of the k choices x the mean probability). Mixtral, whose top k are
// renormalised, in fp32 in one file; Qwen3-MoE, whose are not (the loss reads the softmax
// either way), with q_norm and k_norm, over two shards.
struct LoadBalancingCase {
  const char* family;
  const char* init_flags;
};

// The case as gtest (and so ctest's test name) shows it.
void PrintTo(const LoadBalancingCase& c, std::ostream* out) { *out << c.family; }

class TorchParityLoadBalancing : public TorchParity, public ::testing::WithParamInterface<LoadBalancingCase> {};

TEST_P(TorchParityLoadBalancing, TrainsAsPyTorchDoes) { Check(GetParam().family, GetParam().init_flags, 0.5); }

INSTANTIATE_TEST_SUITE_P(MixturesOfExperts, TorchParityLoadBalancing,
                         ::testing::Values(LoadBalancingCase{"mixtral", ""}, LoadBalancingCase{"qwen3_moe", "--shards 2"}),
                         [](const ::testing::TestParamInfo<LoadBalancingCase>& test) {
                           return std::string(test.param.family);
                         });

}  // namespace
}  // namespace meshtrain::train
