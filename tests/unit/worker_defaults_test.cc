// The operator's worker defaults (the Helm chart's workerDefaults): parsing with errors
// that name the key, and a job's written fields winning over each default.

#include <fstream>

#include <gtest/gtest.h>

#include "api/manifest.h"
#include "operator/controller/builders.h"
#include "operator/controller/worker_defaults.h"
#include "operator/scheduler/placement.h"

namespace meshtrain::controller {
namespace {

using nlohmann::json;

const char* kChartDefaults = R"(
efaPerInstanceType: {p4d.24xlarge: 4, p5.48xlarge: 32}
hugepages2Mi: 5120Mi
shmSizeLimit: 64Gi
efaEnv:
  - {name: FI_PROVIDER, value: efa}
  - {name: NCCL_NET, value: "AWS Libfabric"}
tolerations:
  - {key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}
topologyLevels: [layer-a, layer-b, kubernetes.io/hostname]
)";

WorkerDefaults Defaults() {
  return ParseWorkerDefaults(api::ParseManifestText(kChartDefaults, "defaults.yaml").at(0).object, "defaults.yaml");
}

std::string ErrorOf(const std::string& yaml) {
  try {
    ParseWorkerDefaults(api::ParseManifestText(yaml, "bad.yaml").at(0).object, "bad.yaml");
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  return "";
}

TEST(WorkerDefaults, ParsesTheChartsValues) {
  const WorkerDefaults d = Defaults();
  EXPECT_EQ(d.efa_per_instance_type.at("p5.48xlarge"), 32);
  EXPECT_EQ(d.hugepages_2mi, "5120Mi");
  EXPECT_EQ(d.shm_size_limit, "64Gi");
  ASSERT_EQ(d.efa_env.size(), 2u);
  EXPECT_EQ(d.efa_env[1].value, "AWS Libfabric");
  ASSERT_EQ(d.tolerations.size(), 1u);
  EXPECT_EQ(d.tolerations[0].operator_, "Exists");
  EXPECT_EQ(d.topology_levels.size(), 3u);
  // The chart's own values.yaml, as written, parses too.
  const json values = api::ReadManifestFile("helm/meshtrain/values.yaml").at(0).object;
  EXPECT_EQ(ParseWorkerDefaults(values["workerDefaults"], "values.yaml").efa_per_instance_type.at("p4d.24xlarge"), 4);
  // Without a networkPolicy key, jobs still get one: it is on by default, as in the chart.
  EXPECT_TRUE(d.network_policy.enabled);
  EXPECT_FALSE(d.network_policy.restrict_egress);
  const WorkerDefaults off = ParseWorkerDefaults(
      api::ParseManifestText("networkPolicy: {enabled: false, restrictEgress: true, metricsFrom: "
                             "[{namespaceSelector: {matchLabels: {team: obs}}}], operatorFrom: "
                             "[{podSelector: {matchLabels: {app.kubernetes.io/component: operator}}}]}",
                             "np.yaml")
          .at(0)
          .object,
      "np.yaml");
  EXPECT_FALSE(off.network_policy.enabled);
  EXPECT_TRUE(off.network_policy.restrict_egress);
  EXPECT_EQ(off.network_policy.metrics_from[0]["namespaceSelector"]["matchLabels"]["team"], "obs");
  EXPECT_EQ(off.network_policy.operator_from[0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"], "operator");
  EXPECT_EQ(off.network_policy.operator_from.size(), 1u) << "the operator's peers are not the scrapers'";
}

TEST(WorkerDefaults, ErrorsNameTheKey) {
  EXPECT_EQ(ErrorOf("efaPerInstanceType: {p5.48xlarge: many}"),
            "bad.yaml: efaPerInstanceType.p5.48xlarge: must be an integer, not string");
  EXPECT_EQ(ErrorOf("hugepages: 1Gi"), "bad.yaml: hugepages: unknown key");
  EXPECT_EQ(ErrorOf("tolerations: [{key: a, operator: Like}]"), "bad.yaml: tolerations[0].operator: must be Exists or Equal");
  EXPECT_EQ(ErrorOf("efaEnv: [{value: x}]"), "bad.yaml: efaEnv[0].name: is required");
  EXPECT_EQ(ErrorOf("topologyLevels: layer"), "bad.yaml: topologyLevels: must be a list, not string");
  EXPECT_EQ(ErrorOf("efaPerInstanceType: {p5.48xlarge: 65}"), "bad.yaml: efaPerInstanceType.p5.48xlarge: must be in [0, 64]");
  EXPECT_EQ(ErrorOf("networkPolicy: {enabled: yes please}"), "bad.yaml: networkPolicy.enabled: must be true or false, not string");
  EXPECT_EQ(ErrorOf("networkPolicy: {metricsFrom: [{podSelecter: {}}]}"),
            "bad.yaml: networkPolicy.metricsFrom[0].podSelecter: unknown key");
  EXPECT_EQ(ErrorOf("networkPolicy: {metricsFrom: [{}]}"),
            "bad.yaml: networkPolicy.metricsFrom[0]: must name a podSelector, namespaceSelector or ipBlock");
  EXPECT_EQ(ErrorOf("networkPolicy: {metricsFrom: [{ipBlock: 10.0.0.0/8}]}"),
            "bad.yaml: networkPolicy.metricsFrom[0].ipBlock: must be a mapping, not string");
  EXPECT_EQ(ErrorOf("networkPolicy: {egress: closed}"), "bad.yaml: networkPolicy.egress: unknown key");
  EXPECT_EQ(ErrorOf("networkPolicy: {operatorFrom: {podSelector: {}}}"),
            "bad.yaml: networkPolicy.operatorFrom: must be a list, not object");
  EXPECT_EQ(ErrorOf("networkPolicy: {operatorFrom: [{}]}"),
            "bad.yaml: networkPolicy.operatorFrom[0]: must name a podSelector, namespaceSelector or ipBlock");
}

api::CheckedJob Job(const std::string& extra_spec) {
  const std::string yaml = R"(apiVersion: meshtrain.dev/v1alpha1
kind: TrainingJob
metadata: {name: j, namespace: ns}
spec:
  image: meshtrain:test
  nodes: 2
  gpusPerNode: 8
  model: {preset: gpt2-tiny}
  data: {train: /data/train.bin}
  training: {steps: 10, globalBatchTokens: 16384, microBatchSize: 1, warmupSteps: 1}
)" + extra_spec;
  return api::CheckTrainingJob(api::ParseManifestText(yaml, "job.yaml").at(0).object, "job.yaml", 0);
}

TEST(WorkerDefaults, FillWhatTheJobLeftOut) {
  api::CheckedJob checked = Job("  template: {nodeSelector: {node.kubernetes.io/instance-type: p5.48xlarge}}\n");
  ASSERT_TRUE(checked.ok());
  api::TrainingJob job = checked.job;
  std::vector<api::DerivedDefault> derived;
  const json written = {{"template", {{"nodeSelector", {{"node.kubernetes.io/instance-type", "p5.48xlarge"}}}}}};
  ApplyWorkerDefaults(Defaults(), written, &job, &derived);
  EXPECT_EQ(job.spec.resources.efa, 32);
  ASSERT_EQ(job.spec.template_.tolerations.size(), 1u);
  EXPECT_EQ(job.spec.template_.tolerations[0].key, "nvidia.com/gpu");
  EXPECT_EQ(job.spec.topology.levels, (std::vector<std::string>{"layer-a", "layer-b", "kubernetes.io/hostname"}));
  EXPECT_EQ(job.spec.topology.required_level, "layer-b");
  ASSERT_EQ(job.spec.template_.env.size(), 2u) << "EFA jobs get the aws-ofi-nccl environment";
  ASSERT_GE(derived.size(), 2u);
  EXPECT_EQ(derived[0].field, "spec.resources.efa");
  EXPECT_EQ(derived[0].value, "32");

  // The pod: EFA interfaces, hugepages and a bounded /dev/shm.
  scheduler::Placement placement;
  placement.nodes = {"a", "b"};
  placement.paths = {{"x", "y", "a"}, {"x", "y", "b"}};
  const auto table = scheduler::MakeRankTable(placement, job.spec.topology.levels, 8);
  const json pod = BuildPod(job, table, 0, 0, 0, Defaults());
  const json& limits = pod["spec"]["containers"][0]["resources"]["limits"];
  EXPECT_EQ(limits["vpc.amazonaws.com/efa"], "32");
  EXPECT_EQ(limits["hugepages-2Mi"], "5120Mi");
  bool shm = false;
  for (const auto& v : pod["spec"]["volumes"]) shm = shm || (v["name"] == "dshm" && v["emptyDir"]["sizeLimit"] == "64Gi");
  EXPECT_TRUE(shm);
}

TEST(WorkerDefaults, WrittenFieldsWin) {
  const std::string spec = R"(  resources: {efa: 2}
  topology: {levels: [rack, kubernetes.io/hostname]}
  template:
    nodeSelector: {node.kubernetes.io/instance-type: p5.48xlarge}
    tolerations: [{key: dedicated, operator: Equal, value: training, effect: NoSchedule}]
    env: [{name: FI_PROVIDER, value: tcp}]
)";
  api::CheckedJob checked = Job(spec);
  ASSERT_TRUE(checked.ok()) << checked.errors[0].ToString();
  const json written = api::ParseManifestText("apiVersion: x\nkind: y\nspec:\n" + spec, "w").at(0).object["spec"];
  api::TrainingJob job = checked.job;
  std::vector<api::DerivedDefault> derived;
  ApplyWorkerDefaults(Defaults(), written, &job, &derived);
  EXPECT_EQ(job.spec.resources.efa, 2);
  ASSERT_EQ(job.spec.template_.tolerations.size(), 1u);
  EXPECT_EQ(job.spec.template_.tolerations[0].key, "dedicated");
  EXPECT_EQ(job.spec.topology.levels, (std::vector<std::string>{"rack", "kubernetes.io/hostname"}));
  ASSERT_EQ(job.spec.template_.env.size(), 2u);
  EXPECT_EQ(job.spec.template_.env[0].value, "tcp") << "the job's FI_PROVIDER stays";
  EXPECT_EQ(job.spec.template_.env[1].name, "NCCL_NET");
  EXPECT_TRUE(derived.empty());
}

TEST(WorkerDefaults, AJobOnAnUnknownInstanceTypeGetsNoEfa) {
  api::CheckedJob checked = Job("  template: {nodeSelector: {node.kubernetes.io/instance-type: g6.xlarge}}\n");
  api::TrainingJob job = checked.job;
  std::vector<api::DerivedDefault> derived;
  ApplyWorkerDefaults(Defaults(), json::object(), &job, &derived);
  EXPECT_EQ(job.spec.resources.efa, 0);
  EXPECT_TRUE(job.spec.template_.env.empty());
  scheduler::Placement placement;
  placement.nodes = {"a", "b"};
  placement.paths = {{"a"}, {"b"}};
  const json pod = BuildPod(job, scheduler::MakeRankTable(placement, {"kubernetes.io/hostname"}, 8), 0, 0, 0, Defaults());
  EXPECT_FALSE(pod["spec"]["containers"][0]["resources"]["limits"].contains("hugepages-2Mi"));
}

}  // namespace
}  // namespace meshtrain::controller
