#include "operator/controller/builders.h"

#include "api/json_codec.h"
#include "api/worker_contract.h"
#include "operator/controller/launcher_client.h"
#include "operator/kube/base64.h"
#include "operator/kube/resource.h"

namespace meshtrain::controller {

namespace env = api::worker::env;

using nlohmann::json;

namespace {

json Labels(const api::TrainingJob& job) { return {{kJobNameLabel, job.metadata.name}}; }

json Meta(const api::TrainingJob& job, const std::string& name, json labels) {
  return {{"name", name}, {"namespace", job.metadata.namespace_}, {"labels", std::move(labels)},
          {"ownerReferences", json::array({OwnerReference(job)})}};
}

json Env(const std::string& name, const std::string& value) { return {{"name", name}, {"value", value}}; }

// A volume of the job's Secret holding only its entry `key`, as the file `path`.
json SecretVolume(const std::string& volume, const std::string& job_name, const std::string& key,
                  const std::string& path) {
  return {{"name", volume},
          {"secret",
           {{"secretName", JobSecretName(job_name)},
            {"defaultMode", 0400},
            {"items", json::array({{{"key", key}, {"path", path}}})}}}};
}

json TcpPorts(std::initializer_list<int> ports) {
  json out = json::array();
  for (const int port : ports) out.push_back({{"protocol", "TCP"}, {"port", port}});
  return out;
}

}  // namespace

json OwnerReference(const api::TrainingJob& job) {
  return {{"apiVersion", std::string(api::kApiVersion)}, {"kind", std::string(api::kKind)},
          {"name", job.metadata.name}, {"uid", job.metadata.uid}, {"controller", true},
          {"blockOwnerDeletion", true}};
}

std::string ConfigMapName(const std::string& job_name) { return job_name + "-config"; }

std::string JobSecretName(const std::string& job_name) { return job_name + "-secret"; }

std::string LauncherTokenKey(int64_t node_rank) { return "launcher-token-" + std::to_string(node_rank); }

std::string PodName(const std::string& job_name, int64_t gang, int64_t node_rank) {
  return job_name + "-g" + std::to_string(gang) + "-" + std::to_string(node_rank);
}

std::string HeldPodName(const std::string& job_name, int64_t gang, int64_t node_rank, int64_t attempt) {
  return PodName(job_name, gang, node_rank) + "-a" + std::to_string(attempt);
}

json BuildService(const api::TrainingJob& job) {
  return {{"apiVersion", "v1"},
          {"kind", "Service"},
          {"metadata", Meta(job, job.metadata.name, Labels(job))},
          {"spec",
           {{"clusterIP", "None"},
            {"publishNotReadyAddresses", true},  // rendezvous happens before workers are Ready
            {"selector", Labels(job)},
            {"ports", json::array({{{"name", "coordinator"}, {"port", api::worker::kCoordinatorPort}, {"protocol", "TCP"}}})}}}};
}

json BuildConfigMap(const api::TrainingJob& job, const json& written_spec, const api::RankTable& table,
                    int64_t gang) {
  json labels = Labels(job);
  labels[kGangLabel] = std::to_string(gang);
  // The spec alone (and the uid, which the checkpoints of this job's run carry), as a
  // TrainingJob manifest the worker reads with the api/ library. Not
  // the defaulted spec: a derived value would read as written there, and a neutral
  // default such as tensorParallelSeed 0 as set.
  const json spec_doc = {{"apiVersion", job.api_version},
                         {"kind", job.kind},
                         {"metadata",
                          {{"name", job.metadata.name}, {"namespace", job.metadata.namespace_}, {"uid", job.metadata.uid}}},
                         {"spec", written_spec}};
  return {{"apiVersion", "v1"},
          {"kind", "ConfigMap"},
          {"metadata", Meta(job, ConfigMapName(job.metadata.name), labels)},
          {"data", {{"job.json", spec_doc.dump(2)}, {"rank-table.json", api::ToJson(table).dump(2)}}}};
}

json BuildJobSecret(const api::TrainingJob& job, const std::string& store_key, const std::string& launcher_key) {
  json data = {{"key", kube::EncodeBase64(store_key)}};
  if (!launcher_key.empty()) {
    for (int64_t rank = 0; rank < job.spec.nodes; ++rank)
      data[LauncherTokenKey(rank)] = kube::EncodeBase64(LauncherToken(launcher_key, job.metadata.uid, rank));
  }
  return {{"apiVersion", "v1"},
          {"kind", "Secret"},
          {"metadata", Meta(job, JobSecretName(job.metadata.name), Labels(job))},
          {"type", "Opaque"},
          {"immutable", true},
          {"data", data}};
}

json BuildNetworkPolicy(const api::TrainingJob& job, const NetworkPolicyDefaults& policy) {
  const json same_job = {{"podSelector", {{"matchLabels", Labels(job)}}}};
  json ingress = json::array({{{"from", json::array({same_job})}}});
  const int metrics = api::worker::kMetricsPort, launcher = api::worker::kLauncherPort;
  if (!policy.operator_from.empty())
    ingress.push_back({{"from", policy.operator_from}, {"ports", TcpPorts({metrics, launcher})}});
  if (!policy.metrics_from.empty()) ingress.push_back({{"from", policy.metrics_from}, {"ports", TcpPorts({metrics})}});
  json spec = {{"podSelector", {{"matchLabels", Labels(job)}}}, {"ingress", ingress}};
  if (policy.restrict_egress) {
    spec["policyTypes"] = {"Ingress", "Egress"};
    spec["egress"] = json::array({
        {{"to", json::array({same_job})}},
        {{"ports", json::array({{{"protocol", "UDP"}, {"port", 53}}, {{"protocol", "TCP"}, {"port", 53}}})}},
    });
  } else {
    spec["policyTypes"] = {"Ingress"};
  }
  return {{"apiVersion", "networking.k8s.io/v1"},
          {"kind", "NetworkPolicy"},
          {"metadata", Meta(job, job.metadata.name, Labels(job))},
          {"spec", spec}};
}

json BuildPod(const api::TrainingJob& job, const api::RankTable& table, int64_t gang, int64_t node_rank,
              int64_t attempt, const WorkerDefaults& worker, bool held) {
  const auto& spec = job.spec;
  const std::string& name = job.metadata.name;
  const std::string coordinator_host = name + "-0." + name + "." + job.metadata.namespace_ + ".svc";
  const int64_t nodes = static_cast<int64_t>(table.nodes.size());
  json labels = Labels(job);
  labels[kNodeRankLabel] = std::to_string(node_rank);
  labels[kGangLabel] = std::to_string(gang);

  json env = json::array({
      Env(env::kJobName, name),
      Env(env::kNodeRank, std::to_string(node_rank)),
      Env(env::kNodes, std::to_string(nodes)),
      Env(env::kRanksPerNode, std::to_string(spec.gpus_per_node)),
      Env(env::kCoordinator, coordinator_host + ":" + std::to_string(api::worker::kCoordinatorPort)),
      Env(env::kConfig, std::string(kConfigDir) + "/job.json"),
      Env(env::kRankTable, std::string(kConfigDir) + "/rank-table.json"),
      Env(env::kStoreKeyFile, std::string(kStoreKeyDir) + "/key"),
      Env(env::kMetricsPort, std::to_string(api::worker::kMetricsPort)),
      Env(env::kAttempt, std::to_string(attempt)),
      {{"name", env::kPodIp}, {"valueFrom", {{"fieldRef", {{"fieldPath", "status.podIP"}}}}}},
      Env(env::kMasterAddr, coordinator_host),
      Env(env::kMasterPort, std::to_string(api::worker::kCoordinatorPort)),
      Env(env::kWorldSize, std::to_string(nodes * spec.gpus_per_node)),
  });
  if (held) env.push_back(Env(env::kLauncherHeld, "1"));
  if (!spec.model.tokenizer.empty()) env.push_back(Env(env::kSampleTokens, std::to_string(env::kDefaultSampleTokens)));
  for (const auto& e : spec.template_.env) env.push_back(Env(e.name, e.value));

  json limits = {{"nvidia.com/gpu", std::to_string(spec.resources.gpu.value_or(spec.gpus_per_node))}};
  if (spec.resources.efa > 0) {
    limits["vpc.amazonaws.com/efa"] = std::to_string(spec.resources.efa);
    if (!worker.hugepages_2mi.empty()) limits["hugepages-2Mi"] = worker.hugepages_2mi;
  }

  json volumes = json::array({
      {{"name", "meshtrain-config"}, {"configMap", {{"name", ConfigMapName(name)}}}},
      SecretVolume("store-key", name, "key", "key"),
      {{"name", "dshm"},
       {"emptyDir", worker.shm_size_limit.empty() ? json{{"medium", "Memory"}}
                                                   : json{{"medium", "Memory"}, {"sizeLimit", worker.shm_size_limit}}}},
  });
  json mounts = json::array({
      {{"name", "meshtrain-config"}, {"mountPath", kConfigDir}, {"readOnly", true}},
      {{"name", "store-key"}, {"mountPath", kStoreKeyDir}, {"readOnly", true}},
      {{"name", "dshm"}, {"mountPath", "/dev/shm"}},
  });
  for (const auto& v : spec.template_.volumes) volumes.push_back(v);
  for (const auto& m : spec.template_.volume_mounts) {
    json mount = {{"name", m.name}, {"mountPath", m.mount_path}};
    if (m.read_only) mount["readOnly"] = true;
    mounts.push_back(mount);
  }

  json tolerations = json::array();
  for (const auto& t : spec.template_.tolerations) {
    json tol = {{"operator", t.operator_}};
    if (!t.key.empty()) tol["key"] = t.key;
    if (!t.value.empty()) tol["value"] = t.value;
    if (!t.effect.empty()) tol["effect"] = t.effect;
    if (t.toleration_seconds) tol["tolerationSeconds"] = *t.toleration_seconds;
    tolerations.push_back(tol);
  }

  json container = {
      {"name", "worker"},
      {"image", spec.image},
      {"command", {"meshtrain-worker", "launch"}},
      {"env", env},
      {"ports", json::array({{{"name", "metrics"}, {"containerPort", api::worker::kMetricsPort}, {"protocol", "TCP"}},
                             {{"name", "coordinator"}, {"containerPort", api::worker::kCoordinatorPort}, {"protocol", "TCP"}},
                             {{"name", "launcher"}, {"containerPort", api::worker::kLauncherPort}, {"protocol", "TCP"}}})},
      {"resources", {{"limits", limits}, {"requests", limits}}},
      {"volumeMounts", mounts},
  };
  json pod_spec = {
      {"restartPolicy", "Never"},
      {"hostname", name + "-" + std::to_string(node_rank)},
      {"subdomain", name},
      {"terminationGracePeriodSeconds", kTerminationGraceSeconds},
      {"containers", json::array({container})},
      {"volumes", volumes},
      {"affinity",
       {{"nodeAffinity",
         {{"requiredDuringSchedulingIgnoredDuringExecution",
           {{"nodeSelectorTerms",
             json::array({{{"matchExpressions",
                            json::array({{{"key", "kubernetes.io/hostname"}, {"operator", "In"},
                                          {"values", json::array({table.nodes.at(node_rank).name})}}})}}})}}}}}}},
  };
  if (!tolerations.empty()) pod_spec["tolerations"] = tolerations;
  if (!spec.template_.node_selector.empty()) pod_spec["nodeSelector"] = spec.template_.node_selector;
  const std::string pod_name = held ? HeldPodName(name, gang, node_rank, attempt) : PodName(name, gang, node_rank);
  json metadata = Meta(job, pod_name, labels);
  metadata["annotations"] = {{"prometheus.io/scrape", "true"}, {"prometheus.io/port", std::to_string(api::worker::kMetricsPort)}};
  return {{"apiVersion", "v1"}, {"kind", "Pod"}, {"metadata", metadata}, {"spec", pod_spec}};
}

void MountLauncherToken(json* pod) {
  const std::string job_name = (*pod)["metadata"]["labels"].value(kJobNameLabel, "");
  json& spec = (*pod)["spec"];
  json& container = spec["containers"][0];
  spec["volumes"].push_back(SecretVolume("launcher-token", job_name, LauncherTokenKey(NodeRankLabel(*pod)), "token"));
  container["volumeMounts"].push_back({{"name", "launcher-token"}, {"mountPath", kLauncherTokenDir}, {"readOnly", true}});
  container["env"].push_back(Env(env::kLauncherTokenFile, std::string(kLauncherTokenDir) + "/token"));
}

int64_t NodeRankLabel(const json& pod) {
  const std::string label =
      pod.value("metadata", json::object()).value("labels", json::object()).value(kNodeRankLabel, "");
  if (label.empty() || label.size() > 9 || label.find_first_not_of("0123456789") != std::string::npos) return -1;
  return std::stoll(label);
}

std::string JobKeyOf(const json& pod) {
  const json& meta = pod["metadata"];
  const auto labels = meta.find("labels");
  if (labels == meta.end() || !labels->is_object()) return "";
  const auto job = labels->find(kJobNameLabel);
  if (job == labels->end() || !job->is_string()) return "";
  return kube::ObjectKey(meta.value("namespace", ""), job->get<std::string>());
}

}  // namespace meshtrain::controller
