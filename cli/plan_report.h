// How the commands print the layout planner's results (meshtrain plan --auto, meshtrain
// run with mode auto, meshtrain bench plan).

#pragma once

#include <optional>
#include <ostream>
#include <string>

#include <nlohmann/json.hpp>

#include "api/training_job.h"
#include "operator/scheduler/planner.h"

namespace meshtrain::cli {

// The device `flag` names ("cpu" or an EKS instance type), or else the placed nodes'
// (scheduler::DeviceForNodes). nullopt, with the reason in *why, when none is known.
std::optional<scheduler::DeviceModel> PlanDevice(const std::string& flag, const api::TrainingJobSpec& spec,
                                                 const std::vector<std::map<std::string, std::string>>& node_labels,
                                                 std::string* why);

// The layout a job without the planner gets: full sharding over all ranks, T = 1, the
// micro-batch the spec has, every activation kept.
scheduler::LayoutChoice DefaultChoice(const api::TrainingJobSpec& spec);

// "  T=2, S=4, micro-batch 8, keep all       12.3 GiB   0.4123 s    123456 tok/s   exposed 0.0123 s, 4 micro-steps";
// with stages "P=2 1F1B, T=1, ...", and at the end ", bubble 5.9%, p2p 4.0 MiB a step (waits 0.0123 s)".
std::string CandidateRow(const scheduler::Candidate& c);

// The device line, the top `top` candidates, `reference` (DefaultChoice) against the
// choice, and the rejected.
void PrintPlan(const scheduler::PlanRequest& request, const scheduler::Plan& plan, int top,
               const std::optional<scheduler::LayoutChoice>& reference, std::ostream& out);
nlohmann::json PlanJson(const scheduler::PlanRequest& request, const scheduler::Plan& plan, int top);

}  // namespace meshtrain::cli
