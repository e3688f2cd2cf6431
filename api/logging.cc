#include "api/logging.h"

#include <algorithm>
#include <stdexcept>

#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>

namespace meshtrain {

const std::vector<std::string>& LogLevelNames() {
  static const std::vector<std::string> names = {"trace", "debug", "info", "warn", "error", "critical", "off"};
  return names;
}

void InitLogging(const std::string& program, const std::string& level) {
  const auto& names = LogLevelNames();
  if (std::find(names.begin(), names.end(), level) == names.end()) {
    throw std::invalid_argument("unknown log level \"" + level + "\"");
  }
  auto logger = std::make_shared<spdlog::logger>(program, std::make_shared<spdlog::sinks::stderr_sink_mt>());
  logger->set_pattern("%Y-%m-%dT%H:%M:%S.%eZ %-5l %n: %v", spdlog::pattern_time_type::utc);
  logger->set_level(spdlog::level::from_str(level));
  spdlog::set_default_logger(std::move(logger));
}

}  // namespace meshtrain
