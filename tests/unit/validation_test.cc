// Table-driven validation: each case breaks one thing in a valid manifest and
// names the exact field paths that must be reported, and no others.

#include <cmath>
#include <limits>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "api/layout.h"
#include "api/manifest.h"

namespace meshtrain::api {
namespace {

using Json = nlohmann::json;

// 2 nodes x 8 GPUs, TP 2, shard 4, 2 replicas: dp 8, 32768 tokens per micro-step.
constexpr const char* kBase = R"(
apiVersion: meshtrain.dev/v1alpha1
kind: TrainingJob
metadata: {name: base-job, namespace: team-a}
spec:
  image: example.com/meshtrain:1
  nodes: 2
  gpusPerNode: 8
  model: {preset: gpt2-124m}
  data: {train: [/data/train.bin], validation: [/data/val.bin]}
  training: {steps: 1000, globalBatchTokens: 65536, microBatchSize: 4, warmupSteps: 10}
  parallelism: {tensorParallelDegree: 2, hybridShardDegree: 4}
  template:
    tolerations: [{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}]
    nodeSelector: {node.kubernetes.io/instance-type: p5.48xlarge}
    volumes: [{name: data, emptyDir: {}}]
    volumeMounts: [{name: data, mountPath: /data}]
    env: [{name: NCCL_DEBUG, value: INFO}]
)";

Json Base() { return ParseManifestText(kBase, "base.yaml").at(0).object; }

struct Edit {
  std::string pointer;  // JSON pointer into the manifest
  Json value;           // the new value; a discarded Json removes the field
};

struct Case {
  std::string name;
  std::vector<Edit> edits;
  std::set<std::string> paths;  // exactly the field paths that must be reported
  std::string message = {};     // if set, the first error's text must contain it
};

Json Remove() { return Json(Json::value_t::discarded); }

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

const std::vector<Case>& Cases() {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  static const std::vector<Case> cases = {
      {"wrong api version", {{"/apiVersion", "meshtrain.dev/v1"}}, {"apiVersion"}},
      {"wrong kind", {{"/kind", "Job"}}, {"kind"}},
      {"missing name", {{"/metadata/name", Remove()}}, {"metadata.name"}, "is required"},
      {"name with capitals", {{"/metadata/name", "Bad_Name"}}, {"metadata.name"}},
      {"name too long", {{"/metadata/name", std::string(60, 'a')}}, {"metadata.name"}},
      {"bad namespace", {{"/metadata/namespace", "Team A"}}, {"metadata.namespace"}},
      {"top-level typo", {{"/specs", Json::object()}}, {"specs"}, "unknown field"},
      {"spec not an object", {{"/spec", "x"}}, {"spec"}, "must be an object"},
      {"no image", {{"/spec/image", Remove()}}, {"spec.image"}},
      {"zero nodes", {{"/spec/nodes", 0}}, {"spec.nodes"}, "must be between 1 and 65536, got 0"},
      {"negative nodes", {{"/spec/nodes", -3}}, {"spec.nodes"}},
      {"nodes as string", {{"/spec/nodes", "two"}}, {"spec.nodes"}, "must be an integer, got string \"two\""},
      {"zero gpus", {{"/spec/gpusPerNode", 0}}, {"spec.gpusPerNode"}},
      {"fractional gpus", {{"/spec/gpusPerNode", 1.5}}, {"spec.gpusPerNode"}, "must be an integer"},
      {"gpu request differs", {{"/spec/resources", {{"gpu", 4}}}}, {"spec.resources.gpu"}},
      {"negative efa", {{"/spec/resources", {{"efa", -1}}}}, {"spec.resources.efa"}},
      {"zero memory limit", {{"/spec/resources", {{"memoryLimitMiB", 0}}}}, {"spec.resources.memoryLimitMiB"}},
      {"dropout of one", {{"/spec/model/dropout", 1.0}}, {"spec.model.dropout"}},
      {"negative dropout", {{"/spec/model/dropout", -0.1}}, {"spec.model.dropout"}},
      {"unknown resource", {{"/spec/resources", {{"tpu", 1}}}}, {"spec.resources.tpu"}},
      {"unknown preset", {{"/spec/model/preset", "gpt2-xl"}}, {"spec.model.preset"}, "known presets: gpt2-tiny"},
      {"partial shape without preset",
       {{"/spec/model", {{"layers", 12}}}},
       {"spec.model.heads", "spec.model.hidden", "spec.model.vocabSize", "spec.model.seqLen"}},
      {"zero layers", {{"/spec/model/layers", 0}}, {"spec.model.layers"}},
      {"hidden not divisible by heads", {{"/spec/model/hidden", 770}}, {"spec.model.hidden"},
       "must be divisible by spec.model.heads (12), got 770"},
      {"negative seq len", {{"/spec/model/seqLen", -1}}, {"spec.model.seqLen"}},
      {"vocab as string", {{"/spec/model/vocabSize", "big"}}, {"spec.model.vocabSize"}},
      {"unknown model field", {{"/spec/model/attentionDropout", 0.1}}, {"spec.model.attentionDropout"}, "unknown field"},
      {"no training data", {{"/spec/data/train", Json::array()}}, {"spec.data.train"}},
      {"empty data path", {{"/spec/data/train", {""}}}, {"spec.data.train[0]"}},
      {"data path not a string", {{"/spec/data/validation", {"/ok.bin", 5}}}, {"spec.data.validation[1]"}},
      {"unknown data format", {{"/spec/data/format", "int32"}}, {"spec.data.format"}, "must be one of"},
      {"unknown attention", {{"/spec/data/attention", "sliding"}}, {"spec.data.attention"}, "must be one of"},
      {"document attention without a tokenizer", {{"/spec/data/attention", "document"}}, {"spec.data.attention"},
       "needs spec.model.tokenizer"},
      {"tokenizer not a string", {{"/spec/model/tokenizer", 5}}, {"spec.model.tokenizer"}},
      {"zero steps", {{"/spec/training/steps", 0}}, {"spec.training.steps"}},
      {"steps overflow", {{"/spec/training/steps", std::numeric_limits<uint64_t>::max()}},
       {"spec.training.steps"}, "out of range"},
      {"batch not a multiple", {{"/spec/training/globalBatchTokens", 1000}}, {"spec.training.globalBatchTokens"},
       "(4 x 1024 x 8 = 32768), got 1000"},
      {"zero micro batch", {{"/spec/training/microBatchSize", 0}}, {"spec.training.microBatchSize"}},
      {"zero learning rate", {{"/spec/training/learningRate", 0}}, {"spec.training.learningRate"}},
      {"nan learning rate", {{"/spec/training/learningRate", nan}}, {"spec.training.learningRate"}, "finite"},
      {"warmup past the end", {{"/spec/training/warmupSteps", 5000}}, {"spec.training.warmupSteps"}},
      {"negative warmup", {{"/spec/training/warmupSteps", -1}}, {"spec.training.warmupSteps"}},
      {"unknown schedule", {{"/spec/training/schedule", "linear"}}, {"spec.training.schedule"},
       "must be one of cosine, constant"},
      {"negative weight decay", {{"/spec/training/weightDecay", -0.1}}, {"spec.training.weightDecay"}},
      {"negative grad clip", {{"/spec/training/gradClip", -1}}, {"spec.training.gradClip"}},
      {"negative seed", {{"/spec/training/seed", -5}}, {"spec.training.seed"}},
      {"unknown precision", {{"/spec/training/precision", "fp16"}}, {"spec.training.precision"}},
      {"unknown float8 recipe", {{"/spec/training/precision", "fp8"}, {"/spec/training/float8", {{"recipe", "blockwise"}}}},
       {"spec.training.float8.recipe"}, "must be one of tensorwise, rowwise"},
      {"a float8 recipe without fp8", {{"/spec/training/float8", {{"recipe", "rowwise"}}}},
       {"spec.training.float8.recipe"}, "acted on with spec.training.precision fp8 only"},
      {"fp8 on widths cuBLASLt cannot multiply", {{"/spec/training/precision", "fp8"}, {"/spec/model/hidden", 776},
                                                   {"/spec/model/heads", 8}},
       {"spec.training.precision"}, "spec.model.hidden per TP rank to be a multiple of 16"},
      {"fp8 with context parallelism", {{"/spec/training/precision", "fp8"}, {"/spec/parallelism/contextParallelDegree", 2}},
       {"spec.training.precision"}, "contextParallelDegree 2 is not built"},
      {"negative eval interval", {{"/spec/training/evalInterval", -1}}, {"spec.training.evalInterval"}},
      {"zero eval batches", {{"/spec/training/evalBatches", 0}}, {"spec.training.evalBatches"}},
      {"tp does not divide gpus per node", {{"/spec/parallelism/tensorParallelDegree", 3}},
       {"spec.parallelism.tensorParallelDegree"}, "must divide spec.gpusPerNode (8), got 3"},
      {"tp larger than a node", {{"/spec/parallelism/tensorParallelDegree", 16}},
       {"spec.parallelism.tensorParallelDegree"}},
      {"zero tp", {{"/spec/parallelism/tensorParallelDegree", 0}}, {"spec.parallelism.tensorParallelDegree"}},
      {"tp does not divide heads",
       {{"/spec/model/preset", "gpt2-1.5b"}},
       {"spec.parallelism.tensorParallelDegree"}, "must divide spec.model.heads (25), got 2"},
      {"tp does not divide heads nor the MLP",
       {{"/spec/model", {{"layers", 2}, {"heads", 3}, {"hidden", 3}, {"vocabSize", 256}, {"seqLen", 1024}}},
        {"/spec/parallelism/tensorParallelDegree", 8},
        {"/spec/parallelism/hybridShardDegree", 2}},
       {"spec.parallelism.tensorParallelDegree"}},
      {"shard does not divide dp", {{"/spec/parallelism/hybridShardDegree", 3}},
       {"spec.parallelism.hybridShardDegree"}, "(16 GPUs / tensorParallelDegree 2 = 8), got 3"},
      {"negative shard", {{"/spec/parallelism/hybridShardDegree", -1}}, {"spec.parallelism.hybridShardDegree"}},
      {"shard groups straddle nodes",
       {{"/spec/nodes", 3}, {"/spec/parallelism/hybridShardDegree", 3}},
       {"spec.parallelism.hybridShardDegree"}, "tile whole nodes"},
      {"pipeline does not divide the world", {{"/spec/parallelism/pipelineParallelDegree", 3}},
       {"spec.parallelism.pipelineParallelDegree"}, "must divide the world"},
      {"more chunks than blocks",
       {{"/spec/parallelism/pipelineParallelDegree", 2},
        {"/spec/parallelism/pipelineSchedule", "Interleaved1F1B"},
        {"/spec/parallelism/pipelineVirtualStages", 8}},
       {"spec.parallelism.pipelineParallelDegree"}, "more than spec.model.layers (12)"},
      {"fewer micro-batches than stages",
       {{"/spec/parallelism/pipelineParallelDegree", 2}, {"/spec/training/globalBatchTokens", 16384}},
       {"spec.training.globalBatchTokens"}, "fewer than the 2 stages"},
      {"interleaved without virtual stages",
       {{"/spec/parallelism/pipelineParallelDegree", 2}, {"/spec/parallelism/pipelineSchedule", "Interleaved1F1B"}},
       {"spec.parallelism.pipelineVirtualStages"}, "must be 2 or more"},
      {"virtual stages with 1F1B",
       {{"/spec/parallelism/pipelineParallelDegree", 2}, {"/spec/parallelism/pipelineVirtualStages", 2}},
       {"spec.parallelism.pipelineVirtualStages"}, "needs spec.parallelism.pipelineSchedule Interleaved1F1B"},
      {"interleaved without a pipeline",
       {{"/spec/parallelism/pipelineSchedule", "Interleaved1F1B"}, {"/spec/parallelism/pipelineVirtualStages", 2}},
       {"spec.parallelism.pipelineSchedule"}, "pipelineParallelDegree of 2 or more"},
      {"unknown pipeline schedule", {{"/spec/parallelism/pipelineSchedule", "ZeroBubble"}},
       {"spec.parallelism.pipelineSchedule"}, "must be one of GPipe, 1F1B, Interleaved1F1B"},
      {"interleaved micro-batches not a multiple of the stages",
       {{"/spec/parallelism/pipelineParallelDegree", 2},
        {"/spec/parallelism/pipelineSchedule", "Interleaved1F1B"},
        {"/spec/parallelism/pipelineVirtualStages", 2},
        {"/spec/training/globalBatchTokens", 49152}},
       {"spec.training.globalBatchTokens"}, "not a multiple of the 2 stages"},
      {"zero loading horizon", {{"/spec/parallelism/activationLoadingHorizon", 0}},
       {"spec.parallelism.activationLoadingHorizon"}},
      {"offloading with checkpointing written off",
       {{"/spec/parallelism/activationOffloading", true}, {"/spec/parallelism/activationCheckpointing", false}},
       {"spec.parallelism.activationOffloading"}},
      {"negative tp seed", {{"/spec/parallelism/tensorParallelSeed", -1}}, {"spec.parallelism.tensorParallelSeed"}},
      {"conflicting smp alias", {{"/spec/parallelism/tensor_parallel_degree", 4}},
       {"spec.parallelism.tensor_parallel_degree"}, "conflicts with spec.parallelism.tensorParallelDegree"},
      {"expert parallelism of a dense model", {{"/spec/parallelism/expert_parallel_degree", 2}},
       {"spec.parallelism.expertParallelDegree"}, "a model without experts"},
      {"load-balancing loss of a dense model", {{"/spec/training/routerAuxLossCoef", 0.01}},
       {"spec.training.routerAuxLossCoef"}, "this model has no experts"},
      {"negative load-balancing coefficient", {{"/spec/training/routerAuxLossCoef", -0.5}},
       {"spec.training.routerAuxLossCoef"}},
      {"smp flag of wrong type", {{"/spec/parallelism/sm_activation_offloading", "yes"}},
       {"spec.parallelism.sm_activation_offloading"}, "must be true or false"},
      {"zero checkpoint interval", {{"/spec/checkpoint", {{"path", "/ckpt"}, {"interval", 0}}}},
       {"spec.checkpoint.interval"}},
      {"zero checkpoints kept", {{"/spec/checkpoint", {{"keep", 0}}}}, {"spec.checkpoint.keep"}},
      {"empty topology level", {{"/spec/topology", {{"levels", {"", "kubernetes.io/hostname"}}}}},
       {"spec.topology.levels[0]"}},
      {"repeated topology level",
       {{"/spec/topology", {{"levels", {"kubernetes.io/hostname", "kubernetes.io/hostname"}}}}},
       {"spec.topology.levels[1]"}},
      {"unknown topology mode", {{"/spec/topology", {{"mode", "Strict"}}}}, {"spec.topology.mode"}},
      {"required level not among the levels",
       {{"/spec/topology", {{"mode", "Required"}, {"requiredLevel", "topology.kubernetes.io/zone"}}}},
       {"spec.topology.requiredLevel"}},
      {"negative backoff", {{"/spec/runPolicy", {{"backoffLimit", -1}}}}, {"spec.runPolicy.backoffLimit"}},
      {"negative hang timeout", {{"/spec/runPolicy", {{"hangTimeoutSeconds", -1}}}}, {"spec.runPolicy.hangTimeoutSeconds"},
       "must be at least 0, got -1"},
      {"fractional hang timeout", {{"/spec/runPolicy", {{"hangTimeoutSeconds", 2.5}}}},
       {"spec.runPolicy.hangTimeoutSeconds"}},
      {"zero deadline", {{"/spec/runPolicy", {{"activeDeadlineSeconds", 0}}}}, {"spec.runPolicy.activeDeadlineSeconds"}},
      {"negative ttl", {{"/spec/runPolicy", {{"ttlSecondsAfterFinished", -1}}}},
       {"spec.runPolicy.ttlSecondsAfterFinished"}},
      {"unknown clean policy", {{"/spec/runPolicy", {{"cleanPodPolicy", "Some"}}}}, {"spec.runPolicy.cleanPodPolicy"}},
      {"elastic minimum above the job's nodes", {{"/spec/elastic", {{"minNodes", 99}}}}, {"spec.elastic.minNodes"}},
      {"elastic minimum of zero", {{"/spec/elastic", {{"minNodes", 0}}}}, {"spec.elastic.minNodes"}, "must be between 1 and 2, got 0"},
      {"unknown elastic field", {{"/spec/elastic", {{"maxNodes", 4}}}}, {"spec.elastic.maxNodes"}},
      {"suspend as string", {{"/spec/runPolicy", {{"suspend", "true"}}}}, {"spec.runPolicy.suspend"}},
      {"unknown toleration operator", {{"/spec/template/tolerations/0/operator", "In"}},
       {"spec.template.tolerations[0].operator"}},
      {"exists toleration with value", {{"/spec/template/tolerations/0/value", "x"}},
       {"spec.template.tolerations[0].value"}},
      {"unknown toleration effect", {{"/spec/template/tolerations/0/effect", "NoRun"}},
       {"spec.template.tolerations[0].effect"}},
      {"toleration seconds without NoExecute", {{"/spec/template/tolerations/0/tolerationSeconds", 30}},
       {"spec.template.tolerations[0].tolerationSeconds"}},
      {"bad node selector key", {{"/spec/template/nodeSelector", {{"bad key!", "x"}}}},
       {"spec.template.nodeSelector.bad key!"}},
      {"volume without name", {{"/spec/template/volumes/0", {{"emptyDir", Json::object()}}}},
       {"spec.template.volumes[0].name", "spec.template.volumeMounts[0].name"}},
      {"mount of unknown volume", {{"/spec/template/volumeMounts/0/name", "cache"}},
       {"spec.template.volumeMounts[0].name"}},
      {"relative mount path", {{"/spec/template/volumeMounts/0/mountPath", "data"}},
       {"spec.template.volumeMounts[0].mountPath"}},
      {"bad env name", {{"/spec/template/env/0/name", "1BAD"}}, {"spec.template.env[0].name"}},
      {"reserved env name", {{"/spec/template/env/0/name", "MESHTRAIN_RANK_TABLE"}}, {"spec.template.env[0].name"},
       "set by meshtrain"},
      {"env valueFrom", {{"/spec/template/env/0/valueFrom", {{"fieldRef", Json::object()}}}},
       {"spec.template.env[0].valueFrom"}, "unknown field"},
      {"tolerations not a list", {{"/spec/template/tolerations", "all"}}, {"spec.template.tolerations"}},
  };
  return cases;
}

class ValidationTest : public testing::TestWithParam<Case> {};

TEST(ValidationBase, BaseManifestIsValid) {
  CheckedJob job = CheckTrainingJob(Base(), "base.yaml", 0);
  for (const FieldError& e : job.errors) ADD_FAILURE() << e.ToString();
}

TEST(ValidationBase, TableHasFortyDistinctCases) {
  std::set<std::string> names;
  for (const Case& c : Cases()) names.insert(c.name);
  EXPECT_EQ(names.size(), Cases().size());
  EXPECT_GE(Cases().size(), 40u);
}

TEST_P(ValidationTest, ReportsExactlyTheBrokenPaths) {
  const Case& c = GetParam();
  Json manifest = Base();
  for (const Edit& edit : c.edits) {
    const Json::json_pointer pointer(edit.pointer);
    if (edit.value.is_discarded()) {
      manifest[pointer.parent_pointer()].erase(pointer.back());
    } else {
      manifest[pointer] = edit.value;
    }
  }
  CheckedJob job = CheckTrainingJob(manifest, "case.yaml", 0);
  std::set<std::string> paths;
  for (const FieldError& e : job.errors) paths.insert(e.path);
  EXPECT_EQ(paths, c.paths) << "errors: " << testing::PrintToString(job.errors.size());
  ASSERT_FALSE(job.errors.empty());
  if (!c.message.empty()) {
    EXPECT_NE(job.errors.front().message.find(c.message), std::string::npos)
        << "got: " << job.errors.front().ToString();
  }
}

INSTANTIATE_TEST_SUITE_P(InvalidSpecs, ValidationTest, testing::ValuesIn(Cases()),
                         [](const testing::TestParamInfo<Case>& param_info) {
                           std::string name;
                           for (char ch : param_info.param.name) name += std::isalnum(static_cast<unsigned char>(ch)) ? ch : '_';
                           return name;
                         });

TEST(Validation, ExampleMessageMatchesTheIssue) {
  Json manifest = Base();
  manifest["spec"]["parallelism"]["tensorParallelDegree"] = 3;
  CheckedJob job = CheckTrainingJob(manifest, "case.yaml", 0);
  ASSERT_EQ(job.errors.size(), 1u);
  EXPECT_EQ(job.errors[0].ToString(),
            "spec.parallelism.tensorParallelDegree: must divide spec.gpusPerNode (8), got 3");
}

TEST(Validation, HangTimeoutDefaultsTo300SecondsAndZeroTurnsItOff) {
  Json manifest = Base();
  manifest["spec"].erase("runPolicy");
  const CheckedJob defaulted = CheckTrainingJob(manifest, "case.yaml", 0);
  ASSERT_TRUE(defaulted.ok());
  EXPECT_EQ(defaulted.job.spec.run_policy.hang_timeout_seconds, 300);
  for (int64_t seconds : {0, 3, 86400}) {
    manifest["spec"]["runPolicy"] = {{"hangTimeoutSeconds", seconds}};
    const CheckedJob written = CheckTrainingJob(manifest, "case.yaml", 0);
    ASSERT_TRUE(written.ok()) << seconds;
    EXPECT_EQ(written.job.spec.run_policy.hang_timeout_seconds, seconds);
  }
}

// spec.elastic.minNodes: the sizes a shrink could take are checked as the operator checks a
// shrunk gang's spec. At 3 nodes the base layout (T 2, S 4) has 12 data-parallel ranks,
// whose micro-steps of 4 x 1024 tokens do not divide the global batch of 65536.
TEST(Validation, ElasticSizesThatCannotRunTheLayoutAreNamed) {
  Json job = Base();
  job["spec"]["nodes"] = 4;
  job["spec"]["elastic"] = {{"minNodes", 1}};
  const CheckedJob some = CheckTrainingJob(job, "job.yaml", 0);
  ASSERT_TRUE(some.ok()) << some.errors.front().ToString();
  ASSERT_EQ(some.warnings.size(), 1u);
  EXPECT_EQ(some.warnings[0].path, "spec.elastic.minNodes");
  EXPECT_EQ(some.warnings[0].message.rfind("a gang of 3 nodes cannot run this job's layout (at 3 nodes, "
                                           "spec.training.globalBatchTokens: must be a multiple of",
                                           0),
            0u)
      << some.warnings[0].message;
  EXPECT_NE(some.warnings[0].message.find("); a shrink skips those sizes"), std::string::npos);

  // No size at all: a loud warning, not an error, so that a job an older operator runs
  // stays valid under this one.
  job["spec"]["elastic"]["minNodes"] = 3;
  const CheckedJob none = CheckTrainingJob(job, "job.yaml", 0);
  ASSERT_TRUE(none.ok());
  ASSERT_EQ(none.warnings.size(), 1u);
  EXPECT_EQ(none.warnings[0].path, "spec.elastic.minNodes");
  EXPECT_NE(none.warnings[0].message.find("no smaller gang (3 nodes) can run this job's layout"), std::string::npos)
      << none.warnings[0].message;
  EXPECT_NE(none.warnings[0].message.find("so the job can never shrink; it has no effect"), std::string::npos);

  job["spec"]["elastic"]["minNodes"] = 2;
  job["spec"]["nodes"] = 2;
  EXPECT_TRUE(CheckTrainingJob(Base(), "job.yaml", 0).warnings.empty());
  job["spec"]["nodes"] = 4;
  job["spec"]["training"]["globalBatchTokens"] = 3 * 65536;  // every size from 2 to 4 divides it
  const CheckedJob all = CheckTrainingJob(job, "job.yaml", 0);
  EXPECT_TRUE(all.ok());
  EXPECT_TRUE(all.warnings.empty()) << all.warnings.front().ToString();
}

TEST(Validation, ReportsEveryErrorAtOnce) {
  Json manifest = Base();
  manifest["spec"]["nodes"] = 0;
  manifest["spec"]["image"] = "";
  manifest["spec"]["training"]["schedule"] = "linear";
  manifest["spec"]["bogus"] = 1;
  CheckedJob job = CheckTrainingJob(manifest, "case.yaml", 0);
  std::set<std::string> paths;
  for (const FieldError& e : job.errors) paths.insert(e.path);
  EXPECT_EQ(paths, (std::set<std::string>{"spec.nodes", "spec.image", "spec.training.schedule", "spec.bogus"}));
}

TEST(Validation, WrongTypesAreReportedBeforeChecksThatWouldUseThem) {
  Json manifest = Base();
  manifest["spec"]["gpusPerNode"] = "eight";  // TP 2 against a placeholder would look wrong too
  manifest["spec"]["image"] = "";
  CheckedJob job = CheckTrainingJob(manifest, "case.yaml", 0);
  ASSERT_EQ(job.errors.size(), 1u);
  EXPECT_EQ(job.errors[0].path, "spec.gpusPerNode");
}

TEST(Validation, ModeAutoRefusesTheFieldsThePlannerChooses) {
  Json job = Base();
  job["spec"]["parallelism"] = {{"mode", "auto"}, {"tensor_parallel_degree", 2}, {"activationCheckpointing", true}};
  job["spec"]["training"]["microBatchSize"] = 4;
  const CheckedJob checked = CheckTrainingJob(job, "auto.yaml", 0);
  std::set<std::string> paths;
  for (const FieldError& e : checked.errors) {
    paths.insert(e.path);
    EXPECT_NE(e.message.find("is chosen by the planner with spec.parallelism.mode auto"), std::string::npos) << e.message;
  }
  EXPECT_EQ(paths, (std::set<std::string>{"spec.parallelism.tensorParallelDegree", "spec.parallelism.activationCheckpointing",
                                          "spec.training.microBatchSize"}));

  Json plain = Base();
  plain["spec"]["parallelism"] = {{"mode", "auto"}};
  plain["spec"]["training"].erase("microBatchSize");
  EXPECT_TRUE(CheckTrainingJob(plain, "auto.yaml", 0).ok());
  plain["spec"]["parallelism"]["mode"] = "guess";
  const CheckedJob bad = CheckTrainingJob(plain, "auto.yaml", 0);
  ASSERT_EQ(bad.errors.size(), 1u);
  EXPECT_EQ(bad.errors[0].path, "spec.parallelism.mode");
}

}  // namespace
}  // namespace meshtrain::api

