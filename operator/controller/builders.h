// The objects a TrainingJob owns, built as plain JSON: a headless Service for
// rendezvous DNS, a ConfigMap holding the spec and the rank table, a Secret holding the
// rendezvous Store's key and each node rank's launcher token, a NetworkPolicy that keeps
// other pods out, and one Pod per node. Pure functions: the same job and placement always give the same objects,
// so creating them again is harmless (the API server answers AlreadyExists).
//
// Pod names carry the gang number (status.gang), so a recreated gang never collides
// with pods of the previous one that are still terminating; hostnames do not, so DNS
// names are stable: <job>-<nodeRank>.<job>.<namespace>.svc. A gang restarted in place
// keeps its pods; their launchers follow the attempt (status.restarts). A pod replaced on
// another node is named with the attempt it joins too.

#pragma once

#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "api/rank_table.h"
#include "api/training_job.h"
#include "operator/controller/worker_defaults.h"

namespace meshtrain::controller {

inline constexpr int kTerminationGraceSeconds = 120;  // time for workers to checkpoint on SIGTERM

inline constexpr const char* kJobNameLabel = "meshtrain.dev/job-name";
inline constexpr const char* kNodeRankLabel = "meshtrain.dev/node-rank";
inline constexpr const char* kGangLabel = "meshtrain.dev/gang";
inline constexpr const char* kConfigDir = "/etc/meshtrain";
inline constexpr const char* kStoreKeyDir = "/etc/meshtrain-store";  // the Secret's key, mounted read-only
inline constexpr const char* kLauncherTokenDir = "/etc/meshtrain-launcher";  // the pod's token, mounted read-only

// An ownerReference to the job (controller: true, blockOwnerDeletion: true).
nlohmann::json OwnerReference(const api::TrainingJob& job);

std::string ConfigMapName(const std::string& job_name);
// The job's Secret: "key", the Store key, and LauncherTokenKey(r) for each node rank r.
std::string JobSecretName(const std::string& job_name);
std::string LauncherTokenKey(int64_t node_rank);
std::string PodName(const std::string& job_name, int64_t gang, int64_t node_rank);
// The name of a held pod (BuildPod's `held`) that joins attempt `attempt`.
std::string HeldPodName(const std::string& job_name, int64_t gang, int64_t node_rank, int64_t attempt);

nlohmann::json BuildService(const api::TrainingJob& job);
// The ConfigMap of gang `gang`: job.json (`written_spec`, the spec as the user wrote it,
// from which every worker derives the same defaults and warnings that the operator
// did), rank-table.json.
nlohmann::json BuildConfigMap(const api::TrainingJob& job, const nlohmann::json& written_spec,
                              const api::RankTable& table, int64_t gang);
// The job's Secret, one for the job's life: its Store key (`store_key`: random bytes the
// caller drew), and with the operator's `launcher_key` the launcher token of each node rank
// below spec.nodes (LauncherToken). Every gang's pods mount it. The operator creates it and
// never reads it back.
nlohmann::json BuildJobSecret(const api::TrainingJob& job, const std::string& store_key,
                              const std::string& launcher_key);
// Ingress to the job's pods only from pods of the same job; to the metrics port also from
// `policy.operator_from` (the operator reads rank 0's progress) and `policy.metrics_from`
// (the scrapers); to the launcher port also from `policy.operator_from` alone. Egress
// everywhere, or with restrict_egress only to the job's pods and DNS.
nlohmann::json BuildNetworkPolicy(const api::TrainingJob& job, const NetworkPolicyDefaults& policy);
// `worker` gives a pod that uses EFA its hugepages, and /dev/shm its size limit; its
// launcher starts the ranks at `attempt`, or with `held` (a pod that replaces one of a
// gang restarting in place) waits for the operator's start of it. A held pod's name ends
// in "-a<attempt>": the pod it replaces may still be terminating under the plain name.
// Its launcher has no token until the caller, which holds the operator's key, mounts it
// (MountLauncherToken).
nlohmann::json BuildPod(const api::TrainingJob& job, const api::RankTable& table, int64_t gang, int64_t node_rank,
                        int64_t attempt, const WorkerDefaults& worker = {}, bool held = false);
// Gives a pod of BuildPod its launcher token: its node rank's token of the job's Secret,
// mounted read-only as the file MESHTRAIN_LAUNCHER_TOKEN_FILE names. The token itself is in
// no environment variable and no spec.
void MountLauncherToken(nlohmann::json* pod);
// The node rank a pod's label gives it; -1 when the label is missing or not a number.
int64_t NodeRankLabel(const nlohmann::json& pod);
// The key ("namespace/name") of the job a pod's kJobNameLabel names; empty without one.
std::string JobKeyOf(const nlohmann::json& pod);

}  // namespace meshtrain::controller
