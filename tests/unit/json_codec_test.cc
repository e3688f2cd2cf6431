#include "api/json_codec.h"

#include <filesystem>

#include <gtest/gtest.h>

#include "api/defaults.h"
#include "api/manifest.h"

namespace meshtrain::api {
namespace {

using Json = nlohmann::json;

std::vector<std::string> ExampleFiles() {
  std::vector<std::string> files;
  for (const auto& entry : std::filesystem::directory_iterator("examples")) {
    const auto ext = entry.path().extension();
    if (ext == ".yaml" || ext == ".json") files.push_back(entry.path().string());
  }
  std::sort(files.begin(), files.end());
  return files;
}

TEST(JsonCodec, ExamplesRoundTripThroughJson) {
  const auto files = ExampleFiles();
  ASSERT_GE(files.size(), 3u);
  for (const std::string& file : files) {
    for (const CheckedJob& checked : LoadTrainingJobs(file)) {
      ASSERT_TRUE(checked.ok()) << file << ": " << checked.errors.front().ToString();
      const Json encoded = ToJson(checked.job);
      FieldErrors errors;
      const TrainingJob decoded = DecodeTrainingJob(encoded, &errors);
      EXPECT_TRUE(errors.empty()) << file << ": " << errors.front().ToString();
      EXPECT_EQ(decoded, checked.job) << file;
      EXPECT_EQ(ToJson(decoded), encoded) << file;
      // Text round trip too: dump, reparse as a manifest.
      const auto reparsed = ParseManifestText(encoded.dump(2), "dump.json");
      ASSERT_EQ(reparsed.size(), 1u);
      EXPECT_EQ(reparsed[0].object, encoded);
    }
  }
}

TEST(JsonCodec, StatusRoundTrips) {
  TrainingJobStatus status;
  status.phase = "Running";
  status.conditions.push_back({"Ready", "True", "AllWorkersReady", "16/16 workers ready", "2026-11-21T10:00:00Z", 3});
  status.observed_generation = 3;
  status.restarts = 1;
  status.ready_workers = 16;
  status.start_time = "2026-11-21T09:00:00Z";
  status.placement = PlacementStatus{{{0, "ip-10-0-1-17", {"nn-1a", "nn-2b", "nn-3c", "ip-10-0-1-17"}}}, 0.41};
  status.progress = ProgressStatus{1200, 3.25, 150000.5, 3600, 1000, 1100, 1};
  status.layout = LayoutStatus{};
  status.layout->context_parallel_degree = 4;
  status.layout->context_parallel_mode = "AllToAll";
  const Json encoded = ToJson(status);
  EXPECT_EQ(encoded["placement"]["nodes"][0]["topologyPath"][2], "nn-3c");
  EXPECT_EQ(encoded["layout"]["contextParallelDegree"], 4);
  EXPECT_EQ(encoded["layout"]["contextParallelMode"], "AllToAll");
  EXPECT_EQ(encoded["conditions"][0]["observedGeneration"], 3);
  FieldErrors errors;
  EXPECT_EQ(DecodeTrainingJobStatus(encoded, &errors), status);
  EXPECT_TRUE(errors.empty());
}

TEST(JsonCodec, EmptyStatusIsLeftOut) {
  TrainingJob job;
  job.metadata.name = "x";
  EXPECT_FALSE(ToJson(job).contains("status"));
  job.status.phase = "Pending";
  EXPECT_EQ(ToJson(job)["status"]["phase"], "Pending");
}

// An SMP v2 config file, verbatim from a user's estimator, as the parallelism block.
TEST(JsonCodec, SageMakerConfigWorksUnchanged) {
  const Json smp = Json::parse(R"({
    "tensor_parallel_degree": 4,
    "hybrid_shard_degree": 2,
    "sm_activation_offloading": true,
    "activation_loading_horizon": 3,
    "fsdp_cache_flush_warnings": false,
    "allow_empty_shards": true,
    "context_parallel_degree": 1,
    "expert_parallel_degree": 1,
    "random_seed": 77
  })");
  Json job = {{"apiVersion", "meshtrain.dev/v1alpha1"}, {"kind", "TrainingJob"}, {"metadata", {{"name", "smp"}}},
              {"spec", {{"image", "img"}, {"nodes", 1}, {"gpusPerNode", 8}, {"model", {{"preset", "gpt2-124m"}}},
                        {"data", {{"train", "/d/*.bin"}}}, {"training", {{"globalBatchTokens", 16384}, {"microBatchSize", 8}}},
                        {"parallelism", smp}}}};
  job["spec"]["parallelism"]["activationCheckpointing"] = true;  // offloading needs it
  CheckedJob checked = CheckTrainingJob(job, "smp.json", 0);
  ASSERT_TRUE(checked.ok()) << checked.errors.front().ToString();
  const ParallelismSpec& p = checked.job.spec.parallelism;
  EXPECT_EQ(p.tensor_parallel_degree, 4);
  EXPECT_EQ(p.hybrid_shard_degree, 2);
  EXPECT_TRUE(p.activation_offloading);
  EXPECT_EQ(p.activation_loading_horizon, 3);
  EXPECT_EQ(p.tensor_parallel_seed, 77);
  // Written back with meshtrain's own names.
  const Json out = ToJson(checked.job)["spec"]["parallelism"];
  EXPECT_EQ(out["tensorParallelDegree"], 4);
  EXPECT_FALSE(out.contains("tensor_parallel_degree"));
}

TEST(JsonCodec, SameValueUnderBothNamesIsAccepted) {
  FieldErrors errors;
  DecodeTrainingJob({{"spec", {{"parallelism", {{"tensorParallelDegree", 2}, {"tensor_parallel_degree", 2}}}}}},
                    &errors);
  EXPECT_TRUE(errors.empty());
}

TEST(JsonCodec, WrongTypesNameTheFieldAndTheValue) {
  FieldErrors errors;
  DecodeTrainingJob({{"spec", {{"nodes", "4"}, {"training", {{"learningRate", true}}}, {"data", {{"train", {{"a", 1}}}}}}}},
                    &errors);
  ASSERT_EQ(errors.size(), 3u);
  EXPECT_EQ(errors[0].ToString(), "spec.nodes: must be an integer, got string \"4\"");
  EXPECT_EQ(errors[1].ToString(), "spec.data.train: must be a list, got an object");
  EXPECT_EQ(errors[2].ToString(), "spec.training.learningRate: must be a number, got boolean true");
  for (const FieldError& e : errors) EXPECT_EQ(e.type, FieldErrorType::kUndecodable);
}

TEST(JsonCodec, UnknownFieldsAreReportedAtEveryDepth) {
  FieldErrors errors;
  DecodeTrainingJob({{"extra", 1},
                     {"spec", {{"model", {{"preset", "gpt2-tiny"}, {"dropuot", 0.1}}},
                               {"template", {{"tolerations", {{{"key", "a"}, {"operater", "Exists"}}}}}}}}},
                    &errors);
  std::vector<std::string> paths;
  for (const FieldError& e : errors) paths.push_back(e.path);
  EXPECT_EQ(paths, (std::vector<std::string>{"spec.model.dropuot", "spec.template.tolerations[0].operater", "extra"}));
  for (const FieldError& e : errors) {
    EXPECT_EQ(e.message, "unknown field");
    EXPECT_EQ(e.type, FieldErrorType::kUnknownField);
  }
}

TEST(JsonCodec, ServerOwnedMetadataIsTolerated) {
  FieldErrors errors;
  const TrainingJob job = DecodeTrainingJob(
      {{"metadata", {{"name", "a"}, {"uid", "u-1"}, {"generation", 4}, {"resourceVersion", "99"},
                     {"managedFields", Json::array()}, {"finalizers", {"x"}}}}},
      &errors);
  EXPECT_TRUE(errors.empty());
  EXPECT_EQ(job.metadata.generation, 4);
  EXPECT_EQ(job.metadata.resource_version, "99");
}

TEST(JsonCodec, NullOptionalFieldsAreUnset) {
  FieldErrors errors;
  const TrainingJob job = DecodeTrainingJob({{"spec", {{"runPolicy", {{"activeDeadlineSeconds", nullptr}}}}}}, &errors);
  EXPECT_TRUE(errors.empty());
  EXPECT_FALSE(job.spec.run_policy.active_deadline_seconds.has_value());
}

TEST(JsonCodec, DefaultsFillPresetAndDerivedFields) {
  FieldErrors errors;
  const Json object = {{"spec", {{"gpusPerNode", 4}, {"model", {{"preset", "gpt2-350m"}, {"seqLen", 512}}}}}};
  TrainingJob job = DecodeTrainingJob(object, &errors);
  const std::vector<DerivedDefault> derived = ApplyDefaults(&job, WrittenFields(object));
  EXPECT_EQ(job.spec.model.layers, 24);
  EXPECT_EQ(job.spec.model.seq_len, 512);  // explicit beats preset
  EXPECT_EQ(job.spec.resources.gpu, 4);
  EXPECT_EQ(job.spec.topology.levels, DefaultTopologyLevels());
  EXPECT_EQ(job.spec.topology.required_level, "topology.k8s.aws/network-node-layer-3");
  // 1 node x 4 GPUs: 4 data-parallel ranks of 8 x 512 tokens, 128 micro-steps of 16384 make 524288.
  EXPECT_EQ(job.spec.training.global_batch_tokens, 524288);
  EXPECT_EQ(job.spec.training.warmup_steps, 100);  // a tenth of the default 1000 steps
  ASSERT_EQ(derived.size(), 2u);
  EXPECT_EQ(derived[0].field, "spec.training.warmupSteps");
  EXPECT_EQ(derived[1].field, "spec.training.globalBatchTokens");
  TrainingJob again = job;
  EXPECT_EQ(ApplyDefaults(&again, WrittenFields(object)), derived);
  EXPECT_EQ(again, job);  // idempotent
}

}  // namespace
}  // namespace meshtrain::api
