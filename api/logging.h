// One log format for every meshtrain binary, through spdlog, on stderr:
//   2026-11-21T17:33:56.123Z info  meshtrain: message

#pragma once

#include <string>
#include <vector>

namespace meshtrain {

// The accepted --log-level values: trace, debug, info, warn, error, critical, off.
const std::vector<std::string>& LogLevelNames();

// Installs the stderr logger for `program` at `level` as spdlog's default.
// Throws std::invalid_argument for a level outside LogLevelNames().
void InitLogging(const std::string& program, const std::string& level);

}  // namespace meshtrain
