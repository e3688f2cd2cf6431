#include "operator/controller/worker_readings.h"

#include <cmath>
#include <sstream>

#include "api/worker_contract.h"

namespace meshtrain::controller {

bool ParseProgress(const std::string& text, api::ProgressStatus* progress) {
  namespace m = api::worker::metric;
  std::istringstream in(text);
  std::string line;
  bool any = false;
  double steps_total = 0, tokens_per_step = 0;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    const size_t space = line.rfind(' ');
    if (space == std::string::npos) continue;
    std::string name = line.substr(0, space);
    name = name.substr(0, name.find('{'));
    double value;
    try {
      value = std::stod(line.substr(space + 1));
    } catch (const std::exception&) {
      continue;
    }
    if (name == m::kStep) progress->step = static_cast<int64_t>(value), any = true;
    else if (name == m::kLoss) progress->loss = value, any = true;
    else if (name == m::kTokensPerSecond) progress->tokens_per_second = std::round(value), any = true;
    else if (name == m::kSteps) steps_total = value;
    else if (name == m::kTokensPerStep) tokens_per_step = value;
    else if (name == m::kResumedFromStep && value >= 0) progress->resumed_from_step = static_cast<int64_t>(value);
    else if (name == m::kCheckpointLastStep && value >= 0) progress->checkpoint_step = static_cast<int64_t>(value);
    else if (name == m::kResumeDamagedCheckpoints && value > 0)
      progress->damaged_checkpoints = static_cast<int64_t>(value);
  }
  if (any && steps_total > progress->step && tokens_per_step > 0 && progress->tokens_per_second > 0)
    progress->eta_seconds =
        static_cast<int64_t>((steps_total - progress->step) * tokens_per_step / progress->tokens_per_second);
  return any;
}

std::optional<LauncherState> ParseLauncherState(const nlohmann::json& answer) {
  if (!answer.is_object() || !answer.contains("attempt") || !answer["attempt"].is_number_integer() ||
      !answer.contains("state") || !answer["state"].is_string())
    return std::nullopt;
  LauncherState s;
  s.attempt = answer["attempt"].get<int64_t>();
  s.state = answer["state"].get<std::string>();
  if (answer.contains("exitCode") && answer["exitCode"].is_number_integer()) s.exit_code = answer["exitCode"].get<int64_t>();
  if (answer.contains("rank") && answer["rank"].is_number_integer()) s.rank = answer["rank"].get<int64_t>();
  // A pod's words go into Events: kept short, on one line.
  if (answer.contains("reason") && answer["reason"].is_string())
    s.reason = api::worker::FailureReasonLine(answer["reason"].get<std::string>());
  if (answer.contains("ranks") && answer["ranks"].is_array()) {
    for (const nlohmann::json& r : answer["ranks"]) {
      if (!r.is_object() || !r.contains("rank") || !r["rank"].is_number_integer() || !r.contains("exitCode") ||
          !r["exitCode"].is_number_integer())
        return std::nullopt;
      RankEnd end{r["rank"].get<int64_t>(), r["exitCode"].get<int64_t>(), ""};
      if (r.contains("reason") && r["reason"].is_string())
        end.reason = api::worker::FailureReasonLine(r["reason"].get<std::string>());
      s.ranks.push_back(std::move(end));
    }
  }
  return s;
}

}  // namespace meshtrain::controller
