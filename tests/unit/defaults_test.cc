// Defaults derived from what the user wrote always fit it: only what the user wrote
// can be rejected. And every field set that the engine does not act on yet is warned
// about, never silently accepted.

#include <random>
#include <string>

#include <gtest/gtest.h>

#include "api/json_codec.h"
#include "api/layout.h"
#include "api/manifest.h"

namespace meshtrain::api {
namespace {

using Json = nlohmann::json;

// Only the required fields: everything else is left to the defaults.
Json Minimal() {
  return {{"apiVersion", "meshtrain.dev/v1alpha1"},
          {"kind", "TrainingJob"},
          {"metadata", {{"name", "job"}}},
          {"spec", {{"image", "meshtrain:1"}, {"model", {{"preset", "gpt2-124m"}}}, {"data", {{"train", "/d/*.bin"}}}}}};
}

CheckedJob Check(const Json& manifest) {
  CheckedJob job = CheckTrainingJob(manifest, "job.yaml", 0);
  for (const FieldError& e : job.errors) ADD_FAILURE() << e.ToString();
  return job;
}

const DerivedDefault* Derived(const CheckedJob& job, const std::string& field) {
  for (const DerivedDefault& d : job.defaults) {
    if (d.field == field) return &d;
  }
  return nullptr;
}

std::vector<std::string> WarnedPaths(const CheckedJob& job) {
  std::vector<std::string> paths;
  for (const FieldError& w : job.warnings) paths.push_back(w.path);
  return paths;
}

TEST(Defaults, WarmupOfAShortJobFitsItsSteps) {
  Json manifest = Minimal();
  manifest["spec"]["training"] = {{"steps", 10}};
  const CheckedJob job = Check(manifest);
  EXPECT_EQ(job.job.spec.training.warmup_steps, 1);
  const DerivedDefault* warmup = Derived(job, "spec.training.warmupSteps");
  ASSERT_NE(warmup, nullptr);
  EXPECT_EQ(warmup->value, "1");
  EXPECT_EQ(warmup->reason, "a tenth of spec.training.steps (10), at most 100");

  manifest["spec"]["training"]["steps"] = 5000;
  EXPECT_EQ(Check(manifest).job.spec.training.warmup_steps, 100);  // the usual warmup, once it fits
}

TEST(Defaults, AWrittenWarmupIsStillChecked) {
  Json manifest = Minimal();
  manifest["spec"]["training"] = {{"steps", 10}, {"warmupSteps", 20}};
  const CheckedJob job = CheckTrainingJob(manifest, "job.yaml", 0);
  ASSERT_EQ(job.errors.size(), 1u);
  EXPECT_EQ(job.errors[0].ToString(), "spec.training.warmupSteps: must not exceed spec.training.steps (10), got 20");
  EXPECT_EQ(Derived(job, "spec.training.warmupSteps"), nullptr);
}

// The case: 160 GPUs, TP 8, seqLen 2048 and no batch fields. 8 x 2048 x 20 ranks is
// 327680 tokens per micro-step; two of them (655360) are nearer 524288 than one.
TEST(Defaults, GlobalBatchIsTheMultipleOfAMicroStepNearestHalfAMillion) {
  Json manifest = Minimal();
  manifest["spec"]["nodes"] = 20;
  manifest["spec"]["gpusPerNode"] = 8;
  manifest["spec"]["model"] = {{"preset", "gpt2-350m"}, {"seqLen", 2048}};  // 16 heads
  manifest["spec"]["parallelism"] = {{"tensorParallelDegree", 8}};
  const CheckedJob job = Check(manifest);
  EXPECT_EQ(job.job.spec.training.global_batch_tokens, 655360);
  EXPECT_EQ(job.job.spec.training.micro_batch_size, 8);
  const DerivedDefault* batch = Derived(job, "spec.training.globalBatchTokens");
  ASSERT_NE(batch, nullptr);
  EXPECT_EQ(batch->reason,
            "the multiple of microBatchSize x seqLen x data-parallel ranks (8 x 2048 x 20 = 327680) nearest to 524288");

  manifest["spec"]["training"] = {{"microBatchSize", 64}};  // one micro-step is already past 0.5M
  EXPECT_EQ(Check(manifest).job.spec.training.global_batch_tokens, 64 * 2048 * 20);
}

TEST(Defaults, MicroBatchDividesAWrittenGlobalBatch) {
  Json manifest = Minimal();
  manifest["spec"]["nodes"] = 2;
  manifest["spec"]["gpusPerNode"] = 8;  // 16 data-parallel ranks of 1024 tokens per sequence
  manifest["spec"]["training"] = {{"globalBatchTokens", 3 * 1024 * 16}};
  CheckedJob job = Check(manifest);
  EXPECT_EQ(job.job.spec.training.micro_batch_size, 3);
  ASSERT_NE(Derived(job, "spec.training.microBatchSize"), nullptr);

  manifest["spec"]["training"]["globalBatchTokens"] = 524288;  // 32 sequences per rank: 4 steps of 8
  EXPECT_EQ(Check(manifest).job.spec.training.micro_batch_size, 8);

  // No micro-batch fits: the global batch the user wrote is what is wrong.
  manifest["spec"]["training"]["globalBatchTokens"] = 1000;
  job = CheckTrainingJob(manifest, "job.yaml", 0);
  ASSERT_EQ(job.errors.size(), 1u);
  EXPECT_EQ(job.errors[0].ToString(),
            "spec.training.globalBatchTokens: must be a multiple of microBatchSize x seqLen x data-parallel ranks "
            "(1 x 1024 x 16 = 16384), got 1000");
}

TEST(Defaults, BothBatchFieldsWrittenAreCheckedAsWritten) {
  Json manifest = Minimal();
  manifest["spec"]["training"] = {{"globalBatchTokens", 4096}, {"microBatchSize", 8}};  // 8 x 1024 > 4096
  const CheckedJob job = CheckTrainingJob(manifest, "job.yaml", 0);
  ASSERT_EQ(job.errors.size(), 1u);
  EXPECT_EQ(job.errors[0].path, "spec.training.globalBatchTokens");
  EXPECT_TRUE(job.defaults.size() == 1 && job.defaults[0].field == "spec.training.warmupSteps");
}

// An SMP v2 config holds only the offloading keys: checkpointing comes from its training script.
TEST(Defaults, PastedSmpOffloadingConfigTurnsCheckpointingOn) {
  Json manifest = Minimal();
  manifest["spec"]["parallelism"] = {{"sm_activation_offloading", true}, {"activation_loading_horizon", 2}};
  const CheckedJob job = Check(manifest);
  EXPECT_TRUE(job.job.spec.parallelism.activation_checkpointing);
  const DerivedDefault* on = Derived(job, "spec.parallelism.activationCheckpointing");
  ASSERT_NE(on, nullptr);
  EXPECT_EQ(on->value, "true");

  manifest["spec"]["parallelism"]["activationCheckpointing"] = false;  // written off: still an error
  const CheckedJob off = CheckTrainingJob(manifest, "job.yaml", 0);
  ASSERT_EQ(off.errors.size(), 1u);
  EXPECT_EQ(off.errors[0].path, "spec.parallelism.activationOffloading");
}

TEST(Defaults, WrittenFieldsAreNamedCanonicallyWhateverTheAlias) {
  const FieldPaths written = WrittenFields(
      {{"spec", {{"parallelism", {{"random_seed", 3}, {"hybridShardDegree", 2}}}, {"checkpoint", Json::object()}}}});
  EXPECT_EQ(written, (FieldPaths{"spec", "spec.parallelism", "spec.parallelism.tensorParallelSeed",
                                 "spec.parallelism.hybridShardDegree", "spec.checkpoint"}));
}

TEST(Warnings, AJobWithNoneOfTheFieldsHasNoWarning) {
  Json manifest = Minimal();
  manifest["spec"]["nodes"] = 2;
  manifest["spec"]["gpusPerNode"] = 4;  // sharded by default, but the user set nothing
  EXPECT_TRUE(Check(manifest).warnings.empty());
  manifest["spec"]["parallelism"] = {{"hybridShardDegree", 1}, {"activationCheckpointing", false}};
  EXPECT_TRUE(Check(manifest).warnings.empty()) << "shard groups of one and no checkpointing are what runs today";
  manifest["spec"]["parallelism"] = {{"hybridShardDegree", 4}};
  EXPECT_TRUE(Check(manifest).warnings.empty()) << "the sharded engine honours hybridShardDegree";
  manifest["spec"]["parallelism"] = {{"activationOffloading", true}, {"activationLoadingHorizon", 3}};
  EXPECT_TRUE(Check(manifest).warnings.empty()) << "the engine checkpoints and offloads block inputs";
}

TEST(Warnings, EveryFieldWithoutEffectIsNamed) {
  Json manifest = Minimal();
  manifest["spec"]["nodes"] = 2;
  manifest["spec"]["gpusPerNode"] = 4;
  manifest["spec"]["checkpoint"] = {{"path", "/ckpt"}};
  manifest["spec"]["parallelism"] = {{"hybrid_shard_degree", 4},
                                     {"sm_activation_offloading", true},
                                     {"activation_loading_horizon", 3},
                                     {"random_seed", 7}};
  const CheckedJob job = Check(manifest);
  EXPECT_EQ(WarnedPaths(job), (std::vector<std::string>{"spec.parallelism.tensorParallelSeed"}));
  for (const FieldError& w : job.warnings) EXPECT_TRUE(w.message.starts_with("has no effect yet: ")) << w.ToString();
  manifest["spec"]["model"]["dropout"] = 0.1;  // the seed now keys its masks
  EXPECT_TRUE(Check(manifest).warnings.empty());
  manifest["spec"]["parallelism"] = {{"activationLoadingHorizon", 3}};  // without offloading
  EXPECT_EQ(WarnedPaths(Check(manifest)), (std::vector<std::string>{"spec.parallelism.activationLoadingHorizon"}));
  manifest["spec"]["parallelism"] = Json::object();
  manifest["spec"]["checkpoint"] = {{"path", ""}, {"interval", 10}, {"keep", 3}};  // no checkpoints
  EXPECT_EQ(WarnedPaths(Check(manifest)),
            (std::vector<std::string>{"spec.checkpoint.interval", "spec.checkpoint.keep"}));
  manifest["spec"]["checkpoint"]["path"] = "/ckpt";
  EXPECT_TRUE(Check(manifest).warnings.empty());
  manifest["spec"]["elastic"] = {{"minNodes", 2}};  // spec.nodes: no smaller gang
  EXPECT_EQ(WarnedPaths(Check(manifest)), (std::vector<std::string>{"spec.elastic.minNodes"}));
  manifest["spec"]["elastic"]["minNodes"] = 1;
  EXPECT_TRUE(Check(manifest).warnings.empty());
}

// Property: any valid shape, world size and layout, with every optional field left out
// (and steps written or not), validates.
TEST(Defaults, RandomJobsWithEveryOptionalFieldLeftOutValidate) {
  std::mt19937 rng(20261123);
  auto pick = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  auto divisor_of = [&](int64_t n) {
    std::vector<int64_t> divisors;
    for (int64_t d = 1; d <= n; ++d) {
      if (n % d == 0) divisors.push_back(d);
    }
    return divisors[size_t(pick(0, int64_t(divisors.size()) - 1))];
  };
  int checked = 0;
  for (int i = 0; i < 2000; ++i) {
    const int64_t gpus = int64_t(1) << pick(0, 4);
    const int64_t nodes = pick(1, 40);
    const int64_t heads = pick(1, 32);
    const int64_t hidden = heads * pick(1, 128);
    int64_t tp = divisor_of(gpus);
    if (heads % tp != 0) tp = 1;
    Json manifest = Minimal();
    Json& spec = manifest["spec"];
    spec["nodes"] = nodes;
    spec["gpusPerNode"] = gpus;
    spec["model"] = {{"layers", pick(1, 48)}, {"heads", heads}, {"hidden", hidden},
                     {"vocabSize", pick(1, 100000)}, {"seqLen", pick(1, 8192)}};
    if (tp > 1) spec["parallelism"]["tensorParallelDegree"] = tp;
    if (pick(0, 1) == 1) {
      // A shard group that tiles whole nodes: S x T divides G, or is G times a divisor of the node count.
      const int64_t per_node = gpus / tp;
      const int64_t shard = pick(0, 1) ? divisor_of(per_node) : per_node * divisor_of(nodes);
      spec["parallelism"]["hybridShardDegree"] = shard;
    }
    if (pick(0, 1) == 1) spec["training"]["steps"] = pick(1, 100000);
    const CheckedJob job = CheckTrainingJob(manifest, "random.yaml", 0);
    EXPECT_TRUE(job.ok()) << manifest["spec"].dump() << ": " << job.errors.front().ToString();
    if (!job.ok()) break;
    const TrainingSpec& t = job.job.spec.training;
    EXPECT_LE(t.warmup_steps * 10, t.steps);
    EXPECT_EQ(t.global_batch_tokens % TokensPerMicroStep(job.job.spec), 0);
    ++checked;
  }
  EXPECT_EQ(checked, 2000);
}

}  // namespace
}  // namespace meshtrain::api
