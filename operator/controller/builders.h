// The objects a TrainingJob owns, built as plain JSON: a headless Service for
// rendezvous DNS, a ConfigMap holding the spec and the rank table, and one Pod per
// node. Pure functions: the same job and placement always give the same objects,
// so creating them again is harmless (the API server answers AlreadyExists).
//
// Pod names carry the gang number (status.restarts), so a restarted gang never
// collides with pods of the previous one that are still terminating; hostnames do
// not, so DNS names are stable: <job>-<nodeRank>.<job>.<namespace>.svc.

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

// An ownerReference to the job (controller: true, blockOwnerDeletion: true).
nlohmann::json OwnerReference(const api::TrainingJob& job);

std::string ConfigMapName(const std::string& job_name);
std::string PodName(const std::string& job_name, int64_t gang, int64_t node_rank);

nlohmann::json BuildService(const api::TrainingJob& job);
// The ConfigMap of gang `gang`: job.json (`written_spec`, the spec as the user wrote it,
// from which every worker derives the same defaults and warnings that the operator
// did), rank-table.json.
nlohmann::json BuildConfigMap(const api::TrainingJob& job, const nlohmann::json& written_spec,
                              const api::RankTable& table, int64_t gang);
// `worker` gives a pod that uses EFA its hugepages, and /dev/shm its size limit.
nlohmann::json BuildPod(const api::TrainingJob& job, const api::RankTable& table, int64_t gang, int64_t node_rank,
                        const WorkerDefaults& worker = {});

}  // namespace meshtrain::controller
