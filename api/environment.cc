#include "api/environment.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <stdexcept>
#include <string_view>

#include "api/worker_contract.h"

namespace meshtrain::api {

int EnvironmentRank(const char* name, int minimum) {
  return static_cast<int>(EnvironmentInteger(name, minimum, 1 << 20));
}

void WriteFailureReason(const std::string& reason) {
  const char* path = std::getenv(worker::env::kFailureFile);
  if (path == nullptr || *path == '\0') return;
  // A launcher's file in memory (/proc/self/fd/N) that this process did not inherit (a
  // parent closed its descriptors) must not become whatever file took that number.
  if (std::string_view(path).starts_with("/proc/self/fd/")) {
    char target[64] = {};
    if (::readlink(path, target, sizeof target - 1) < 0 || !std::string_view(target).starts_with("/memfd:")) return;
  }
  const std::string line = worker::FailureReasonLine(reason) + "\n";
  const int fd = ::open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return;
  for (size_t done = 0; done < line.size();) {
    const ssize_t wrote = ::write(fd, line.data() + done, line.size() - done);
    if (wrote < 0 && errno == EINTR) continue;
    if (wrote <= 0) break;
    done += size_t(wrote);
  }
  ::close(fd);
}

std::filesystem::path ThisProgram() {
  std::error_code error;
  std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", error);
  return error ? std::filesystem::path() : self;
}

std::string EnvironmentString(const char* name, const std::string& fallback) {
  const char* value = std::getenv(name);
  return value != nullptr && *value != '\0' ? value : fallback;
}

int64_t EnvironmentInteger(const char* name, int64_t minimum, int64_t maximum, std::optional<int64_t> fallback) {
  const std::string text = EnvironmentString(name);
  if (text.empty()) {
    if (fallback) return *fallback;
    throw std::runtime_error("the worker environment lacks " + std::string(name));
  }
  char* end = nullptr;
  errno = 0;
  const long long value = std::strtoll(text.c_str(), &end, 10);
  if (*end != '\0' || errno != 0 || value < minimum || value > maximum) {
    throw std::runtime_error(std::string(name) + "=\"" + text + "\" is not an integer in [" + std::to_string(minimum) +
                             ", " + std::to_string(maximum) + "]");
  }
  return value;
}

}  // namespace meshtrain::api
