// The controller's pure parts: the CRD schema against api/ validation, the objects
// the reconciler builds, and progress parsing.

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <set>

#include <gtest/gtest.h>

#include "api/json_codec.h"
#include "api/manifest.h"
#include "api/model_family.h"
#include "api/worker_contract.h"
#include "operator/controller/builders.h"
#include "operator/controller/launcher_client.h"
#include "operator/kube/base64.h"
#include "operator/controller/worker_readings.h"
#include "operator/controller/reconciler.h"
#include "operator/scheduler/placement.h"
#include "tests/support/kube/schema_validation.h"

namespace meshtrain::controller {
namespace {

using nlohmann::json;

json CrdSchema() {
  const json crd = api::ReadManifestFile("crds/trainingjobs.meshtrain.dev.yaml").at(0).object;
  return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"];
}

std::vector<std::string> SchemaErrors(json object) {
  return testing::ValidateAgainstSchema(CrdSchema(), object, /*strict=*/true);
}

TEST(CrdSchemaTest, AcceptsEveryExample) {
  int checked = 0;
  for (const auto& entry : std::filesystem::directory_iterator("examples")) {
    const std::string ext = entry.path().extension();
    if (ext != ".yaml" && ext != ".json") continue;
    for (const auto& doc : api::ReadManifestFile(entry.path().string())) {
      if (doc.object.value("kind", "") != "TrainingJob") continue;
      EXPECT_TRUE(api::CheckTrainingJob(doc.object, entry.path(), doc.index).ok()) << entry.path();
      const auto errors = SchemaErrors(doc.object);
      EXPECT_TRUE(errors.empty()) << entry.path() << ": " << (errors.empty() ? "" : errors[0]);
      ++checked;
    }
  }
  EXPECT_GE(checked, 4);
}

// Each mutation is a wrong type or an enum value outside the allowed set: both the
// API server (through the schema) and api/ validation must reject it, at the same field.
TEST(CrdSchemaTest, RejectsWhatValidationRejectsForTypesAndEnums) {
  const json base = api::ReadManifestFile("examples/gpt2-124m-2x8.yaml").at(0).object;
  const std::vector<std::pair<std::string, json>> cases = {
      {"/spec/nodes", "two"},
      {"/spec/gpusPerNode", 1.5},
      {"/spec/image", 7},
      {"/spec/training/schedule", "linear"},
      {"/spec/training/precision", "fp16"},
      {"/spec/training/float8/recipe", "blockwise"},
      {"/spec/training/learningRate", "fast"},
      {"/spec/parallelism/activationOffloading", "yes please"},
      {"/spec/parallelism/pipelineParallelDegree", "two"},
      {"/spec/parallelism/pipelineSchedule", "ZeroBubble"},
      {"/spec/topology/mode", "Sometimes"},
      {"/spec/runPolicy/cleanPodPolicy", "Never"},
      {"/spec/runPolicy/suspend", 1},
      {"/spec/template/tolerations/0/operator", "Like"},
      {"/spec/template/tolerations/0/effect", "NoRun"},
      {"/spec/template/nodeSelector", json::array({"a"})},
      {"/spec/unknownField", 1},
  };
  for (const auto& [pointer, value] : cases) {
    json object = base;
    object[json::json_pointer(pointer)] = value;
    std::string path = pointer.substr(1);
    for (auto& c : path) c = c == '/' ? '.' : c;
    const auto schema_errors = SchemaErrors(object);
    ASSERT_FALSE(schema_errors.empty()) << "the schema accepts " << pointer << " = " << value;
    EXPECT_NE(schema_errors[0].find(path.substr(0, path.find(".0"))), std::string::npos) << schema_errors[0];
    const auto checked = api::CheckTrainingJob(object, "test", 0);
    EXPECT_FALSE(checked.ok()) << "api/ accepts " << pointer << " = " << value;
  }
}

// The API server takes a job of every registered family, and of no other.
TEST(CrdSchemaTest, TheFamilyEnumIsEveryRegisteredFamily) {
  std::vector<std::string> registered;
  for (const api::ModelFamily* f : api::Families()) registered.emplace_back(f->name());
  const json family = CrdSchema()["properties"]["spec"]["properties"]["model"]["properties"]["family"];
  EXPECT_EQ(family.at("enum").get<std::vector<std::string>>(), registered);
}

// Every spec field the API knows (ToJson writes them all, defaults included) is in the
// schema, which with strict validation refuses a field it does not list; so is each
// SMP alias of the pipeline's.
TEST(CrdSchemaTest, ListsEveryFieldOfTheApi) {
  api::CheckedJob job = api::LoadTrainingJobs("examples/gpt2-124m-2x8.yaml").at(0);
  ASSERT_TRUE(job.ok());
  api::ParallelismSpec& p = job.job.spec.parallelism;
  p.pipeline_parallel_degree = 2;
  p.pipeline_schedule = "Interleaved1F1B";
  p.pipeline_virtual_stages = 2;
  api::ModelSpec& m = job.job.spec.model;  // a mixture of experts' fields too (ToJson leaves unset ones out)
  m.experts = 8, m.experts_per_token = 2, m.moe_intermediate_size = 64, m.norm_topk_prob = true;
  m.decoder_sparse_step = 1, m.mlp_only_layers = {0};
  json object = api::ToJson(job.job);
  object.erase("status");
  for (const char* field : {"pipelineParallelDegree", "pipelineSchedule", "pipelineVirtualStages"}) {
    ASSERT_TRUE(object["spec"]["parallelism"].contains(field)) << field;
  }
  const auto errors = SchemaErrors(object);
  EXPECT_TRUE(errors.empty()) << errors.size() << " errors, the first: " << (errors.empty() ? "" : errors[0]);

  json smp = api::ReadManifestFile("examples/gpt2-124m-2x8.yaml").at(0).object;
  smp["spec"]["parallelism"]["pipeline_parallel_degree"] = 2;
  EXPECT_TRUE(SchemaErrors(smp).empty());
  EXPECT_EQ(api::CheckTrainingJob(smp, "test", 0).job.spec.parallelism.pipeline_parallel_degree, 2);
  for (const auto& [field, value] : std::vector<std::pair<std::string, json>>{
           {"pipelineParallelDegree", 0}, {"pipelineVirtualStages", 65}, {"pipeline_parallel_degree", 0}}) {
    json bad = smp;
    bad["spec"]["parallelism"].erase("pipeline_parallel_degree");
    bad["spec"]["parallelism"][field] = value;
    EXPECT_FALSE(SchemaErrors(bad).empty()) << field << " = " << value;
    EXPECT_FALSE(api::CheckTrainingJob(bad, "test", 0).ok()) << field << " = " << value;
  }
}

api::TrainingJob Job124m() {
  api::TrainingJob job = api::LoadTrainingJobs("examples/gpt2-124m-2x8.yaml").at(0).job;
  job.metadata.uid = "uid-1";
  return job;
}

// The rank table of `job` placed on nodes node-a and node-b.
api::RankTable TwoNodeTable(const api::TrainingJob& job) {
  scheduler::Placement placement;
  placement.nodes = {"node-a", "node-b"};
  placement.paths = {{"l1", "l2", "l3", "node-a"}, {"l1", "l2", "l3", "node-b"}};
  return scheduler::MakeRankTable(placement, job.spec.topology.levels, 8);
}

TEST(BuildersTest, PodCarriesTheWorkerContract) {
  api::TrainingJob job = Job124m();
  const api::RankTable table = TwoNodeTable(job);
  const json pod = BuildPod(job, table, 3, 1, 5);
  EXPECT_EQ(pod["metadata"]["name"], "gpt2-124m-g3-1");
  EXPECT_EQ(pod["metadata"]["ownerReferences"][0]["uid"], "uid-1");
  EXPECT_EQ(pod["metadata"]["labels"]["meshtrain.dev/node-rank"], "1");
  EXPECT_EQ(pod["spec"]["restartPolicy"], "Never");
  EXPECT_EQ(pod["spec"]["hostname"], "gpt2-124m-1");
  EXPECT_EQ(pod["spec"]["subdomain"], "gpt2-124m");
  EXPECT_GE(pod["spec"]["terminationGracePeriodSeconds"].get<int>(), 60);
  EXPECT_EQ(pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]
               ["matchExpressions"][0]["values"][0],
            "node-b");
  const json& c = pod["spec"]["containers"][0];
  EXPECT_EQ(c["resources"]["limits"]["nvidia.com/gpu"], "8");
  EXPECT_EQ(c["resources"]["limits"]["vpc.amazonaws.com/efa"], "4");
  std::map<std::string, std::string> env;
  for (const auto& e : c["env"]) {
    env[e["name"]] = e.contains("valueFrom") ? "from " + e["valueFrom"]["fieldRef"]["fieldPath"].get<std::string>()
                                             : e["value"].get<std::string>();
  }
  EXPECT_EQ(env["MESHTRAIN_POD_IP"], "from status.podIP");  // the worker serves metrics there
  EXPECT_EQ(env["MESHTRAIN_NODE_RANK"], "1");
  EXPECT_EQ(env["MESHTRAIN_NNODES"], "2");
  EXPECT_EQ(env["MESHTRAIN_NPROC_PER_NODE"], "8");
  EXPECT_EQ(env["WORLD_SIZE"], "16");
  EXPECT_EQ(env["MESHTRAIN_COORDINATOR"], "gpt2-124m-0.gpt2-124m.training.svc:29500");
  EXPECT_EQ(env["MESHTRAIN_RANK_TABLE"], "/etc/meshtrain/rank-table.json");
  EXPECT_EQ(env["MESHTRAIN_ATTEMPT"], "5");  // the launcher starts the ranks at the gang's attempt
  EXPECT_EQ(env.count("MESHTRAIN_SAMPLE_TOKENS"), 0u);  // no tokenizer: no sample
  {
    api::TrainingJob with_tokenizer = job;
    with_tokenizer.spec.model.tokenizer = "/data/gpt2";
    const json sampling = BuildPod(with_tokenizer, table, 3, 1, 5);
    bool samples = false;
    for (const auto& e : sampling["spec"]["containers"][0]["env"])
      samples = samples || (e["name"] == "MESHTRAIN_SAMPLE_TOKENS" && e["value"] == "300");
    EXPECT_TRUE(samples) << "a job with spec.model.tokenizer has rank 0 print a sample as text";
  }
  // The Store key: the one entry of the job's Secret that this volume holds, mounted
  // read-only; the key is in no env var.
  EXPECT_EQ(env["MESHTRAIN_STORE_KEY_FILE"], "/etc/meshtrain-store/key");
  const json key_volume = {{"name", "store-key"},
                           {"secret",
                            {{"secretName", "gpt2-124m-secret"},
                             {"defaultMode", 0400},
                             {"items", json::array({{{"key", "key"}, {"path", "key"}}})}}}};
  EXPECT_EQ(pod["spec"]["volumes"][1], key_volume);
  bool key_mount = false;
  for (const auto& m : c["volumeMounts"])
    key_mount = key_mount || (m["name"] == "store-key" && m["mountPath"] == "/etc/meshtrain-store" && m["readOnly"] == true);
  EXPECT_TRUE(key_mount) << pod.dump(2);
  EXPECT_EQ(env.count("MESHTRAIN_LAUNCHER_TOKEN_FILE"), 0u) << "no token until the reconciler mounts it";
  bool shm = false;
  for (const auto& v : pod["spec"]["volumes"]) shm = shm || (v["name"] == "dshm" && v["emptyDir"]["medium"] == "Memory");
  EXPECT_TRUE(shm);
  json written = api::ReadManifestFile("examples/gpt2-124m-2x8.yaml").at(0).object;
  written["spec"]["parallelism"]["tensorParallelSeed"] = 3;  // without dropout: a warning both must see
  const json cm = BuildConfigMap(job, written["spec"], table, 3);
  EXPECT_EQ(cm["metadata"]["labels"]["meshtrain.dev/gang"], "3");
  const auto spec = api::ParseManifestText(cm["data"]["job.json"].get<std::string>(), "job.json");
  const api::CheckedJob worker_view = api::CheckTrainingJob(spec.at(0).object, "job.json", 0);
  EXPECT_TRUE(worker_view.ok());
  // The job's uid, which its checkpoints carry so that its restarts find them.
  EXPECT_EQ(worker_view.job.metadata.uid, job.metadata.uid);
  EXPECT_FALSE(job.metadata.uid.empty());
  // The worker sees what the user wrote: the same job, defaults and warnings as the operator.
  const api::CheckedJob operator_view = api::CheckTrainingJob(written, "job.json", 0);
  EXPECT_EQ(worker_view.job.spec, operator_view.job.spec);
  EXPECT_EQ(worker_view.defaults, operator_view.defaults);
  EXPECT_EQ(worker_view.warnings, operator_view.warnings);
  EXPECT_FALSE(worker_view.warnings.empty());
}

// The operator's key of these tests: bytes 0 to 31.
std::string TestLauncherKey() {
  std::string key;
  for (int i = 0; i < 32; ++i) key += char(i);
  return key;
}

TEST(BuildersTest, JobSecretIsOwnedImmutableAndHoldsTheKeyAndEachNodeRanksToken) {
  api::TrainingJob job = Job124m();
  const std::string key(32, '\x9c');
  const json secret = BuildJobSecret(job, key, TestLauncherKey());
  EXPECT_EQ(secret["metadata"]["name"], "gpt2-124m-secret");
  EXPECT_EQ(secret["metadata"]["ownerReferences"][0]["uid"], "uid-1");
  EXPECT_EQ(secret["immutable"], true);
  const json& data = secret["data"];
  ASSERT_EQ(data.size(), 3u) << data;  // the key, and a token for each of spec.nodes 2
  EXPECT_EQ(kube::DecodeBase64(data["key"].get<std::string>()), key);
  for (int64_t rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(kube::DecodeBase64(data["launcher-token-" + std::to_string(rank)].get<std::string>()),
              LauncherToken(TestLauncherKey(), "uid-1", rank));
  }
  // An operator without a key gives its pods no token: the Secret holds the Store key alone.
  EXPECT_EQ(BuildJobSecret(job, key, "")["data"], (json{{"key", kube::EncodeBase64(key)}}));
}

TEST(BuildersTest, APodMountsOnlyItsOwnLauncherTokenReadOnly) {
  api::TrainingJob job = Job124m();
  const api::RankTable table = TwoNodeTable(job);
  json pod = BuildPod(job, table, 3, 1, 5);
  MountLauncherToken(&pod);
  const json token_volume = {{"name", "launcher-token"},
                             {"secret",
                              {{"secretName", "gpt2-124m-secret"},
                               {"defaultMode", 0400},
                               {"items", json::array({{{"key", "launcher-token-1"}, {"path", "token"}}})}}}};
  EXPECT_EQ(pod["spec"]["volumes"].back(), token_volume);
  const json& c = pod["spec"]["containers"][0];
  EXPECT_EQ(c["volumeMounts"].back(),
            (json{{"name", "launcher-token"}, {"mountPath", "/etc/meshtrain-launcher"}, {"readOnly", true}}));
  EXPECT_EQ(c["env"].back(), (json{{"name", "MESHTRAIN_LAUNCHER_TOKEN_FILE"}, {"value", "/etc/meshtrain-launcher/token"}}));
}

TEST(LauncherTokenTest, DerivesOneTokenPerJobAndNodeRankUnderTheOperatorsKey) {
  // The derivation is fixed: the Secrets of running jobs hold its tokens, so an operator
  // that derived them otherwise could instruct none of their launchers. (Python:
  // hmac.new(bytes(range(32)), b"meshtrain launcher token\0uid-1\0" b"0", "sha256").hexdigest())
  const std::string key = TestLauncherKey();
  EXPECT_EQ(LauncherToken(key, "uid-1", 0), "10a3db49b72607bdd465444a4f4e4ecf5693bd43adf5d878c4aba9709bbd9ebb");
  EXPECT_EQ(LauncherToken(key, "uid-1", 1), "3837c2fa8c125b9db339a775d1bf8fc33a5863e922335cbfbb55e5a2be2fd1d3");
  // Another job (uid), another node rank or another operator's key: another token.
  std::set<std::string> tokens = {LauncherToken(key, "uid-1", 0), LauncherToken(key, "uid-1", 1),
                                  LauncherToken(key, "uid-2", 0), LauncherToken(key, "uid-10", 0),
                                  LauncherToken(key, "uid-1", 10), LauncherToken(std::string(32, 'k'), "uid-1", 0)};
  EXPECT_EQ(tokens.size(), 6u);
}

TEST(LauncherTokenTest, ACallCarriesTheAttemptAndTheToken) {
  const LauncherCall call{json::object(), "stop", 3};
  EXPECT_EQ(LauncherCallTarget(call, "10a3db49b726"), "/attempt/stop?attempt=3&token=10a3db49b726");
}

TEST(LauncherTokenTest, TheKeyFileMustHoldAtLeast32Bytes) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / ("launcher-key-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::string good = (dir / "good").string(), short_key = (dir / "short").string();
  std::ofstream(good, std::ios::binary) << TestLauncherKey();
  std::ofstream(short_key, std::ios::binary) << std::string(31, 'k');
  EXPECT_EQ(LoadLauncherKey(good), TestLauncherKey()) << "every byte, a NUL too";
  auto error_of = [](const std::string& path) -> std::string {
    try {
      LoadLauncherKey(path);
    } catch (const std::runtime_error& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_EQ(error_of(short_key), "the launcher key file " + short_key + " holds 31 bytes; the key must have at least 32");
  EXPECT_EQ(error_of((dir / "missing").string()),
            "the launcher key file " + (dir / "missing").string() + ": cannot open it: No such file or directory");
  std::filesystem::remove_all(dir);
}

TEST(BuildersTest, NetworkPolicyAdmitsTheJobTheOperatorAndTheNamedScrapers) {
  api::TrainingJob job = Job124m();
  NetworkPolicyDefaults defaults;
  defaults.operator_from = json::array({{{"namespaceSelector", {{"matchLabels", {{"kubernetes.io/metadata.name", "meshtrain"}}}}},
                                         {"podSelector", {{"matchLabels", {{"app.kubernetes.io/component", "operator"}}}}}}});
  defaults.metrics_from = json::array({{{"namespaceSelector", json::object()},
                                        {"podSelector", {{"matchLabels", {{"app.kubernetes.io/name", "prometheus"}}}}}}});
  const json policy = BuildNetworkPolicy(job, defaults);
  EXPECT_EQ(policy["metadata"]["ownerReferences"][0]["uid"], "uid-1");
  const json same_job = {{"matchLabels", {{"meshtrain.dev/job-name", "gpt2-124m"}}}};
  EXPECT_EQ(policy["spec"]["podSelector"], same_job);
  EXPECT_EQ(policy["spec"]["policyTypes"], json::array({"Ingress"}));
  const json& ingress = policy["spec"]["ingress"];
  ASSERT_EQ(ingress.size(), 3u);
  EXPECT_EQ(ingress[0]["from"][0]["podSelector"], same_job);  // every port, from the job's pods only
  EXPECT_FALSE(ingress[0].contains("ports"));
  // The operator reads the metrics and instructs the launchers; the scrapers only read.
  EXPECT_EQ(ingress[1]["from"], defaults.operator_from);
  EXPECT_EQ(ingress[1]["ports"], (json::array({{{"protocol", "TCP"}, {"port", 9400}}, {{"protocol", "TCP"}, {"port", 9401}}})));
  EXPECT_EQ(ingress[2]["from"], defaults.metrics_from);
  EXPECT_EQ(ingress[2]["ports"], (json::array({{{"protocol", "TCP"}, {"port", 9400}}})));
  EXPECT_FALSE(policy["spec"].contains("egress"));

  // Closed egress: the job's pods and DNS. No operator and no scrapers: only the job's pods.
  defaults.operator_from = json::array();
  defaults.metrics_from = json::array();
  defaults.restrict_egress = true;
  const json closed = BuildNetworkPolicy(job, defaults);
  EXPECT_EQ(closed["spec"]["ingress"].size(), 1u);
  EXPECT_EQ(closed["spec"]["policyTypes"], json::array({"Ingress", "Egress"}));
  ASSERT_EQ(closed["spec"]["egress"].size(), 2u);
  EXPECT_EQ(closed["spec"]["egress"][0]["to"][0]["podSelector"], same_job);
  EXPECT_EQ(closed["spec"]["egress"][1]["ports"][0]["port"], 53);
  EXPECT_FALSE(closed["spec"]["egress"][1].contains("to"));
}

// A launcher's GET /attempt; what a failed rank wrote reaches Events on one line, cut to
// kFailureReasonBytes at a character's boundary.
TEST(LauncherStateTest, ParsesTheAttemptAndWhatTheFailedRankSaid) {
  EXPECT_FALSE(ParseLauncherState(nlohmann::json{{"state", "running"}}));
  EXPECT_FALSE(ParseLauncherState(nlohmann::json{{"attempt", "1"}, {"state", "running"}}));
  const auto running = ParseLauncherState(nlohmann::json{{"attempt", 2}, {"state", "running"}});
  ASSERT_TRUE(running);
  EXPECT_EQ(*running, (LauncherState{2, "running", std::nullopt, std::nullopt, ""}));
  const auto failed = ParseLauncherState(
      nlohmann::json{{"attempt", 0}, {"state", "failed"}, {"exitCode", 75}, {"rank", 0},
                     {"reason", "rank 2 made no progress\nfor 3.0 s"}});
  ASSERT_TRUE(failed);
  EXPECT_EQ(*failed, (LauncherState{0, "failed", 75, 0, "rank 2 made no progress for 3.0 s"}));
  // 399 bytes, then a 2-byte character that would straddle the cut: it goes whole.
  const std::string long_reason = std::string(api::worker::kFailureReasonBytes - 1, 'x') + "\xc3\xa9" + "tail";
  const auto cut = ParseLauncherState(nlohmann::json{{"attempt", 0}, {"state", "failed"}, {"reason", long_reason}});
  ASSERT_TRUE(cut);
  EXPECT_EQ(cut->reason, std::string(api::worker::kFailureReasonBytes - 1, 'x'));
}

TEST(ProgressTest, ParsesWorkerMetrics) {
  api::ProgressStatus p;
  EXPECT_FALSE(ParseProgress("# nothing\nother_metric 3\n", &p));
  EXPECT_TRUE(ParseProgress(
      "# TYPE meshtrain_train_step gauge\nmeshtrain_train_step{job=\"x\"} 100\nmeshtrain_train_loss 3.25\n"
      "meshtrain_train_tokens_per_second 5000\nmeshtrain_train_steps 1100\nmeshtrain_train_tokens_per_step 500\n",
      &p));
  EXPECT_EQ(p.step, 100);
  EXPECT_DOUBLE_EQ(p.loss, 3.25);
  EXPECT_DOUBLE_EQ(p.tokens_per_second, 5000);
  EXPECT_EQ(p.eta_seconds, 100);  // 1000 steps x 500 tokens / 5000 tokens/s
  EXPECT_FALSE(p.resumed_from_step);
  api::ProgressStatus resumed;
  ASSERT_TRUE(ParseProgress("meshtrain_train_step 30\nmeshtrain_train_resumed_from_step 20\n"
                            "meshtrain_checkpoint_last_step 20\n",
                            &resumed));
  EXPECT_EQ(resumed.resumed_from_step, std::optional<int64_t>(20));
  EXPECT_EQ(resumed.checkpoint_step, std::optional<int64_t>(20));
  EXPECT_FALSE(resumed.damaged_checkpoints);
  ASSERT_TRUE(ParseProgress("meshtrain_train_step 21\nmeshtrain_train_resumed_from_step 20\n"
                            "meshtrain_train_resume_damaged_checkpoints 2\n",
                            &resumed));
  EXPECT_EQ(resumed.damaged_checkpoints, std::optional<int64_t>(2));
  api::ProgressStatus fresh;
  ASSERT_TRUE(ParseProgress("meshtrain_train_step 3\nmeshtrain_train_resumed_from_step -1\n"
                            "meshtrain_checkpoint_last_step -1\n",
                            &fresh));
  EXPECT_FALSE(fresh.resumed_from_step) << "-1: a run that started fresh";
  EXPECT_FALSE(fresh.checkpoint_step);
}

}  // namespace
}  // namespace meshtrain::controller
