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
// frequency, head mapping or norm is not. A Qwen3-MoE with dense blocks (mlp_only_layers,
// decoder_sparse_step) is held to the same bounds, and each step's load-balancing loss to
// the reference's, over the sparse blocks only (CheckDenseBlocks).

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <ostream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "api/manifest.h"
#include "api/model_shape.h"
#include "worker/train/data_loader.h"
#include "worker/train/huggingface.h"
#include "worker/train/safetensors.h"
#include "worker/train/schedule.h"
#include "worker/train/token_file.h"
#include "worker/train/trainer.h"
#include "tests/support/safetensors_shapes.h"

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
    std::vector<std::set<int>> loaded_blocks;  // each step's blocks with an expert load: the sparse ones
    trainer.Run([&](const StepReport& r) {
      losses.push_back(r.loss);
      if (r.aux_loss) aux_losses.push_back(*r.aux_loss);
      loaded_blocks.emplace_back();
      for (const auto& [block, load] : r.expert_load) loaded_blocks.back().insert(block);
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
    if (shape.DenseBlocks() > 0) CheckDenseBlocks(shape, model, exported, result, loaded_blocks, aux_losses);
  }

  // A Qwen3-MoE whose decoder_sparse_step or mlp_only_layers make some blocks dense: the
  // blocks the reference made sparse (as transformers' Qwen3MoeDecoderLayer decides) are
  // those ModelShape::DenseBlock leaves sparse, and the only ones with an expert load each
  // step; each step's load-balancing loss (before its coefficient), over the sparse blocks'
  // router logits only, is the reference's; the export's config.json keeps both keys, and
  // its tensors are a dense block's MLP (mlp.gate_proj, up_proj, down_proj, intermediate
  // wide) with no router or experts, and a sparse block's router and experts with no dense MLP.
  static void CheckDenseBlocks(const api::ModelShape& shape, const fs::path& model, const fs::path& exported,
                               const Json& result, const std::vector<std::set<int>>& loaded_blocks,
                               const std::vector<double>& aux_losses) {
    std::set<int> sparse;
    for (int l = 0; l < int(shape.layers); ++l) {
      if (!shape.DenseBlock(l)) sparse.insert(l);
    }
    ASSERT_TRUE(result.contains("sparse_blocks")) << "the reference saw no dense block";
    EXPECT_EQ(result.at("sparse_blocks").get<std::set<int>>(), sparse) << "transformers' sparse blocks and ours";
    for (size_t step = 0; step < loaded_blocks.size(); ++step) {
      EXPECT_EQ(loaded_blocks[step], sparse) << "step " << step + 1 << ": the blocks with experts";
    }
    const Json& want_aux = result.at("aux_losses");
    ASSERT_EQ(want_aux.size(), loaded_blocks.size());
    if (!want_aux.front().is_null()) {
      ASSERT_EQ(aux_losses.size(), want_aux.size());
      double worst = 0;
      for (size_t i = 0; i < aux_losses.size(); ++i) {
        const double want = want_aux[i];
        worst = std::max(worst, std::abs(aux_losses[i] - want) / want);
        EXPECT_NEAR(aux_losses[i], want, 1e-4 * want) << "step " << i + 1 << ": the load-balancing loss";
      }
      std::string blocks;
      for (int l : sparse) blocks += " " + std::to_string(l);
      std::printf("qwen3_moe, sparse blocks%s of %d: load-balancing loss worst error %.2e of PyTorch's\n",
                  blocks.c_str(), int(shape.layers), worst);
    }

    const Json given = Json::parse(std::ifstream(model / "config.json"));
    const Json written = Json::parse(std::ifstream(exported / "config.json"));
    EXPECT_EQ(written.at("decoder_sparse_step"), given.at("decoder_sparse_step"));
    EXPECT_EQ(written.at("mlp_only_layers"), given.at("mlp_only_layers"));
    EXPECT_EQ(written.at("intermediate_size"), given.at("intermediate_size")) << "the dense blocks' width";
    EXPECT_EQ(written.at("moe_intermediate_size"), given.at("moe_intermediate_size"));

    std::map<std::string, std::vector<int64_t>> tensors = testing::TensorShapesIn(exported);
    const int64_t C = shape.hidden, I = shape.intermediate, E = shape.experts;
    for (int l = 0; l < int(shape.layers); ++l) {
      const std::string mlp = "model.layers." + std::to_string(l) + ".mlp.";
      const bool dense = !sparse.contains(l);
      EXPECT_EQ(tensors.contains(mlp + "gate.weight"), !dense) << mlp << "gate.weight: a sparse block's router";
      EXPECT_EQ(tensors.contains(mlp + "experts.0.gate_proj.weight"), !dense) << l;
      EXPECT_EQ(tensors.contains(mlp + "gate_proj.weight"), dense) << mlp << "gate_proj.weight: a dense block's MLP";
      if (dense) {
        EXPECT_EQ(tensors[mlp + "gate_proj.weight"], (std::vector<int64_t>{I, C})) << l;
        EXPECT_EQ(tensors[mlp + "up_proj.weight"], (std::vector<int64_t>{I, C})) << l;
        EXPECT_EQ(tensors[mlp + "down_proj.weight"], (std::vector<int64_t>{C, I})) << l;
      } else {
        EXPECT_EQ(tensors[mlp + "gate.weight"], (std::vector<int64_t>{E, C})) << l;
        EXPECT_FALSE(tensors.contains(mlp + "up_proj.weight")) << l;
      }
    }
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
  const char* name = nullptr;  // the family where nullptr
  const char* Name() const { return name ? name : family; }
};

// The case as gtest (and so ctest's test name) shows it.
void PrintTo(const LoadBalancingCase& c, std::ostream* out) { *out << c.Name(); }

class TorchParityLoadBalancing : public TorchParity, public ::testing::WithParamInterface<LoadBalancingCase> {};

TEST_P(TorchParityLoadBalancing, TrainsAsPyTorchDoes) { Check(GetParam().family, GetParam().init_flags, 0.5); }

INSTANTIATE_TEST_SUITE_P(MixturesOfExperts, TorchParityLoadBalancing,
                         ::testing::Values(LoadBalancingCase{"mixtral", ""}, LoadBalancingCase{"qwen3_moe", "--shards 2"}),
                         [](const ::testing::TestParamInfo<LoadBalancingCase>& test) {
                           return std::string(test.param.Name());
                         });

// Qwen3-MoE with dense blocks, the load-balancing loss on (0.5) over the sparse blocks'
// router logits only: mlp_only_layers [0] of 2 blocks (block 0 a dense MLP of 76 units,
// block 1 sparse: one block's logits); decoder_sparse_step 2 of 4 (blocks 1 and 3 sparse,
// their logits concatenated, 0 and 2 dense); and both keys, of 6 blocks in bf16 over three
// shards (step 2 with mlp_only_layers [3]: blocks 1 and 5 sparse, 0, 2, 3 and 4 dense).
// Held to the bounds above, and by CheckDenseBlocks to transformers' choice of sparse
// blocks, the reference's load-balancing loss and the export's names.
INSTANTIATE_TEST_SUITE_P(
    DenseBlocks, TorchParityLoadBalancing,
    ::testing::Values(
        LoadBalancingCase{"qwen3_moe", "--mlp-only-layers 0 --shards 2", "mlp_only_layers"},
        LoadBalancingCase{"qwen3_moe", "--layers 4 --sparse-step 2", "decoder_sparse_step"},
        LoadBalancingCase{"qwen3_moe", "--layers 6 --sparse-step 2 --mlp-only-layers 3 --dtype bf16 --shards 3",
                          "both"}),
    [](const ::testing::TestParamInfo<LoadBalancingCase>& test) { return std::string(test.param.Name()); });

}  // namespace
}  // namespace meshtrain::train