namespace meshtrain::api {
namespace {

// Context parallelism: SMP v2's spelling is taken, the layout puts C between the shard and
// TP axes (FSDP over S x C), and what it cannot run is named by field.
TEST(Validation, ContextParallelismIsCheckedByField) {
  auto paths = [](const Json& job) {
    std::set<std::string> out;
    for (const FieldError& e : CheckTrainingJob(job, "job.yaml", 0).errors) out.insert(e.path);
    return out;
  };
  Json job = Base();
  job["spec"]["parallelism"]["context_parallel_degree"] = 2;
  const CheckedJob ok = CheckTrainingJob(job, "job.yaml", 0);
  ASSERT_TRUE(ok.ok()) << ok.errors.front().ToString();
  EXPECT_EQ(ok.job.spec.parallelism.context_parallel_mode, "Ring");
  const ParallelLayout mesh = ParallelLayout::ForSpec(ok.job.spec);
  EXPECT_EQ(mesh.context(), 2);
  EXPECT_EQ(mesh.shard(), 8);  // hybridShardDegree 4 x C 2
  EXPECT_EQ(mesh.replicas(), 1);
  EXPECT_EQ(mesh.data_parallel(), 4);

  Json odd = Base();
  odd["spec"]["parallelism"]["contextParallelDegree"] = 3;  // 8 TP groups
  EXPECT_TRUE(paths(odd).contains("spec.parallelism.contextParallelDegree"));
  Json window = job;
  window["spec"]["model"]["seqLen"] = 1022;  // not a multiple of 2 x 2
  EXPECT_TRUE(paths(window).contains("spec.model.seqLen"));
  Json dropout = job;
  dropout["spec"]["model"]["dropout"] = 0.1;
  EXPECT_EQ(paths(dropout), std::set<std::string>{"spec.parallelism.contextParallelDegree"});
  Json ulysses = job;
  ulysses["spec"]["parallelism"]["contextParallelMode"] = "AllToAll";
  const CheckedJob all_to_all = CheckTrainingJob(ulysses, "job.yaml", 0);
  ASSERT_TRUE(all_to_all.ok()) << all_to_all.errors.front().ToString();
  EXPECT_EQ(all_to_all.job.spec.parallelism.context_parallel_mode, "AllToAll");
  Json split = ulysses;  // 12 heads / T 2 = 6 a TP rank, which C = 4 cannot split
  split["spec"]["parallelism"]["context_parallel_degree"] = 4;
  split["spec"]["parallelism"]["hybridShardDegree"] = 2;
  split["spec"]["model"] = Json{{"preset", "gpt2-124m"}, {"heads", 12}};
  EXPECT_EQ(paths(split), std::set<std::string>{"spec.parallelism.contextParallelDegree"});
  Json gqa = ulysses;  // 32 query heads split, but 2 key/value heads a TP rank do not split 4 ways
  gqa["spec"]["parallelism"]["context_parallel_degree"] = 4;
  gqa["spec"]["parallelism"]["hybridShardDegree"] = 2;
  gqa["spec"]["model"] = Json{{"family", "llama"}, {"layers", 2},  {"heads", 32},        {"kvHeads", 4},
                              {"hidden", 1024},  {"vocabSize", 1000}, {"seqLen", 1024}, {"intermediateSize", 2048}};
  const CheckedJob gqa_checked = CheckTrainingJob(gqa, "job.yaml", 0);
  ASSERT_FALSE(gqa_checked.ok());
  EXPECT_NE(gqa_checked.errors.front().message.find("spec.model.kvHeads per TP rank (4 / 2 = 2)"), std::string::npos)
      << gqa_checked.errors.front().ToString();
  Json other = job;
  other["spec"]["parallelism"]["contextParallelMode"] = "Tree";
  EXPECT_EQ(paths(other), std::set<std::string>{"spec.parallelism.contextParallelMode"});
}

}  // namespace
}  // namespace meshtrain::api
