// What every worker pod gets unless its TrainingJob says otherwise: the EKS defaults the
// Helm chart writes into a ConfigMap (helm/meshtrain/values.yaml, workerDefaults), which
// the operator reads with --worker-defaults FILE at start.
//
// A job's written fields win: spec.resources.efa over the count for its instance type,
// spec.template.tolerations over the default tolerations, spec.topology.levels over the
// default levels, and an env entry of the job over an EFA one of the same name.
//
// Thread-safety: plain values and pure functions.

#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "api/training_job.h"

namespace meshtrain::controller {

inline constexpr const char* kInstanceTypeLabel = "node.kubernetes.io/instance-type";

// Each job's NetworkPolicy (values.yaml, networkPolicy): ingress to a job's pods only from
// pods of the same job; to the metrics port also from `operator_from` and `metrics_from`;
// to the launcher port also from `operator_from` alone. The chart sets `operator_from` to
// its operator's pods (which read rank 0's metrics and instruct the launchers), and
// `metrics_from` to the scrapers of its values.
struct NetworkPolicyDefaults {
  bool enabled = true;
  nlohmann::json operator_from = nlohmann::json::array();  // NetworkPolicyPeer objects
  nlohmann::json metrics_from = nlohmann::json::array();   // NetworkPolicyPeer objects
  bool restrict_egress = false;  // true: egress only to the job's own pods and to DNS
  bool operator==(const NetworkPolicyDefaults&) const = default;
};

struct WorkerDefaults {
  std::map<std::string, int64_t> efa_per_instance_type;  // by the job's nodeSelector instance type
  std::string hugepages_2mi;   // hugepages-2Mi per pod that uses EFA; "" for none
  std::string shm_size_limit;  // sizeLimit of the memory-backed /dev/shm; "" for none
  std::vector<api::EnvVar> efa_env;  // for pods that use EFA
  std::vector<api::Toleration> tolerations;
  std::vector<std::string> topology_levels;  // empty: api's DefaultTopologyLevels()
  NetworkPolicyDefaults network_policy;
  bool operator==(const WorkerDefaults&) const = default;
};

// Reads the YAML or JSON file (every key of values.yaml's workerDefaults is optional).
// Throws std::runtime_error naming the file and the key for an unreadable file, an
// unknown key or a wrong type.
WorkerDefaults LoadWorkerDefaults(const std::string& path);
WorkerDefaults ParseWorkerDefaults(const nlohmann::json& object, const std::string& source);

// Fills what `job` left out (`written_spec` is its spec as written) from the defaults,
// and records each value so derived in `derived` (shown in status.defaults).
void ApplyWorkerDefaults(const WorkerDefaults& defaults, const nlohmann::json& written_spec, api::TrainingJob* job,
                         std::vector<api::DerivedDefault>* derived);

}  // namespace meshtrain::controller
